"""Beam search as pure numpy: the batched per-step choice, and the history it leaves.

The algorithm (fairseq's ``BeamSearch`` with its finishing rules), shared with
the PyTorch reference ``export.search.beam_search``:

- A text starts with ``beam_size`` identical rows (BOS, the encoder's s_0);
  the first step therefore looks at row 0 only.
- Each step, every live hypothesis h with running score s_h (the sum of its
  token log-probabilities) is extended by every token y; the candidates are
  ranked by s_h + log p(y | h), best first, ties broken by the lower row, then
  the lower token id. Of the ``2 * beam_size`` best candidates:
  those ending in EOS *among the first* ``beam_size`` become finished
  hypotheses; the first ``beam_size`` not ending in EOS are the next live beams
  (there always are enough: each row contributes at most one EOS).
- A text is done when it has ``beam_size`` finished hypotheses, or when its live
  hypotheses reach ``max_length`` target tokens (EOS excluded): they are then
  finished as they are, without EOS.
- Finished hypotheses are ranked by the length-normalized score

      score / length ** length_penalty

  where ``length`` counts the target tokens including the final EOS (a
  hypothesis stopped by the length limit has no EOS: ``length`` = its tokens);
  ties keep the order in which the hypotheses finished. ``length_penalty`` 0
  ranks by the raw sum of log-probabilities.

Greedy decoding is ``beam_size`` 1. ``choose`` decides the step of many texts
of one beam size at once; ``apply`` turns that into the rows of the next step;
``History`` keeps each step's tokens and backpointers for every row of a batch,
so that the per-step path has no per-text Python loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

NEG_INF = float("-inf")
"""Score of a candidate that must never be chosen (rows other than 0 at the first step)."""


@dataclass(frozen=True)
class BeamChoice:
    """One step of many texts with the same beam size (``choose``)."""

    scores: np.ndarray  # (texts, 2 * beam) float64, the best candidates, best first
    tokens: np.ndarray  # (texts, 2 * beam) int64
    rows: np.ndarray  # (texts, 2 * beam) int64, the row within the text each extends
    finished: np.ndarray  # (texts, beam) bool: candidate j < beam ends in EOS
    live_scores: np.ndarray  # (texts, beam) the next live beams: first beam non-EOS candidates
    live_tokens: np.ndarray  # (texts, beam)
    live_rows: np.ndarray  # (texts, beam)


def _ranked(scores: np.ndarray, log_probs: np.ndarray, count: int, token_ids: np.ndarray | None,
            first_step: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``count`` best candidates per text: (scores, tokens, rows), each (texts, count).

    Ties keep the flat order: lower row, then the column order of ``log_probs``
    (token id for the whole vocabulary; the top-k order, lower id first, otherwise).
    """
    texts, beam, width = log_probs.shape
    total = scores.astype(np.float64)[:, :, None] + log_probs  # (texts, beam, width)
    if first_step is not None and beam > 1 and first_step.any():
        total[first_step, 1:] = NEG_INF  # identical rows: only row 0 counts
    flat = total.reshape(texts, beam * width)
    pick = np.arange(texts)[:, None]  # (texts, 1), with order: flat[pick, order]
    if beam == 1 and token_ids is not None:  # one row of sorted top-k: already in rank order
        ids = token_ids.reshape(texts, width)[:, :count]
        return flat[:, :count], ids.astype(np.int64, copy=False), np.zeros((texts, count), dtype=np.int64)
    order = np.argsort(-flat, axis=1, kind="stable")[:, :count]  # (texts, count)
    ids = order % width if token_ids is None else token_ids.reshape(texts, beam * width)[pick, order]
    return flat[pick, order], ids.astype(np.int64, copy=False), order // width


def choose(scores: np.ndarray, log_probs: np.ndarray, *, beam_size: int, eos_id: int,
           token_ids: np.ndarray | None = None, first_step: np.ndarray | None = None) -> BeamChoice:
    """The beam step of many texts at once (see the module docstring for the rule).

    ``scores`` (texts, beam) running scores; ``log_probs`` (texts, beam, vocab_size),
    or top-k candidates (texts, beam, k) sorted descending with ids ``token_ids``
    (texts, beam, k); k >= 2 (>= 2 * beam_size for the choice over the whole
    vocabulary). ``first_step`` (texts,) bool marks texts at their first step.
    """
    count = min(2 * beam_size, log_probs.shape[1] * log_probs.shape[2])
    cand_scores, tokens, rows = _ranked(scores, log_probs, count, token_ids, first_step)
    is_eos = tokens == eos_id  # (texts, count)
    if beam_size == 1:  # the first candidate, or the second when the first is EOS
        live = is_eos[:, :1].astype(np.int64)  # (texts, 1)
    else:  # each row yields at most one EOS, so 2 * beam candidates hold beam that are not EOS
        live = np.argsort(is_eos, axis=1, kind="stable")[:, :beam_size]  # (texts, beam)
    pick = np.arange(len(live))[:, None]
    return BeamChoice(scores=cand_scores, tokens=tokens, rows=rows, finished=is_eos[:, :beam_size],
                      live_scores=cand_scores[pick, live], live_tokens=tokens[pick, live],
                      live_rows=rows[pick, live])


