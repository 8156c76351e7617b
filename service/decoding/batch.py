"""The running batch: decoder rows of many texts, each text with its own options.

A text owns ``beam_size`` contiguous rows. Every step runs the decoder on all
live rows at once, then each text chooses its next beams (``service.decoding.search``);
the rows are then reordered (state: every step; the per-row context only when
texts arrive or leave). Texts can join between steps (``add``: one encoder run,
then every row is padded to the longest source) and leave at any time.

The per-row context is the costly part to move (rows x src_len x 1,024
floats). A text that leaves is replaced in place by a text from the end of
the batch (``_compact_order``), so the other rows stay where they are, and
the arrays keep room after the live rows for texts that join.

Results do not depend on the batch: the graphs compute each row on its own
(padding is masked), and each text's search only sees its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from service.text import placeholders
from service.interface import Alignment, Hypothesis, Prepared, Translation
from service.decoding.runtime import EncoderOutput, Runtime, StepOutput
from service.decoding.search import Finished, SearchConfig, TextSearch, choose
from service.text.tokenizer import Tokenizer


_NO_ROWS = np.zeros(0, dtype=np.int64)
PAD_COLUMNS = 1  # masked source columns every row gets (see _width)
WIDTH_SLACK = 1.25  # keep up to 25% unneeded columns rather than copy the context to trim them
MAX_MOVED_SHARE = 0.5  # above this share of rows moving, build a fresh context instead
GROWTH, MIN_CAPACITY = 2, 16  # a new context allocation has room for this many times its rows


@dataclass
class _Text:
    key: Hashable
    prepared: Prepared
    search: TextSearch

    @property
    def src_len(self) -> int:
        return len(self.prepared.source_ids)


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    bos: int
    eos: int


class Batch:
    """A ``DecodeBatch`` over an ONNX Runtime ``Runtime`` (see ``service.interface``)."""

    def __init__(self, runtime: Runtime, tokenizer: Tokenizer, *, special: SpecialIds, vocab_size: int) -> None:
        self._runtime, self._tokenizer = runtime, tokenizer
        self._special, self._vocab_size = special, vocab_size
        self._texts: list[_Text] = []  # in row order
        self._prev = np.zeros(0, dtype=np.int64)  # (rows,)
        self._state: Any = None  # (rows, dec_hidden_size), where the provider keeps it
        self._annotations = self._keys = self._mask = None  # host copies, (rows, src_len, ...)
        self._backing: tuple[np.ndarray, ...] = ()  # the arrays they are the first rows of
        self._context: Any = None

    # -- the DecodeBatch interface ------------------------------------------------------

    @property
    def live_rows(self) -> int:
        return len(self._prev)

    @property
    def padded_tokens(self) -> tuple[int, int]:
        real = sum(t.search.rows * t.src_len for t in self._texts)
        width = 0 if self._mask is None else self._mask.shape[1]
        return real, self.live_rows * width

    def keys(self) -> list[Hashable]:
        return [t.key for t in self._texts]

    def add(self, items: Sequence[tuple[Hashable, Prepared]]) -> None:
        """Encode the texts (one encoder run) and append their rows."""
        if not items:
            return
        present = {t.key for t in self._texts}
        new_keys = [key for key, _ in items]
        if len(set(new_keys)) != len(new_keys) or present & set(new_keys):
            raise ValueError(f"keys already in the batch or repeated: {sorted(map(repr, new_keys))}")
        # longest first: short texts tend to finish first, and leavers at the end cost no copy
        ordered = sorted(items, key=lambda item: -len(item[1].source_ids))
        texts = [_Text(key=key, prepared=p, search=TextSearch(self._search_config(p))) for key, p in ordered]
        encoded = self._encode([t.prepared for t in texts])
        expand = np.repeat(np.arange(len(texts)), [t.search.rows for t in texts])  # (new_rows,)
        width = _width(self._texts + texts)
        if self._texts:  # after leavers the old rows may be a wider view (see _relayout): keep it
            width = max(width, self._mask.shape[1])
        self._append_context((encoded.annotations[expand], encoded.keys[expand],
                              _source_mask([t.src_len for t in texts], encoded.annotations.shape[1])[expand]),
                             width)
        state = encoded.init_state[expand]
        if self._texts:
            state = np.concatenate([self._runtime.host_state(self._state), state])
        self._state = self._runtime.state(state)
        self._prev = np.concatenate([self._prev, *(t.search.prev_tokens for t in texts)])
        self._texts.extend(texts)

    def step(self) -> list[tuple[Hashable, Translation]]:
        """One decoder step on every live row; returns the texts that finished."""
        if not self._texts:
            return []
        k = min(max(t.search.config.top_k for t in self._texts), self._vocab_size)
        out = self._runtime.step(self._prev, self._state, self._context, k)
        offsets = np.cumsum([0] + [t.search.rows for t in self._texts])
        next_rows: list[np.ndarray] = [_NO_ROWS] * len(self._texts)  # per text: rows of this step
        for beam, members in _by_beam_size(self._texts).items():
            self._choose(beam, members, offsets, out, next_rows)
        done = [t for t in self._texts if t.search.done]
        order = _compact_order(np.diff(offsets).tolist(), [not t.search.done for t in self._texts])
        # (next_rows,): the row of this step each next row continues, live texts in their new order
        row_index = np.concatenate([_NO_ROWS] + [next_rows[i] for i in order])
        self._texts = [self._texts[i] for i in order]
        self._prev = (np.concatenate([t.search.prev_tokens for t in self._texts]) if self._texts
                      else _NO_ROWS)
        self._state = self._runtime.gather_state(out.next_state, row_index)
        if done:  # a live text keeps its beam_size rows, which share its context block
            self._relayout(_block_rows(offsets, order))
        return [(t.key, self._translation(t)) for t in done]

    def _choose(self, beam: int, members: list[int], offsets: np.ndarray, out: StepOutput,
                next_rows: list[np.ndarray]) -> None:
        """The beam step of the texts ``members`` (indices into the row order), all of this beam
        size; fills their ``next_rows`` (batch rows of this step their next rows continue)."""
        texts = [self._texts[i] for i in members]
        width = 2 * beam
        if len(members) == len(self._texts):  # every row: no gather
            lp, ids = out.topk_log_probs[:, :width], out.topk_ids[:, :width]
        else:
            rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])
            lp, ids = out.topk_log_probs[rows, :width], out.topk_ids[rows, :width]
        shape = (len(texts), beam, lp.shape[1])
        choice = choose(np.stack([t.search.scores for t in texts]), lp.reshape(shape), beam_size=beam,
                        eos_id=self._special.eos, token_ids=ids.reshape(shape),
                        first_step=np.array([t.search.steps == 0 for t in texts]))
        batch_rows = choice.live_rows + offsets[members][:, None]  # (texts, beam)
        for n, (i, text) in enumerate(zip(members, texts)):
            attention = (out.attention[offsets[i]:offsets[i + 1], : text.src_len]
                         if text.search.config.keep_attention else None)
            text.search.apply(choice, n, attention)
            if not text.search.done:
                next_rows[i] = batch_rows[n]

    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop the rows of these texts (unknown keys are ignored)."""
        drop = set(keys)
        keep = [t.key not in drop for t in self._texts]
        if all(keep):
            return
        sizes = [t.search.rows for t in self._texts]
        order = _compact_order(sizes, keep)
        row_index = _block_rows(np.cumsum([0, *sizes]), order)
        self._texts = [self._texts[i] for i in order]
        self._prev = self._prev[row_index]
        self._state = self._runtime.gather_state(self._state, row_index)
        self._relayout(row_index)

    def prefix(self, key: Hashable) -> str:
        """The text all live beams of ``key`` agree on so far."""
        for text in self._texts:
            if text.key == key:
                return _partial_text(self._tokenizer, text.search.agreed_prefix(), text.prepared.placeholders)
        raise KeyError(key)

    # -- internals --------------------------------------------------------------------

    def _search_config(self, p: Prepared) -> SearchConfig:
        o = p.options
        return SearchConfig(beam_size=o.beam_size, num_hypotheses=o.num_hypotheses,
                            length_penalty=o.length_penalty,
                            max_length=o.max_target_length(len(p.source_ids)),
                            bos_id=self._special.bos, eos_id=self._special.eos,
                            keep_attention=o.return_attention)

    def _encode(self, prepared: list[Prepared]) -> EncoderOutput:
        lengths = np.array([len(p.source_ids) for p in prepared], dtype=np.int64)  # (batch,)
        src = np.full((len(prepared), int(lengths.max())), self._special.pad, dtype=np.int64)
        for row, p in enumerate(prepared):
            src[row, : len(p.source_ids)] = p.source_ids  # (batch, src_len)
        return self._runtime.encode(src, lengths)

    def _append_context(self, new: tuple[np.ndarray, ...], width: int) -> None:
        """Append rows (annotations, keys, mask; (new_rows, src_len, ...)) after the live rows,
        zero-padded (mask: False) to ``width`` columns."""
        start, end = self.live_rows, self.live_rows + len(new[0])
        if self._texts and width == self._mask.shape[1] and end <= len(self._backing[0]):
            backing = self._backing  # room after the live rows: the kept rows are not copied
        else:  # a wider source or no room: a new allocation, with room for texts joining later
            backing = tuple(np.zeros((max(end * GROWTH, MIN_CAPACITY), width, *b.shape[2:]), dtype=b.dtype)
                            for b in new)
            if self._texts:
                for target, rows in zip(backing, (self._annotations, self._keys, self._mask)):
                    target[:start, : rows.shape[1]] = rows
        for target, rows in zip(backing, new):
            target[start:end, : rows.shape[1]] = rows
            target[start:end, rows.shape[1]:] = 0
        self._backing = backing
        self._annotations, self._keys, self._mask = (b[:end] for b in backing)
        self._context = self._runtime.context(self._annotations, self._keys, self._mask)

    def _relayout(self, row_index: np.ndarray) -> None:
        """Gather the per-row context (rows ``row_index`` of the old layout) for the rows now
        live, trimmed to the longest source."""
        if not self._texts:
            self._annotations = self._keys = self._mask = self._context = None
            self._state, self._prev, self._backing = None, _NO_ROWS, ()
            return
        width, current = _width(self._texts), self._mask.shape[1]
        n = len(row_index)  # rows only leave here: n <= the rows the arrays hold
        moved = np.flatnonzero(row_index != np.arange(n))
        if width * WIDTH_SLACK >= current and len(moved) <= n * MAX_MOVED_SHARE:
            # rows stay where they are and a few move into the leavers' places (``_compact_order``),
            # in place (the right side is gathered before it is written); then a view of the first
            # rows. Extra masked columns do not change any row's result (see _width).
            for a in (self._annotations, self._keys, self._mask):
                a[moved] = a[row_index[moved]]
            self._annotations, self._keys, self._mask = (
                a[:n] for a in (self._annotations, self._keys, self._mask))
        else:  # (rows, src_len, ctx_size), (rows, src_len, attn_size), (rows, src_len)
            self._backing = tuple(a[row_index, :width] for a in (self._annotations, self._keys, self._mask))
            self._annotations, self._keys, self._mask = self._backing
        self._context = self._runtime.context(self._annotations, self._keys, self._mask)

    def _translation(self, text: _Text) -> Translation:
        p = text.prepared
        hyps = tuple(_hypothesis(self._tokenizer, p, f) for f in text.search.best())
        return Translation(hypotheses=hyps, source_tokens=p.source_pieces[:-1], steps=text.search.steps)


