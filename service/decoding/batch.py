"""The running batch: decoder rows of many texts, each text with its own options.

A text owns ``beam_size`` contiguous rows. Every step runs the decoder on all
live rows at once; then the texts of each beam size choose their next beams
together (``search.choose`` and ``search.apply``: no per-text Python loop on
the per-step path), the step's tokens and backpointers go into one
``search.History`` for all rows, and the rows are reordered (state: every
step; the per-row context, ``layout.RowContext``, only when texts arrive or
leave). Texts join between steps (``add``: one encoder run) and leave at any
time. The batch works in token ids: a finished text comes back as a
``Decoded`` (ids, scores, attention); its text is made elsewhere
(``service.text.render``).

Results do not depend on the batch: the graphs compute each row on its own
(padding is masked), and each text's choice only sees its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from service.decoding import layout, shortlist, shortlist_rows
from service.decoding.runtime import Runtime, StepOutput
from service.decoding.search import History, apply, choose, greedy, normalized_score
from service.interface import Decoded, Finished, Key, Prepared, SpecialIds

FORGET_EVERY = 64  # steps between drops of history no live text needs


@dataclass(eq=False)
class _Text:
    key: Key
    prepared: Prepared
    start: int  # the history step of its first decoder step
    candidates: np.ndarray | None = None  # (n,) target ids it may produce (the shortlist; per row: but the
    # always-words), None: all
    finished: list[Finished] = field(default_factory=list)

    @property
    def src_len(self) -> int:
        return len(self.prepared.source_ids)


@dataclass(frozen=True)
class Encoded:
    """Texts encoded for ``Batch.join``, longest first: plain arrays, so that they can cross to
    another process."""

    items: list[tuple[Key, Prepared]]
    candidates: list[np.ndarray | None]  # per text: its shortlist's target ids (None: all)
    runs: list[tuple[int, int]]  # (start, end) of each encoder run (``layout.encoder_runs``)
    outputs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per run: annotations, keys, init_state


def encode(runtime: Runtime, pad: int, items: Sequence[tuple[Key, Prepared]]) -> Encoded:
    """Run the encoder on ``items``: one run per group of similar lengths (less padding)."""
    # longest first: short texts tend to finish first, and leavers at the end cost no copy
    ordered = sorted(items, key=lambda item: -len(item[1].source_ids))
    lists = runtime.shortlist
    lengths = [len(p.source_ids) for _, p in ordered]
    runs, outputs = layout.encoder_runs(lengths), []
    for start, end in runs:
        src, run_lengths = layout.pad_sources([p.source_ids for _, p in ordered[start:end]], pad)
        out = runtime.encode(src, run_lengths)
        outputs.append((out.annotations, out.keys, out.init_state))
    return Encoded(items=ordered, runs=runs, outputs=outputs,
                   candidates=[None if lists is None else lists.of_text(p.source_ids, own=runtime.shortlist_rows)
                               for _, p in ordered])


class Batch:
    """A ``DecodeBatch`` over an ONNX Runtime ``Runtime`` (see ``service.interface``)."""

    def __init__(self, runtime: Runtime, *, special: SpecialIds, vocab_size: int) -> None:
        self._runtime, self._special, self._vocab_size = runtime, special, vocab_size
        self._texts: list[_Text] = []  # in row order
        # per text, in row order: rows (beam_size), first step, target length limit, source
        # length, hypotheses finished so far
        self._beams = self._starts = self._limits = self._lengths = self._ended = layout.NO_ROWS
        self._prev = layout.NO_ROWS  # (rows,) the tokens the next step reads
        self._scores = np.zeros(0, dtype=np.float64)  # (rows,) running scores
        self._state: Any = None  # (rows, state_size), where the provider keeps it
        self._context = layout.row_context(runtime)
        self._history = History()
        self._attention = 0  # texts that keep attention
        self._layout: tuple[np.ndarray, list] = (np.zeros(1, dtype=np.int64), [])  # see _new_layout
        self._candidates: shortlist.Candidates | None = None  # the shortlist's inputs for this layout

    # -- the DecodeBatch interface ------------------------------------------------------

    @property
    def live_rows(self) -> int:
        return len(self._prev)

    @property
    def padded_tokens(self) -> tuple[int, int]:
        """(real, padded) source tokens of the live rows, padded to the batch's width (``layout.width``;
        a context may keep more columns, which no step computes with the fused attention)."""
        columns = layout.width(int(self._lengths.max())) if self._texts else 0
        return int(self._beams @ self._lengths), self.live_rows * columns

    def add(self, items: Sequence[tuple[Key, Prepared]]) -> None:
        """Encode the texts (one encoder run per group of similar lengths, ``layout.encoder_runs``)
        and append their rows."""
        if items:
            self.join(encode(self._runtime, self._special.pad, items))

    def join(self, encoded: Encoded) -> None:
        """Append the rows of texts encoded by ``encode`` (here, or in another process on the same
        graphs: ``service.scheduling.remote``)."""
        new_keys = {key for key, _ in encoded.items}
        if len(new_keys) != len(encoded.items) or new_keys & {t.key for t in self._texts}:
            raise ValueError(f"keys already in the batch or repeated: {sorted(map(repr, new_keys))}")
        texts = [_Text(key=key, prepared=p, start=self._history.steps, candidates=c)
                 for (key, p), c in zip(encoded.items, encoded.candidates)]
        lengths = np.array([t.src_len for t in texts], dtype=np.int64)
        beams = np.array([t.prepared.rows for t in texts], dtype=np.int64)
        columns = max(layout.width(int(lengths.max())), self._context.columns)
        parts, states = [], []
        for (start, end), (annotations, keys, init_state) in zip(encoded.runs, encoded.outputs):
            expand = np.repeat(np.arange(end - start), beams[start:end])  # (run's rows,) text of each row
            mask = layout.source_mask(lengths[start:end], annotations.shape[1])
            parts.append((annotations[expand], keys[expand], mask[expand]))
            states.append(init_state[expand])
        self._context.append(parts, columns)
        new_rows = int(beams.sum())
        state = np.concatenate(states)
        self._state = self._runtime.join_states(self._state if self._texts else None, state)
        self._history.reorder(np.concatenate([np.arange(self.live_rows), np.full(new_rows, -1)]))
        self._prev = np.concatenate([self._prev, np.full(new_rows, self._special.bos, dtype=np.int64)])
        self._scores = np.concatenate([self._scores, np.zeros(new_rows)])
        self._beams = np.concatenate([self._beams, beams])
        self._starts = np.concatenate([self._starts, np.full(len(texts), self._history.steps)])
        self._limits = np.concatenate([self._limits, [t.prepared.max_length for t in texts]])
        self._lengths = np.concatenate([self._lengths, lengths])
        self._ended = np.concatenate([self._ended, np.zeros(len(texts), dtype=np.int64)])
        self._texts.extend(texts)
        self._attention += sum(t.prepared.options.return_attention for t in texts)
        self._new_layout()

    def step(self) -> list[tuple[Key, Decoded]]:
        """One decoder step on every live row; returns the texts that finished."""
        if not self._texts:
            return []
        k = min(2 * int(self._beams.max()), self._vocab_size)
        out = self._runtime.step(self._prev, self._state, self._context.device, k, self._candidates)
        step = self._history.steps
        offsets = self._offsets  # (texts + 1,)
        tokens, parents = np.empty_like(self._prev), np.empty_like(self._prev)
        ended: list[tuple[int, int, float]] = []  # (text, row, score) of EOS hypotheses
        for beam, members in self._groups():
            rows = None if members is None else (offsets[members][:, None] + np.arange(beam)).reshape(-1)
            applied = self._choose(out, beam, members, rows, offsets)
            place = slice(None) if rows is None else rows
            self._scores[place], tokens[place], parents[place] = applied.scores, applied.tokens, applied.parents
            ended += [(t if members is None else int(members[t]), r, s) for t, r, s in applied.ended]
        self._history.record(tokens, parents, out.attention if self._attention else None)
        for text, row, score in ended:
            self._finish(text, last=step - 1, position=row, score=score, eos_row=row)
        self._finish_at_limit(step, offsets)
        done = self._ended >= self._beams  # (texts,)
        if not done.any():  # the common step: every row stays where it is
            self._prev = tokens
            self._state = self._runtime.gather_state(out.next_state, parents)
            self._forget(step)
            return []
        order = layout.compact_order(self._beams.tolist(), (~done).tolist())
        row_index = layout.block_rows(offsets, order)  # (next_rows,) positions kept, in order
        finished = [(self._texts[i].key, self._decoded(self._texts[i], step + 1))
                    for i in np.flatnonzero(done).tolist()]
        self._history.reorder(row_index)
        self._prev, self._scores = tokens[row_index], self._scores[row_index]
        self._state = self._runtime.gather_state(out.next_state, parents[row_index])
        self._keep(order, row_index)
        self._forget(step)
        return finished

    def remove(self, keys: Sequence[Key]) -> None:
        """Drop the rows of these texts (unknown keys are ignored)."""
        drop = set(keys)
        keep = [t.key not in drop for t in self._texts]
        if all(keep):
            return
        order = layout.compact_order(self._beams.tolist(), keep)
        row_index = layout.block_rows(self._offsets, order)
        self._history.reorder(row_index)
        self._prev, self._scores = self._prev[row_index], self._scores[row_index]
        self._state = self._runtime.gather_state(self._state, row_index)
        self._keep(order, row_index)

    def prefix(self, key: Key) -> list[int]:
        """The target ids all live beams of ``key`` agree on so far."""
        offsets = self._offsets
        for i, text in enumerate(self._texts):
            if text.key == key:
                last = self._history.steps - 1
                if last < text.start:
                    return []
                paths = [self._history.path(last, r, text.start)[0] for r in range(offsets[i], offsets[i + 1])]
                agreed = 0
                while agreed < len(paths[0]) and all(p[agreed] == paths[0][agreed] for p in paths):
                    agreed += 1
                return paths[0][:agreed]
        raise KeyError(key)

    # -- internals --------------------------------------------------------------------

    def _forget(self, step: int) -> None:
        """Now and then, drop the history no live text needs."""
        if step % FORGET_EVERY == 0 and self._texts:
            self._history.forget_before(int(self._starts.min()))

    def _groups(self) -> list[tuple[int, np.ndarray | None]]:
        """(beam size, its texts in row order); None: every text."""
        return self._layout[1]

    @property
    def _offsets(self) -> np.ndarray:
        """(texts + 1,) the first row of each text's block, and the row count."""
        return self._layout[0]

    def _new_layout(self) -> None:
        """Offsets and beam-size groups of the current texts (they change only when texts
        join or leave, not every step)."""
        beams = self._beams
        sizes = np.unique(beams) if len(beams) and (beams != beams[0]).any() else beams[:1]  # (unique's sort is slow)
        groups = [(int(sizes[0]), None)] if len(sizes) == 1 else [(int(b), np.flatnonzero(beams == b)) for b in sizes]
        offsets = np.zeros(len(beams) + 1, np.int64)
        np.cumsum(beams, out=offsets[1:])
        self._layout = (offsets, groups)
        self._candidates = None
        lists, texts = self._runtime.shortlist, [t.candidates for t in self._texts]
        if lists is not None and texts:
            self._candidates = (shortlist_rows.candidates(texts, self._beams, len(lists.always))
                                if self._runtime.shortlist_rows else
                                shortlist.candidates(self._runtime.output_layer, texts, self._beams,
                                                     pad_id=self._special.pad))

    def _choose(self, out: StepOutput, beam: int, members: np.ndarray | None, rows: np.ndarray | None,
                offsets: np.ndarray):
        """The beam step of the texts ``members`` (None: all), all of beam size ``beam``."""
        width = 2 * beam
        lp, ids = out.topk_log_probs[:, :width], out.topk_ids[:, :width]
        scores, starts = self._scores, self._starts
        block_starts = offsets[:-1]
        if rows is not None:
            lp, ids, scores = lp[rows], ids[rows], scores[rows]
            starts, block_starts = starts[members], block_starts[members]
        if beam == 1 and lp.shape[1] >= 2:  # greedy: the same choice without the general ranking
            return greedy(scores, lp, ids, eos_id=self._special.eos, block_starts=block_starts)
        shape = (len(starts), beam, lp.shape[1])
        choice = choose(scores.reshape(shape[:2]), lp.reshape(shape), beam_size=beam, eos_id=self._special.eos,
                        token_ids=ids.reshape(shape), first_step=starts == self._history.steps)
        return apply(choice, block_starts)

    def _finish_at_limit(self, step: int, offsets: np.ndarray) -> None:
        """Texts at their length limit finish their live beams as they are."""
        at_limit = (step + 1 - self._starts >= self._limits) & (self._ended < self._beams)
        for i in np.flatnonzero(at_limit).tolist():
            for position in range(offsets[i], offsets[i + 1]):
                self._finish(i, last=step, position=position, score=float(self._scores[position]))

    def _finish(self, i: int, *, last: int, position: int, score: float, eos_row: int | None = None) -> None:
        """Record a hypothesis of text ``i``: the path at ``position`` of history step ``last``,
        plus EOS read at input row ``eos_row`` of the step after it."""
        text = self._texts[i]
        self._ended[i] += 1
        tokens, rows = self._history.path(last, position, text.start) if last >= text.start else ([], [])
        length = len(tokens) + (eos_row is not None)
        attention = None
        if text.prepared.options.return_attention:
            steps = list(zip(range(text.start, last + 1), rows)) + ([(last + 1, eos_row)] if eos_row is not None else [])
            attention = np.stack([self._history.attention(s, r, text.src_len) for s, r in steps])
        text.finished.append(Finished(
            tokens=tuple(tokens), score=score, length=length, attention=attention,
            normalized=normalized_score(score, length=length,
                                        length_penalty=text.prepared.options.length_penalty)))

    def _decoded(self, text: _Text, steps_done: int) -> Decoded:
        ranked = sorted(text.finished, key=lambda f: -f.normalized)  # stable: ties keep finishing order
        return Decoded(hypotheses=tuple(ranked[: text.prepared.options.num_hypotheses]),
                       steps=steps_done - text.start)

    def _keep(self, order: list[int], row_index: np.ndarray) -> None:
        """Keep texts ``order`` (their rows ``row_index`` of the current layout)."""
        if self._attention:  # texts returning attention: count those leaving
            gone = set(range(len(self._texts))) - set(order)
            self._attention -= sum(self._texts[i].prepared.options.return_attention for i in gone)
        self._texts = [self._texts[i] for i in order]
        self._beams, self._starts, self._limits, self._lengths, self._ended = (
            a[order] for a in (self._beams, self._starts, self._limits, self._lengths, self._ended))
        self._new_layout()
        if not self._texts:
            self._history.forget_before(self._history.steps)
            self._context.clear()
            self._state, self._prev, self._scores = None, layout.NO_ROWS, np.zeros(0)
            return
        self._context.gather(row_index, layout.width(int(self._lengths.max())))