@dataclass(frozen=True)
class Applied:
    """The rows of the next step of the texts of one ``choose``, in their block order."""

    scores: np.ndarray  # (texts * beam,) running scores of the next live beams
    tokens: np.ndarray  # (texts * beam,) the token each one appended
    parents: np.ndarray  # (texts * beam,) the batch row (of this step) each one extends
    ended: list[tuple[int, int, float]]  # (text, batch row extended, score) of each EOS hypothesis


def apply(choice: BeamChoice, block_starts: np.ndarray) -> Applied:
    """``choice`` for texts whose rows start at batch rows ``block_starts`` (texts,)."""
    parents = (block_starts[:, None] + choice.live_rows).reshape(-1)
    ended: list[tuple[int, int, float]] = []
    if choice.finished.any():  # rare: most steps finish nothing
        for text, j in zip(*np.nonzero(choice.finished)):
            ended.append((int(text), int(block_starts[text] + choice.rows[text, j]),
                          float(choice.scores[text, j])))
    return Applied(scores=choice.live_scores.reshape(-1), tokens=choice.live_tokens.reshape(-1),
                   parents=parents, ended=ended)


def greedy(scores: np.ndarray, log_probs: np.ndarray, token_ids: np.ndarray, *, eos_id: int,
           block_starts: np.ndarray) -> Applied:
    """``apply(choose(...), block_starts)`` for beam size 1, the same results without the general ranking
    (the per-step path of greedy texts): ``scores`` (texts,), ``log_probs`` and ``token_ids`` (texts, k >= 2)
    the top-k sorted descending. Each text takes its best token, or its second when the best is EOS (which
    finishes it)."""
    total = scores.astype(np.float64)[:, None] + log_probs[:, :2]  # (texts, 2)
    eos = token_ids[:, 0] == eos_id
    pick, live = np.arange(len(total)), eos.astype(np.int64)
    ended = [(t, int(block_starts[t]), float(total[t, 0])) for t in np.flatnonzero(eos).tolist()]
    return Applied(scores=total[pick, live], tokens=token_ids[pick, live].astype(np.int64, copy=False),
                   parents=block_starts.astype(np.int64, copy=True), ended=ended)


def normalized_score(score: float, *, length: int, length_penalty: float) -> float:
    """``score / length ** length_penalty``; length counts target tokens including EOS."""
    return score / max(length, 1) ** length_penalty


class History:
    """Every step's tokens and backpointers for all rows of a batch.

    Entry ``s`` holds, for each row of step ``s + 1``'s input, the token step
    ``s`` appended and the row of step ``s``'s input it extends (``-1``: a row
    that joined after step ``s``), and optionally step ``s``'s attention rows.
    Relayouts between steps reindex the last entry only.
    """

    def __init__(self) -> None:
        self.steps = 0  # steps recorded so far: the index of the next one
        self._base = 0  # the step of _entries[0]
        self._entries: deque[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = deque()

    def record(self, tokens: np.ndarray, parents: np.ndarray, attention: np.ndarray | None) -> None:
        self._entries.append((tokens, parents, attention))
        self.steps += 1

    def reorder(self, positions: np.ndarray) -> None:
        """The next input's rows are now rows ``positions`` of the previous layout
        (-1: a new row)."""
        if not self._entries:
            return
        tokens, parents, attention = self._entries[-1]
        old = positions >= 0
        new_tokens, new_parents = np.full(len(positions), -1), np.full(len(positions), -1)
        new_tokens[old], new_parents[old] = tokens[positions[old]], parents[positions[old]]
        self._entries[-1] = (new_tokens, new_parents, attention)

    def forget_before(self, step: int) -> None:
        """Drop entries older than ``step`` (no live text started before it)."""
        while self._entries and self._base < step:
            self._entries.popleft()
            self._base += 1

    def path(self, last: int, position: int, start: int) -> tuple[list[int], list[int]]:
        """Tokens of the hypothesis at ``position`` of entry ``last``, back to step ``start``,
        and the input row it used at each of those steps: (tokens, rows), oldest first."""
        tokens, rows = [], []
        for s in range(last, start - 1, -1):
            entry_tokens, entry_parents, _ = self._entries[s - self._base]
            tokens.append(int(entry_tokens[position]))
            position = int(entry_parents[position])
            rows.append(position)
        return tokens[::-1], rows[::-1]

    def attention(self, step: int, row: int, width: int) -> np.ndarray:
        """Step ``step``'s attention row ``row`` (first ``width`` columns)."""
        att = self._entries[step - self._base][2]
        assert att is not None, "attention was not recorded for this step"
        return att[row, :width]