def _hypothesis(tokenizer: Tokenizer, p: Prepared, f: Finished) -> Hypothesis:
    tokens = list(f.tokens)
    alignments: tuple[Alignment, ...] = ()
    if p.options.return_attention and f.attention is not None:
        rows = f.attention[: len(tokens)]  # (tokens, src_len): the EOS row is not a token's
        alignments = tuple(
            Alignment(target_index=i, source_index=int(j), source_token=p.source_pieces[int(j)],
                      weights=tuple(float(w) for w in row))
            for i, (row, j) in enumerate(zip(rows, rows.argmax(axis=1))))
    return Hypothesis(text=tokenizer.decode(tokens, p.placeholders),
                      score=float(f.score) if p.options.return_scores else 0.0,
                      tokens=tuple(tokenizer.target_pieces(tokens)), alignments=alignments)


def _by_beam_size(texts: list[_Text]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(texts):
        groups.setdefault(t.search.config.beam_size, []).append(i)
    return groups


def _partial_text(tokenizer: Tokenizer, tokens: list[int], values: tuple[str, ...]) -> str:
    """Detokenize an unfinished prefix: restore the placeholders it has, append none."""
    text = tokenizer.target.decode(tokens)
    for k, value in enumerate(values):
        text = text.replace(placeholders.token(k), value)
    return text


def _source_mask(lengths: list[int], width: int) -> np.ndarray:
    return np.arange(width)[None, :] < np.array(lengths)[:, None]  # (batch, src_len) bool


def _compact_order(sizes: Sequence[int], keep: Sequence[bool]) -> list[int]:
    """The kept blocks (a text's rows; ``sizes`` rows each, in row order) in the order of a new
    layout that moves as few rows as possible.

    Blocks that lie inside the new layout (its first ``sum of kept sizes`` rows)
    stay; each kept block past its end moves into a dropped block of the same
    size inside it. When that cannot tile the new layout exactly, the kept
    blocks keep their relative order (everything after a leaver moves up).
    """
    kept = [i for i, k in enumerate(keep) if k]
    offsets = np.cumsum([0, *sizes]).tolist()
    n = sum(sizes[i] for i in kept)
    position = {i: offsets[i] for i in kept if offsets[i + 1] <= n}
    holes = [i for i, k in enumerate(keep) if not k and offsets[i + 1] <= n and sizes[i]]
    for i in kept:
        if i in position:
            continue
        hole = next((h for h in holes if sizes[h] == sizes[i]), None) if offsets[i] >= n else None
        if hole is None:
            return kept
        holes.remove(hole)
        position[i] = offsets[hole]
    return sorted(position, key=position.__getitem__)


def _block_rows(offsets: np.ndarray, order: list[int]) -> np.ndarray:
    """(rows,) the rows of blocks ``order`` (block i: rows offsets[i] to offsets[i + 1]), in order."""
    return np.concatenate([_NO_ROWS] + [np.arange(offsets[i], offsets[i + 1]) for i in order])


def _width(texts: list[_Text]) -> int:
    """The rows' src_len: the longest source plus ``PAD_COLUMNS`` masked columns.

    With at least one masked column, ONNX Runtime's fp32 decoder step gives
    every row the same bits whatever the width (measured: widths up to 256, any
    row subset); a row exactly as wide as its source can differ in the last
    bit. So a text decodes to the same bits alone or in any batch.
    """
    return max(t.src_len for t in texts) + PAD_COLUMNS
