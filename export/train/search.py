"""PyTorch reference decoding: batched greedy and beam search.

This is the reference the ONNX engine is checked against, so it uses the same
algorithm: per sentence, ``beam_size`` rows; each step every live row scores
the vocabulary, the ``2 * beam_size`` best (score, token) pairs over its rows
are taken: EOS among the first ``beam_size`` finish, the first ``beam_size``
others are the next beams; a sentence is done when it
has ``beam_size`` finished hypotheses or hits its length limit. Scores are
sums of log-probabilities; ranking uses ``score / length ** length_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from export.train.model import RNNSearch
from service.options import DecodingOptions, max_target_length

DEFAULTS = DecodingOptions()  # the service's defaults: the same length limits on both sides


@dataclass(frozen=True)
class Hypothesis:
    """One decoded target sentence."""

    tokens: list[int]  # target ids, EOS excluded
    score: float  # sum of log-probabilities, EOS included
    attention: list[list[float]]  # per target token (EOS included), a row over source positions


def _lengths(src_lengths: torch.Tensor, max_len: int, max_ratio: float) -> list[int]:
    """Per sentence, the service's length rule (``service.options.max_target_length``)."""
    return [max_target_length(n, max_decoding_length=max_len, max_length_ratio=max_ratio)
            for n in src_lengths.tolist()]


@torch.inference_mode()
def greedy(model: RNNSearch, src: torch.Tensor, src_lengths: torch.Tensor, *,
           max_len: int = DEFAULTS.max_decoding_length,
           max_ratio: float = DEFAULTS.max_length_ratio) -> list[Hypothesis]:
    """Greedy decoding of a padded batch; the step graph runs on live rows only."""
    cfg = model.config
    annotations, keys, state = model.encoder(src, src_lengths)
    src_mask = src != cfg.pad_id
    batch = src.shape[0]
    limits = _lengths(src_lengths, max_len, max_ratio)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    scores = [0.0] * batch
    attn: list[list[list[float]]] = [[] for _ in range(batch)]
    live = torch.arange(batch)
    prev = torch.full((batch,), cfg.bos_id, dtype=torch.long)
    while len(live):
        log_probs, state, alpha = model.step_log_probs(
            prev, state, annotations[live], keys[live], src_mask[live])
        best_lp, best = log_probs.max(dim=1)
        keep = []
        for r, b in enumerate(live.tolist()):
            tok = int(best[r])
            scores[b] += float(best_lp[r])
            attn[b].append(alpha[r, : int(src_lengths[b])].tolist())
            if tok == cfg.eos_id:
                continue
            tokens[b].append(tok)
            if len(tokens[b]) < limits[b]:
                keep.append(r)
        keep_t = torch.tensor(keep, dtype=torch.long)
        live, prev, state = live[keep_t], best[keep_t], state[keep_t]
    return [Hypothesis(tokens[b], scores[b], attn[b]) for b in range(batch)]


@dataclass
class _Rows:
    """The live rows of a batched beam search: ``beam_size`` contiguous rows per live sentence."""

    sentences: torch.Tensor  # (live,) index of each live sentence in the batch
    scores: torch.Tensor  # (live, beam) float64 running scores
    history: torch.Tensor  # (live * beam, steps) tokens so far
    prev: torch.Tensor  # (live * beam,) last token
    state: torch.Tensor  # (live * beam, dec_hidden_size)
    annotations: torch.Tensor  # (live * beam, src_len, ctx_size)
    keys: torch.Tensor  # (live * beam, src_len, attn_size)
    src_mask: torch.Tensor  # (live * beam, src_len)


