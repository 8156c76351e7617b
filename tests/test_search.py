"""Beam search on scripted probability tables: the batched ``choose`` over several texts,
``apply``, and the serving ``Batch`` itself driven by a scripted runtime (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.decoding.batch import Batch
from service.decoding.runtime import EncoderOutput, StepOutput
from service.decoding.search import NEG_INF, apply, choose, greedy, normalized_score
from service.interface import Prepared, SpecialIds
from service.options import DecodingOptions

SPECIAL = SpecialIds()
EOS, VOCAB = SPECIAL.eos, 8
LOG = math.log


def table(*rows: dict[int, float]) -> np.ndarray:
    """Log-prob rows from {token: probability}; unlisted tokens get -inf."""
    out = np.full((len(rows), VOCAB), NEG_INF, dtype=np.float32)
    for r, probs in enumerate(rows):
        for tok, p in probs.items():
            out[r, tok] = LOG(p)
    return out


def topk(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """What the decoder graph returns: top-k sorted descending, ties lower id first."""
    ids = np.argsort(-log_probs, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(log_probs, ids, axis=-1), ids.astype(np.int64)


def candidates(choice, text: int) -> list[tuple[float, int, int]]:
    return [(round(s, 6), t, r) for s, t, r in zip(choice.scores[text].tolist(), choice.tokens[text].tolist(),
                                                     choice.rows[text].tolist())]


def test_choose_ranks_several_texts_at_once_like_each_alone() -> None:
    texts = [([0.0, 0.0], table({5: 0.5, 4: 0.5}, {4: 0.5, 6: 0.5})),  # exact ties: row, then id
             ([LOG(0.5), LOG(0.1)], table({4: 0.5, 5: 0.5}, {6: 1.0})),  # running scores decide
             ([0.0, LOG(0.2)], table({EOS: 0.6, 4: 0.4}, {EOS: 0.5, 7: 0.5}))]  # EOS among the best
    scores = np.array([s for s, _ in texts])
    full = np.stack([t for _, t in texts])
    together = choose(scores, full, beam_size=2, eos_id=EOS)
    lp, ids = topk(full, 4)
    from_topk = choose(scores, lp, beam_size=2, eos_id=EOS, token_ids=ids)
    for n, (s, t) in enumerate(texts):
        alone = choose(np.array([s]), t[None], beam_size=2, eos_id=EOS)
        assert candidates(together, n) == candidates(alone, 0) == candidates(from_topk, n)
    assert candidates(together, 0) == [(round(LOG(0.5), 6), 4, 0), (round(LOG(0.5), 6), 5, 0),
                                       (round(LOG(0.5), 6), 4, 1), (round(LOG(0.5), 6), 6, 1)]
    assert candidates(together, 1)[:3] == [(round(LOG(0.25), 6), 4, 0), (round(LOG(0.25), 6), 5, 0),
                                           (round(LOG(0.1), 6), 6, 1)]
    # text 2: "EOS" (.6) finishes; live are the first two non-EOS candidates: "4" (.4), "7" (.1)
    assert together.finished[2].tolist() == [True, False]
    assert together.live_tokens[2].tolist() == [4, 7] and together.live_rows[2].tolist() == [0, 1]


def test_first_step_looks_at_row_zero_only() -> None:
    same = np.stack([table({4: 0.5, 5: 0.3, 6: 0.2}, {4: 0.5, 5: 0.3, 6: 0.2})] * 2)  # 2 texts
    c = choose(np.zeros((2, 2)), same, beam_size=2, eos_id=EOS, first_step=np.array([True, False]))
    assert c.live_rows[0].tolist() == [0, 0] and c.live_tokens[0].tolist() == [4, 5]
    assert c.live_rows[1].tolist() == [0, 1] and c.live_tokens[1].tolist() == [4, 4]


def test_greedy_takes_the_second_candidate_when_the_first_is_eos() -> None:
    lp, ids = topk(np.stack([table({EOS: 0.6, 4: 0.4}), table({5: 0.7, EOS: 0.3})]), 2)
    c = choose(np.zeros((2, 1)), lp, beam_size=1, eos_id=EOS, token_ids=ids)
    assert c.finished[:, 0].tolist() == [True, False]
    assert c.live_tokens[:, 0].tolist() == [4, 5]


def test_apply_gives_batch_rows_and_the_eos_hypotheses() -> None:
    full = np.stack([table({4: 0.9, 5: 0.1}, {6: 1.0}), table({EOS: 0.6, 4: 0.4}, {EOS: 0.5, 7: 0.5})])
    c = choose(np.array([[0.0, LOG(0.5)], [0.0, LOG(0.2)]]), full, beam_size=2, eos_id=EOS)
    applied = apply(c, np.array([10, 20]))  # the texts' blocks start at batch rows 10 and 20
    assert applied.parents.tolist() == [10, 11, 20, 21]
    assert applied.tokens.tolist() == [4, 6, 4, 7]
    assert applied.ended == [(1, 20, pytest.approx(LOG(0.6)))]


class ScriptedRuntime:
    """A decoder whose log-probs come from a script: ``scripts[text][step]`` is a table with
    one row per live beam of that text (the first source id names the text). Its state row is
    (text, step); its attention row at step i and beam j is (i, j, 0, ...), so a path can be read."""

    shortlist = None  # the whole vocabulary (service.decoding.shortlist)

    def __init__(self, scripts: dict[int, list[np.ndarray]]) -> None:
        self.scripts = scripts

    def encode(self, src: np.ndarray, lengths: np.ndarray) -> EncoderOutput:
        batch, width = src.shape
        return EncoderOutput(annotations=np.zeros((batch, width, 1), np.float32),
                             keys=np.zeros((batch, width, 1), np.float32),
                             init_state=np.stack([src[:, 0], np.zeros(batch, np.int64)], axis=1))

    def state(self, state):
        return state

    host_state = state

    def gather_state(self, state, index):
        return state[index]

    def join_states(self, state, new):
        return new if state is None else np.concatenate([state, new])

    def context(self, *arrays):
        return arrays

    def step(self, prev, state, context, k, candidates=None) -> StepOutput:
        log_probs = np.full((len(prev), VOCAB), NEG_INF, dtype=np.float32)
        attention = np.zeros((len(prev), context[2].shape[1]), np.float32)
        for text in np.unique(state[:, 0]):
            rows = np.flatnonzero(state[:, 0] == text)
            i = int(state[rows[0], 1])
            log_probs[rows] = self.scripts[int(text)][i][: len(rows)]
            attention[rows, 0], attention[rows, 1] = i, np.arange(len(rows))
        lp, ids = topk(log_probs, k)
        return StepOutput(topk_log_probs=lp, topk_ids=ids, attention=attention,
                          next_state=state + np.array([0, 1]))


def prepared(text: int, **options) -> Prepared:
    ids = (text + 10, 5, 6, EOS)  # 4 source pieces (ids >= 10 name the text)
    return Prepared(text="", source_ids=ids, source_pieces=tuple(map(str, ids)), placeholders=(),
                    options=DecodingOptions(**options))


def decode(scripts: dict[int, list[np.ndarray]], texts: dict[int, Prepared]) -> dict:
    batch = Batch(ScriptedRuntime({t + 10: s for t, s in scripts.items()}), special=SPECIAL, vocab_size=VOCAB)
    batch.add([((0, t), p) for t, p in texts.items()])
    done, steps = {}, 0
    while batch.live_rows:
        done.update({key[1]: d for key, d in batch.step()})
        steps += 1
    return done


FINISH = [table({4: 0.6, 5: 0.4}, {4: 0.6, 5: 0.4}),  # first step: row 0 only
          table({EOS: 0.5, 6: 0.5}, {EOS: 0.9, 6: 0.1})]  # "4 EOS" (.3) and "5 EOS" (.36)
PENALTY = [table({EOS: 0.45, 4: 0.55}, {EOS: 0.45, 4: 0.55}),  # "EOS" .45 at once
           table({EOS: 0.4 / 0.55, 5: 1 - 0.4 / 0.55}, {EOS: 0.1, 5: 0.9})]  # "4 EOS" .4
LIMIT = [table({4: 0.6, 5: 0.4}, {4: 0.6, 5: 0.4}), table({6: 0.5, 7: 0.5}, {6: 1.0})]
GREEDY = [table({4: 0.6, 5: 0.4}), table({5: 0.7, EOS: 0.3}), table({EOS: 0.9, 4: 0.1})]


def test_several_texts_with_their_own_options_decode_in_one_batch() -> None:
    two = dict(beam_size=2, num_hypotheses=2)
    done = decode({0: FINISH, 1: PENALTY, 2: PENALTY, 3: LIMIT, 4: GREEDY},
                  {0: prepared(0, length_penalty=0.0, **two), 1: prepared(1, length_penalty=0.0, **two),
                   2: prepared(2, length_penalty=1.0, **two),
                   3: prepared(3, max_decoding_length=2, **two), 4: prepared(4)})
    # beam_size finished hypotheses end a text; ranked by normalized score, EOS counted in length
    assert [(f.tokens, f.length) for f in done[0].hypotheses] == [((5,), 2), ((4,), 2)]
    assert done[0].hypotheses[0].score == pytest.approx(LOG(0.4 * 0.9)) and done[0].steps == 2
    # the raw sum prefers "EOS" (.45), length penalty 1 prefers "4 EOS" (log .4 / 2)
    assert [f.tokens for f in done[1].hypotheses] == [(), (4,)]
    assert [f.tokens for f in done[2].hypotheses] == [(4,), ()]
    assert done[2].hypotheses[0].normalized == pytest.approx(LOG(0.4) / 2)
    # the length limit finishes the live hypotheses as they are, without EOS
    assert [(f.tokens, f.length) for f in done[3].hypotheses] == [((5, 6), 2), ((4, 6), 2)]
    assert done[3].hypotheses[0].score == pytest.approx(LOG(0.4))
    # greedy is beam 1
    assert done[4].hypotheses[0].tokens == (4, 5) and done[4].steps == 3
    assert done[4].hypotheses[0].score == pytest.approx(LOG(0.6 * 0.7 * 0.9))
    assert normalized_score(-2.0, length=4, length_penalty=0.5) == pytest.approx(-1.0)


def test_each_text_decodes_alone_as_in_the_batch() -> None:
    scripts = {0: FINISH, 1: PENALTY, 3: LIMIT, 4: GREEDY}
    texts = {0: prepared(0, beam_size=2, num_hypotheses=2), 1: prepared(1, beam_size=2),
             3: prepared(3, beam_size=2, max_decoding_length=2), 4: prepared(4)}
    together = decode(scripts, texts)
    for t, p in texts.items():
        alone = decode({t: scripts[t]}, {t: p})[t]
        assert [(f.tokens, f.score) for f in alone.hypotheses] == [
            (f.tokens, f.score) for f in together[t].hypotheses]


def test_backpointers_give_each_hypothesis_its_tokens_and_attention_path() -> None:
    script = [table({4: 0.6, 5: 0.4}, {4: 0.6, 5: 0.4}),
              table({6: 0.5, 7: 0.5}, {6: 0.9, 7: 0.1}),  # "5 6" .36 (row 1) beats "4 6" .3 (row 0)
              table({EOS: 1.0}, {EOS: 1.0})]
    done = decode({0: script, 1: GREEDY}, {0: prepared(0, beam_size=2, return_attention=True),
                                           1: prepared(1, return_attention=True)})
    best = done[0].hypotheses[0]
    assert best.tokens == (5, 6) and best.length == 3
    # rows read: step 0 row 0, step 1 row 1 (the "5"), step 2 row 0 (the "5 6", now first)
    assert best.attention[:, :2].tolist() == [[0, 0], [1, 1], [2, 0]]
    assert best.attention.shape == (3, 4)  # (length, src_len): EOS's row included
    assert done[1].hypotheses[0].attention[:, :2].tolist() == [[0, 0], [1, 0], [2, 0]]


def test_prefix_is_what_the_live_beams_agree_on() -> None:
    script = [table({4: 1.0}, {4: 1.0}), table({5: 0.6, 6: 0.4}, {5: 0.5, 6: 0.5}),
              table({EOS: 1.0}, {EOS: 1.0})]
    batch = Batch(ScriptedRuntime({10: script}), special=SPECIAL, vocab_size=VOCAB)
    batch.add([((0, 0), prepared(0, beam_size=2))])
    seen = []
    while batch.live_rows:
        seen.append(batch.prefix((0, 0)))
        batch.step()
    # after step 1 the live beams are "4" and a -inf filler (another token): nothing agreed;
    # after step 2 they are "4 5" and "4 6": "4"
    assert seen == [[], [], [4]]


@settings(max_examples=200, deadline=None)
@given(texts=st.integers(1, 12), k=st.integers(2, 5), eos_first=st.lists(st.booleans(), min_size=12, max_size=12),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_the_greedy_path_is_the_general_choice_bit_for_bit(texts, k, eos_first, ties, seed) -> None:
    """``greedy`` (the per-step path of beam size 1) against ``apply(choose(...))``: the same scores, tokens,
    parents and finished hypotheses, whatever the top-k holds (EOS first or not, equal log-probabilities)."""
    rng = np.random.default_rng(seed)
    eos = 2
    log_probs = -np.sort(rng.exponential(2.0, (texts, k)).astype(np.float32), axis=1)
    if ties:
        log_probs[:, 1] = log_probs[:, 0]
    ids = np.stack([rng.choice(np.array([i for i in range(40) if i != eos]), k, replace=False) for _ in range(texts)])
    ids[np.array(eos_first[:texts]), 0] = eos
    scores = rng.normal(-3.0, 2.0, texts)
    block_starts = np.cumsum(rng.integers(1, 3, texts)) - 1
    want = apply(choose(scores[:, None], log_probs[:, None, :], beam_size=1, eos_id=eos, token_ids=ids[:, None, :],
                        first_step=rng.random(texts) < 0.5), block_starts)
    got = greedy(scores, log_probs, ids, eos_id=eos, block_starts=block_starts)
    for name in ("scores", "tokens", "parents"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert got.ended == want.ended
