"""Source/target SentencePiece models with placeholder protection (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from service.text import placeholders

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
"""Special ids, the same in both SentencePiece models (set when they are trained)."""


@dataclass(frozen=True)
class Encoded:
    """A source message ready for the encoder."""

    ids: list[int]  # source piece ids, EOS last
    pieces: list[str]  # the pieces of ``ids`` (EOS shown as ``</s>``)
    placeholders: tuple[str, ...]  # to restore in the translation


class Tokenizer:
    """Protects placeholders, splits into pieces, and back."""

    def __init__(self, source_model: Path, target_model: Path) -> None:
        self.source = _load(source_model)
        self.target = _load(target_model)

    def encode(self, text: str) -> Encoded:
        protected = placeholders.protect(text)
        ids = self.source.encode(protected.text) + [EOS_ID]
        return Encoded(ids=ids, pieces=[self.source.id_to_piece(i) for i in ids],
                       placeholders=protected.placeholders)

    def encode_target(self, text: str) -> list[int]:
        """Target ids of an already protected text (training), EOS last."""
        return self.target.encode(text) + [EOS_ID]

    def decode(self, ids: list[int], placeholder_values: tuple[str, ...]) -> str:
        """Target ids (without EOS) -> text with the source's placeholders restored."""
        return placeholders.restore(self.target.decode(ids), placeholder_values)

    def target_pieces(self, ids: list[int]) -> list[str]:
        return [self.target.id_to_piece(i) for i in ids]


def _load(path: Path) -> spm.SentencePieceProcessor:
    if not Path(path).is_file():
        raise ValueError(f"{path}: SentencePiece model does not exist")
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a SentencePiece model ({e})") from None
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise ValueError(f"{path}: special ids must be pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID}")
    return sp