def _choose(rows: _Rows, log_probs: torch.Tensor, beam: int, first: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2 * beam best candidates per sentence: (scores, tokens, rows within the sentence),
    each (live, 2 * beam), best first; ties keep the lower row, then the top-k order."""
    live = len(rows.sentences)
    k = min(2 * beam, log_probs.shape[1])
    top_lp, top_ids = log_probs.topk(k, dim=1)  # (live * beam, k), as the decoder graph does
    total = rows.scores.unsqueeze(2) + top_lp.double().view(live, beam, k)  # (live, beam, k)
    if first:  # all rows are identical at the first step: row 0 only
        total[:, 1:] = float("-inf")
    best, order = total.view(live, beam * k).sort(dim=1, descending=True, stable=True)
    best, order = best[:, : 2 * beam], order[:, : 2 * beam]
    tokens = top_ids.view(live, beam * k).gather(1, order)
    return best, tokens, torch.div(order, k, rounding_mode="floor")


def _finish(out: list[list[tuple[float, int, list[int]]]], sentence: int, history: torch.Tensor,
            score: float, eos: bool) -> None:
    """Record a finished hypothesis as (score, length, tokens)."""
    tokens = history.tolist()
    out[sentence].append((score, len(tokens) + (1 if eos else 0), tokens))


@torch.inference_mode()
def beam_search(model: RNNSearch, src: torch.Tensor, src_lengths: torch.Tensor, *, beam_size: int,
                num_hypotheses: int = 1, length_penalty: float = 1.0,
                max_len: int = DEFAULTS.max_decoding_length,
                max_ratio: float = DEFAULTS.max_length_ratio) -> list[list[Hypothesis]]:
    """Batched beam search (the algorithm of ``service.decoding.search``); greedy is ``beam_size`` 1.

    Each sentence has ``beam_size`` rows; the 2 * beam_size best candidates are
    taken over its rows' top-k; EOS candidates among the first beam_size finish,
    the first beam_size others stay live. A sentence is done with beam_size
    finished hypotheses or when its live ones reach the length limit (finished
    without EOS). Ranking: ``score / length ** length_penalty``, length counting
    EOS. Returns per sentence the ``num_hypotheses`` best (no attention).
    """
    cfg, beam = model.config, beam_size
    annotations, keys, state = model.encoder(src, src_lengths)
    batch = src.shape[0]
    limits = _lengths(src_lengths, max_len, max_ratio)
    expand = torch.arange(batch).repeat_interleave(beam)  # (batch * beam,)
    rows = _Rows(sentences=torch.arange(batch), scores=torch.zeros(batch, beam, dtype=torch.float64),
                 history=torch.zeros(batch * beam, 0, dtype=torch.long),
                 prev=torch.full((batch * beam,), cfg.bos_id, dtype=torch.long), state=state[expand],
                 annotations=annotations[expand], keys=keys[expand], src_mask=(src != cfg.pad_id)[expand])
    finished: list[list[tuple[float, int, list[int]]]] = [[] for _ in range(batch)]
    step = 0
    while len(rows.sentences):
        log_probs, next_state, _ = model.step_log_probs(rows.prev, rows.state, rows.annotations,
                                                        rows.keys, rows.src_mask)
        cand_scores, cand_tokens, cand_rows = _choose(rows, log_probs, beam, step == 0)
        live = len(rows.sentences)
        parents = cand_rows + (torch.arange(live) * beam).unsqueeze(1)  # (live, 2 * beam) global rows
        is_eos = cand_tokens == cfg.eos_id
        for s, j in (is_eos[:, :beam]).nonzero().tolist():
            _finish(finished, int(rows.sentences[s]), rows.history[parents[s, j]], float(cand_scores[s, j]), True)
        # the first beam_size candidates that are not EOS, in rank order (a stable sort on is_eos)
        pick = is_eos.to(torch.int8).sort(dim=1, stable=True).indices[:, :beam]  # (live, beam)
        parents = parents.gather(1, pick).view(-1)
        tokens = cand_tokens.gather(1, pick).view(-1)
        rows.scores = cand_scores.gather(1, pick)
        rows.history = torch.cat([rows.history[parents], tokens.unsqueeze(1)], dim=1)
        rows.prev, rows.state = tokens, next_state[parents]
        step += 1
        keep = []
        for s, sentence in enumerate(rows.sentences.tolist()):
            if len(finished[sentence]) >= beam:
                continue
            if step >= limits[sentence]:
                for j in range(beam):
                    _finish(finished, sentence, rows.history[s * beam + j], float(rows.scores[s, j]), False)
                continue
            keep.append(s)
        if len(keep) < live:
            _keep_sentences(rows, torch.tensor(keep, dtype=torch.long), beam)
    return [_best(f, num_hypotheses, length_penalty) for f in finished]


def _keep_sentences(rows: _Rows, keep: torch.Tensor, beam: int) -> None:
    """Drop the rows of finished sentences (the step then runs on live rows only)."""
    row_index = (keep.unsqueeze(1) * beam + torch.arange(beam)).view(-1)  # (kept * beam,)
    rows.sentences, rows.scores = rows.sentences[keep], rows.scores[keep]
    for name in ("history", "prev", "state", "annotations", "keys", "src_mask"):
        setattr(rows, name, getattr(rows, name)[row_index])


def _best(finished: list[tuple[float, int, list[int]]], n: int, length_penalty: float) -> list[Hypothesis]:
    """The n best by score / length ** length_penalty (ties: finishing order)."""
    ranked = sorted(finished, key=lambda f: -(f[0] / max(f[1], 1) ** length_penalty))
    return [Hypothesis(tokens=tokens, score=score, attention=[]) for score, _, tokens in ranked[:n]]
