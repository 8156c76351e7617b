"""The per-step beam choice and the per-text search state, on scripted probability tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.decoding.search import (NEG_INF, SearchConfig, TextSearch, beam_step, normalized_score,
                            top_continuations)

EOS, BOS = 3, 2
LOG = math.log


def table(*rows: dict[int, float], vocab: int = 8) -> np.ndarray:
    """Log-prob rows from {token: probability}; unlisted tokens get -inf."""
    out = np.full((len(rows), vocab), NEG_INF, dtype=np.float32)
    for r, probs in enumerate(rows):
        for tok, p in probs.items():
            out[r, tok] = LOG(p)
    return out


def topk(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """What the decoder graph returns: top-k sorted descending, ties lower id first."""
    ids = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(log_probs, ids, axis=1), ids.astype(np.int64)


def triples(c) -> list[tuple[float, int, int]]:
    return [(round(s, 6), t, r) for s, t, r in zip(c.scores.tolist(), c.tokens.tolist(), c.rows.tolist())]


@pytest.mark.parametrize("scores, rows, count, expected", [
    # one row: tokens by probability
    ([0.0], [{4: 0.5, 5: 0.3, 6: 0.2}], 2, [(LOG(0.5), 4, 0), (LOG(0.3), 5, 0)]),
    # the running score decides across rows
    ([LOG(0.5), LOG(0.1)], [{4: 0.5, 5: 0.5}, {6: 1.0}],
     3, [(LOG(0.25), 4, 0), (LOG(0.25), 5, 0), (LOG(0.1), 6, 1)]),
    # exact ties: lower row first, then lower token id
    ([0.0, 0.0], [{5: 0.5, 4: 0.5}, {4: 0.5, 6: 0.5}],
     4, [(LOG(0.5), 4, 0), (LOG(0.5), 5, 0), (LOG(0.5), 4, 1), (LOG(0.5), 6, 1)]),
])
def test_top_continuations_table(scores, rows, count, expected) -> None:
    got = top_continuations(np.array(scores), table(*rows), count=count)
    assert triples(got) == [(round(s, 6), t, r) for s, t, r in expected]


def test_top_k_input_gives_the_same_choice_as_the_whole_vocabulary() -> None:
    rng = np.random.default_rng(0)
    log_probs = np.log(rng.dirichlet(np.ones(50), size=4)).astype(np.float32)
    scores = np.array([-0.5, -1.0, -1.2, -3.0])
    full = top_continuations(scores, log_probs, count=8)
    lp, ids = topk(log_probs, 8)
    assert triples(top_continuations(scores, lp, count=8, token_ids=ids)) == triples(full)


def test_ties_at_the_cut_keep_the_lowest_row_and_token() -> None:
    uniform = np.full((2, 100), LOG(0.01), dtype=np.float32)  # 200 equal candidates
    got = top_continuations(np.zeros(2), uniform, count=3)
    assert list(zip(got.rows.tolist(), got.tokens.tolist())) == [(0, 0), (0, 1), (0, 2)]


def test_first_step_uses_row_zero_only() -> None:
    same = table(*[{4: 0.5, 5: 0.3, 6: 0.2}] * 3)
    step = beam_step(np.zeros(3), same, beam_size=3, eos_id=EOS, first_step=True)
    assert step.live.rows.tolist() == [0, 0, 0]
    assert step.live.tokens.tolist() == [4, 5, 6]
    # without the rule every row would contribute the same candidates
    assert beam_step(np.zeros(3), same, beam_size=3, eos_id=EOS).live.rows.tolist() == [0, 1, 2]


@pytest.mark.parametrize("rows, beam, live, finished", [
    # EOS ranked first: finished; the next beam_size non-EOS candidates stay live
    ([{EOS: 0.5, 4: 0.3, 5: 0.2}], 2, [(LOG(0.3), 4, 0), (LOG(0.2), 5, 0)], [(LOG(0.5), EOS, 0)]),
    # EOS ranked beyond beam_size: ignored
    ([{4: 0.5, 5: 0.3, EOS: 0.2}], 2, [(LOG(0.5), 4, 0), (LOG(0.3), 5, 0)], []),
    # greedy: EOS best -> finished, nothing live
    ([{EOS: 0.6, 4: 0.4}], 1, [(LOG(0.4), 4, 0)], [(LOG(0.6), EOS, 0)]),
])
def test_beam_step_eos_table(rows, beam, live, finished) -> None:
    step = beam_step(np.zeros(1), table(*rows), beam_size=beam, eos_id=EOS)
    rnd = [(round(s, 6), t, r) for s, t, r in live]
    assert triples(step.live) == rnd
    assert triples(step.finished) == [(round(s, 6), t, r) for s, t, r in finished]


def test_eos_from_several_rows_still_leaves_beam_size_live() -> None:
    rows = table({EOS: 0.9, 4: 0.1}, {EOS: 0.8, 5: 0.2})
    step = beam_step(np.array([0.0, -0.1]), rows, beam_size=2, eos_id=EOS)
    assert step.finished.rows.tolist() == [0, 1]
    assert step.live.tokens.tolist() == [5, 4]  # -0.1 + log .2 > log .1


def config(**kw) -> SearchConfig:
    base = dict(beam_size=2, num_hypotheses=2, length_penalty=0.0, max_length=10, bos_id=BOS, eos_id=EOS)
    return SearchConfig(**{**base, **kw})


def run(search: TextSearch, script: list[np.ndarray], attention: list[np.ndarray] | None = None) -> list:
    """Feed scripted log-prob tables (one per step, rows = live rows) until done."""
    parents = []
    for i, log_probs in enumerate(script):
        assert not search.done, f"done before step {i}"
        assert log_probs.shape[0] == search.rows
        lp, ids = topk(log_probs, search.config.top_k)
        parents.append(search.advance(lp, ids, None if attention is None else attention[i]).tolist())
    assert search.done
    return parents


def test_text_search_finishes_with_beam_size_hypotheses() -> None:
    s = TextSearch(config())
    run(s, [table({4: 0.6, 5: 0.4}, {4: 0.6, 5: 0.4}),  # first step: row 0 only
            table({EOS: 0.5, 6: 0.5}, {EOS: 0.9, 6: 0.1}),  # "4 EOS" (.3) and "5 EOS" (.36)
            ])
    assert s.steps == 2
    assert [(f.tokens, f.length) for f in s.best()] == [((5,), 2), ((4,), 2)]
    assert s.best()[0].score == pytest.approx(LOG(0.4 * 0.9))


def test_length_penalty_ranks_finished_hypotheses() -> None:
    script = [table({EOS: 0.3, 4: 0.7}, {EOS: 0.3, 4: 0.7}),  # "EOS" (.3) finishes at once
              table({4: 0.9, 5: 0.1}, {4: 0.9, 5: 0.1}),
              table({EOS: 0.8, 6: 0.2}, {EOS: 0.7, 6: 0.3})]  # "4 4 EOS" .504
    ranked = {}
    for penalty in (0.0, 1.0):
        s = TextSearch(config(length_penalty=penalty))
        run(s, script)
        ranked[penalty] = [(f.tokens, round(f.normalized, 6)) for f in s.best()]
    # "4 4 EOS": log .504 = -0.685 beats "EOS": log .3 = -1.204 with or without the penalty
    assert ranked[0.0][0] == ((4, 4), round(LOG(0.7 * 0.9 * 0.8), 6))
    assert ranked[1.0][0] == ((4, 4), round(LOG(0.7 * 0.9 * 0.8) / 3, 6))
    assert ranked[1.0][1] == ((), round(LOG(0.3) / 1, 6))


def test_length_penalty_can_prefer_the_longer_hypothesis() -> None:
    # "EOS" at .45 vs "4 EOS" at .4: raw sum prefers the short one, penalty 1 the long one
    script = [table({EOS: 0.45, 4: 0.55}, {EOS: 0.45, 4: 0.55}),
              table({EOS: 0.4 / 0.55, 5: 1 - 0.4 / 0.55}, {EOS: 0.1, 5: 0.9})]
    firsts = []
    for penalty in (0.0, 1.0):
        s = TextSearch(config(length_penalty=penalty))
        run(s, script)
        firsts.append(s.best()[0].tokens)
    assert firsts == [(), (4,)]
    assert normalized_score(-2.0, length=4, length_penalty=0.5) == pytest.approx(-1.0)


def test_max_length_finishes_live_hypotheses_without_eos() -> None:
    s = TextSearch(config(max_length=2, num_hypotheses=2))
    run(s, [table({4: 0.6, 5: 0.4}, {4: 0.6, 5: 0.4}), table({6: 0.5, 7: 0.5}, {6: 1.0})])
    best = s.best()
    assert [(f.tokens, f.length) for f in best] == [((5, 6), 2), ((4, 6), 2)]
    assert best[0].score == pytest.approx(LOG(0.4))


def test_greedy_is_beam_one_and_returns_parent_rows() -> None:
    s = TextSearch(config(beam_size=1, num_hypotheses=1))
    parents = run(s, [table({4: 0.6, 5: 0.4}), table({5: 0.7, EOS: 0.3}), table({EOS: 0.9, 4: 0.1})])
    assert parents == [[0], [0], []]
    assert s.best()[0].tokens == (4, 5)
    assert s.best()[0].score == pytest.approx(LOG(0.6 * 0.7 * 0.9))
    general = beam_step(np.zeros(1), table({5: 0.5, 4: 0.5}), beam_size=1, eos_id=EOS)
    g = TextSearch(config(beam_size=1, num_hypotheses=1))
    lp, ids = topk(table({5: 0.5, 4: 0.5}), 1)
    g.advance(lp, ids)
    assert general.live.tokens.tolist() == g.prev_tokens.tolist() == [4]  # tie: lower id


def test_reordering_and_prefix_and_attention_follow_the_backpointers() -> None:
    s = TextSearch(config(keep_attention=True))
    att = [np.eye(2, 3, dtype=np.float32) + i for i in range(3)]  # row r of step i: distinct
    lp, ids = topk(table({4: 0.6, 5: 0.4}, {4: 0.6, 5: 0.4}), 4)
    assert s.advance(lp, ids, att[0]).tolist() == [0, 0]
    lp, ids = topk(table({6: 0.5, 7: 0.5}, {6: 0.9, 7: 0.1}), 4)
    # row 1 ("5", .4) -> "5 6" .36; row 0 ("4", .6) -> "4 6" .3, "4 7" .3
    assert s.advance(lp, ids, att[1]).tolist() == [1, 0]
    assert s.live_tokens() == [[5, 6], [4, 6]]
    assert s.agreed_prefix() == []
    lp, ids = topk(table({EOS: 1.0}, {EOS: 1.0}), 4)
    assert s.advance(lp, ids, att[2]).size == 0
    best = s.best()[0]
    assert best.tokens == (5, 6)
    # rows used: step 0 row 0, step 1 row 1 ("5"), step 2 row 0 ("5 6")
    expected = np.stack([att[0][0], att[1][1], att[2][0]])
    np.testing.assert_array_equal(best.attention, expected)
    assert s.agreed_prefix() == [5, 6]


def test_agreed_prefix_of_live_beams() -> None:
    s = TextSearch(config())
    lp, ids = topk(table({4: 1.0}, {4: 1.0}), 4)
    s.advance(lp, ids)  # live: "4" and a -inf filler
    lp, ids = topk(table({5: 0.6, 6: 0.4}, {5: 0.5, 6: 0.5}), 4)
    s.advance(lp, ids)
    assert s.live_tokens() == [[4, 5], [4, 6]]
    assert s.agreed_prefix() == [4]
