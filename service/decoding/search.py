"""Beam search as pure numpy: the per-step choice and the state of one text.

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

Greedy decoding is ``beam_size`` 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEG_INF = float("-inf")
"""Score of a candidate that must never be chosen (rows other than 0 at the first step)."""

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Continuations:
    """Chosen (score, token, row) triples of one text, best first."""

    scores: np.ndarray  # (n,) float64, running score after the step
    tokens: np.ndarray  # (n,) int64, the token appended
    rows: np.ndarray  # (n,) int64, the input row (beam) each one extends


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
    if first_step is not None and first_step.any():
        total[first_step, 1:] = NEG_INF  # identical rows: only row 0 counts
    flat = total.reshape(texts, beam * width)
    pick = np.arange(texts)[:, None]  # (texts, 1), with order: flat[pick, order]
    if beam == 1 and token_ids is not None:  # one row of sorted top-k: already in rank order
        order = np.broadcast_to(np.arange(count), (texts, count))
    else:
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
    # each row yields at most one EOS, so 2 * beam candidates hold beam that are not EOS
    live = np.argsort(is_eos, axis=1, kind="stable")[:, :beam_size]  # (texts, beam)
    pick = np.arange(len(live))[:, None]
    return BeamChoice(scores=cand_scores, tokens=tokens, rows=rows, finished=is_eos[:, :beam_size],
                      live_scores=cand_scores[pick, live], live_tokens=tokens[pick, live],
                      live_rows=rows[pick, live])


def top_continuations(scores: np.ndarray, log_probs: np.ndarray, *, count: int,
                      token_ids: np.ndarray | None = None, first_step: bool = False) -> Continuations:
    """The ``count`` best one-token continuations of one text's rows, best first.

    ``scores`` (beam,), ``log_probs`` (beam, vocab_size) or top-k (beam, k) with
    ``token_ids`` (beam, k). Ties: lower row first, then lower token id.
    """
    s, t, r = _ranked(scores[None], log_probs[None], count, None if token_ids is None else token_ids[None],
                      np.array([first_step]))
    return Continuations(scores=s[0], tokens=t[0], rows=r[0])


@dataclass(frozen=True)
class BeamStep:
    """The outcome of one step of one text."""

    live: Continuations  # the next live beams (no EOS), best first
    finished: Continuations  # EOS continuations among the beam_size best candidates


def beam_step(scores: np.ndarray, log_probs: np.ndarray, *, beam_size: int, eos_id: int,
              token_ids: np.ndarray | None = None, first_step: bool = False) -> BeamStep:
    """``choose`` for one text: ``scores`` (beam,), ``log_probs`` (beam, vocab_size)
    or top-k (beam, k) with ``token_ids`` (beam, k)."""
    c = choose(scores[None], log_probs[None], beam_size=beam_size, eos_id=eos_id,
               token_ids=None if token_ids is None else token_ids[None], first_step=np.array([first_step]))
    done = np.flatnonzero(c.finished[0])
    return BeamStep(live=Continuations(scores=c.live_scores[0], tokens=c.live_tokens[0], rows=c.live_rows[0]),
                    finished=Continuations(scores=c.scores[0, done], tokens=c.tokens[0, done],
                                           rows=c.rows[0, done]))


def normalized_score(score: float, *, length: int, length_penalty: float) -> float:
    """``score / length ** length_penalty``; length counts target tokens including EOS."""
    return score / max(length, 1) ** length_penalty


@dataclass(frozen=True)
class Finished:
    """One finished hypothesis of a text."""

    tokens: tuple[int, ...]  # target ids, EOS excluded
    score: float  # sum of log-probabilities (EOS included when it ended with EOS)
    length: int  # tokens + 1 with EOS, tokens without (length limit)
    normalized: float  # score / length ** length_penalty
    attention: np.ndarray | None  # (length, src_len), with keep_attention


@dataclass(frozen=True)
class SearchConfig:
    """The search options of one text."""

    beam_size: int
    num_hypotheses: int
    length_penalty: float
    max_length: int  # target tokens, EOS excluded
    bos_id: int
    eos_id: int
    keep_attention: bool = False

    @property
    def top_k(self) -> int:
        """Candidates per row the step must return (enough for the choice over the vocabulary)."""
        return 2 * self.beam_size


class TextSearch:
    """The search state of one text: live beams, finished hypotheses, backpointers.

    The caller runs the decoder on ``rows`` rows fed ``prev_tokens``, then
    passes the step's top-k for those rows to ``advance`` (or a batched
    ``choose`` over many texts to ``apply``), which returns, for each next live
    row, the current row it continues (to reorder the decoder state).
    """

    def __init__(self, config: SearchConfig) -> None:
        self.config = config
        self.scores = np.zeros(config.beam_size, dtype=np.float64)  # (beam,)
        self.prev_tokens = np.full(config.beam_size, config.bos_id, dtype=np.int64)  # (beam,)
        self.steps = 0
        self.done = False
        self.finished: list[Finished] = []
        self._tokens: list[np.ndarray] = []  # per step: (beam,) token of each live hypothesis
        self._parents: list[np.ndarray] = []  # per step: (beam,) its parent in the previous step
        self._attention: list[np.ndarray] = []  # per step: (rows, src_len) of the step's input rows

    @property
    def rows(self) -> int:
        return 0 if self.done else len(self.prev_tokens)

    def advance(self, topk_log_probs: np.ndarray, topk_ids: np.ndarray,
                attention: np.ndarray | None = None) -> np.ndarray:
        """One step of this text alone. ``topk_*``: (rows, k) sorted descending,
        k >= 2; attention (rows, src_len). See ``apply`` for the result."""
        choice = choose(self.scores[None], topk_log_probs[None], beam_size=self.config.beam_size,
                        eos_id=self.config.eos_id, token_ids=topk_ids[None],
                        first_step=np.array([self.steps == 0]))
        return self.apply(choice, 0, attention)

    def apply(self, choice: BeamChoice, text: int, attention: np.ndarray | None = None) -> np.ndarray:
        """Take entry ``text`` of a batched ``choose`` as this text's step.

        Returns (next_rows,) int64: the current row each next live row extends
        (empty once the text is done).
        """
        cfg = self.config
        if cfg.keep_attention and attention is not None:
            self._attention.append(np.array(attention, dtype=np.float32))  # (rows, src_len)
        step = self.steps
        self.steps += 1
        finished = choice.finished[text]
        if finished.any():  # rare: most steps finish nothing
            for j in np.flatnonzero(finished).tolist():
                self._finish(step, int(choice.rows[text, j]), float(choice.scores[text, j]), eos=True)
        self.scores, self.prev_tokens = choice.live_scores[text], choice.live_tokens[text]
        parents = choice.live_rows[text]
        self._tokens.append(self.prev_tokens)
        self._parents.append(parents)
        if len(self.finished) >= cfg.beam_size:
            self.done = True
        elif self.steps >= cfg.max_length:
            for i, score in enumerate(self.scores.tolist()):
                self._finish(self.steps, i, score, eos=False)
            self.done = True
        return _EMPTY if self.done else parents

    def _finish(self, step: int, index: int, score: float, *, eos: bool) -> None:
        """Record the hypothesis ending at live ``index`` of ``step`` (plus EOS when ``eos``)."""
        tokens = self._backtrack(step, index)
        length = len(tokens) + (1 if eos else 0)
        attention = None
        if self.config.keep_attention and self._attention:
            rows = self._rows_path(step, index) + ([index] if eos else [])
            attention = np.stack([self._attention[t][r] for t, r in enumerate(rows)])
        self.finished.append(Finished(
            tokens=tuple(tokens), score=score, length=length, attention=attention,
            normalized=normalized_score(score, length=length, length_penalty=self.config.length_penalty)))

    def _backtrack(self, step: int, index: int) -> list[int]:
        """Tokens of live hypothesis ``index`` after ``step`` steps (``step`` 0: none)."""
        out = []
        for t in range(step - 1, -1, -1):
            out.append(int(self._tokens[t][index]))
            index = int(self._parents[t][index])
        return out[::-1]

    def _rows_path(self, step: int, index: int) -> list[int]:
        """The input row of each step that produced hypothesis ``index`` after ``step`` steps."""
        rows = []
        for t in range(step - 1, -1, -1):
            index = int(self._parents[t][index])
            rows.append(index)
        return rows[::-1]

    def live_tokens(self) -> list[list[int]]:
        """Tokens of every live hypothesis, in row order."""
        return [self._backtrack(self.steps, i) for i in range(self.rows)]

    def agreed_prefix(self) -> list[int]:
        """The tokens all live hypotheses share (all of the best finished one once done)."""
        if self.done:
            best = self.best(1)
            return list(best[0].tokens) if best else []
        hyps = self.live_tokens()
        prefix: list[int] = []
        for column in zip(*hyps):
            if any(t != column[0] for t in column):
                break
            prefix.append(column[0])
        return prefix

    def best(self, n: int | None = None) -> list[Finished]:
        """Finished hypotheses by normalized score, best first (ties: finishing order)."""
        ranked = sorted(self.finished, key=lambda f: -f.normalized)
        return ranked[: self.config.num_hypotheses if n is None else n]
