"""Source/target SentencePiece models with placeholder protection (torch-free)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from service.interface import SpecialIds
from service.text import placeholders

TRAINED_WITH = SpecialIds()
"""The special ids both SentencePiece models are trained with (``export.tokenizers``);
a model repository's manifest records them, and the server takes them from there."""
PAD_ID, UNK_ID, BOS_ID, EOS_ID = TRAINED_WITH.pad, TRAINED_WITH.unk, TRAINED_WITH.bos, TRAINED_WITH.eos
UNKNOWN_CACHE = 4096  # characters whose <unk>-ness is remembered


@dataclass(frozen=True)
class Encoded:
    """A source message ready for the encoder."""

    ids: list[int]  # source piece ids, EOS last
    pieces: list[str]  # the pieces of ``ids`` (EOS shown as ``</s>``)
    placeholders: tuple[str, ...]  # to restore in the translation


class Tokenizer:
    """Protects placeholders, splits into pieces, and back."""

    def __init__(self, source_model: Path, target_model: Path, *, special: SpecialIds = TRAINED_WITH) -> None:
        self.special = special
        self.source = _load(source_model, special)
        self.target = _load(target_model, special)
        # per character, bounded: a client sending every code point must not grow it without end
        self.unknown = functools.lru_cache(maxsize=UNKNOWN_CACHE)(self._unknown)
        self._known: set[str] = set()  # characters seen that the source model reads (at most UNKNOWN_CACHE)
        # each id's piece, looked up in a list (SentencePiece's id_to_piece is a call per id)
        self._source_pieces = [self.source.id_to_piece(i) for i in range(self.source.get_piece_size())]
        self._target_pieces = [self.target.id_to_piece(i) for i in range(self.target.get_piece_size())]

    def _unknown(self, ch: str) -> bool:
        """Whether the source model can only read ``ch`` as ``<unk>`` (after its normalization:
        ``…`` has no piece of its own but reads as ``...``, so the vocabulary alone cannot tell)."""
        return self.special.unk in self.source.encode(ch)

    def encode(self, text: str) -> Encoded:
        protected = placeholders.protect(text, self.unknown if self._unseen(text) else None)
        ids = self.source.encode(protected.text) + [self.special.eos]
        return Encoded(ids=ids, pieces=[self._source_pieces[i] for i in ids], placeholders=protected.placeholders)

    def _unseen(self, text: str) -> bool:
        """Whether ``text`` has a character not yet known to be read by the source model (then
        ``protect`` looks for runs of unknown ones; a text of known characters has none)."""
        chars = set(text)
        if chars <= self._known:
            return False
        if len(self._known) < UNKNOWN_CACHE:
            self._known.update(ch for ch in chars if ch.isspace() or not self.unknown(ch))
        return True

    def encode_target(self, text: str) -> list[int]:
        """Target ids of an already protected text (training), EOS last."""
        return self.target.encode(text) + [self.special.eos]

    def decode(self, ids: list[int], placeholder_values: tuple[str, ...], *, complete: bool = True) -> str:
        """Target ids (without EOS) -> text with the source's placeholders restored
        (``complete=False``: an unfinished prefix, see ``placeholders.restore``)."""
        return placeholders.restore(self.target.decode(ids), placeholder_values, complete=complete)

    def target_pieces(self, ids: list[int]) -> list[str]:
        return [self._target_pieces[i] for i in ids]


def _load(path: Path, special: SpecialIds) -> spm.SentencePieceProcessor:
    if not Path(path).is_file():
        raise ValueError(f"{path}: SentencePiece model does not exist")
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a SentencePiece model ({e})") from None
    want = (special.pad, special.unk, special.bos, special.eos)
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != want:
        raise ValueError(f"{path}: special ids must be pad={want[0]} unk={want[1]} bos={want[2]} "
                         f"eos={want[3]} (the manifest's special_ids), got pad={sp.pad_id()} "
                         f"unk={sp.unk_id()} bos={sp.bos_id()} eos={sp.eos_id()}")
    return sp
