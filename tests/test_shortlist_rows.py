"""The shortlist per row (service/decoding/shortlist_rows.py, shortlist_layer.c): each row's output layer
over its own text's candidates, checked against float64 references, across its product forms, against
the masked graph, and for batch invariance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.decoding import fused_middle, shortlist, shortlist_rows
from service.decoding.engine import Engine
from service.decoding.shortlist import ShortlistChoice
from service.options import DecodingOptions

_attention = pytest.importorskip("service.decoding._attention", reason="installed without a C compiler")
BEST = {"plain": 0, "avx2": 1, "avx512-vnni": 2}[_attention.gru_form()]
TEXTS = ["1 2 3 4 5", "9 8 7 6 5 4 3 2 1", "4 4 4", "0 1 0 1 7 7", "3 3 9"]


def _layer(rng: np.random.Generator, O: int, V: int) -> dict[str, np.ndarray]:
    w = rng.integers(-128, 128, (V, O)).astype(np.int8)
    return {"w": w, "wsum": (128 * w.astype(np.int32).sum(axis=1)).astype(np.int32),
            "wscale": rng.uniform(1e-3, 3e-3, V).astype(np.float32), "bias": rng.normal(0, 1, V).astype(np.float32)}


def _acc(a: np.ndarray, layer: dict, ids: np.ndarray) -> np.ndarray:
    """(rows, len(ids)) the exact integer products of the rows of ``a`` with those words."""
    return (a.astype(np.int64) - 128) @ layer["w"][ids].astype(np.int64).T


def _run(a, scale, layer, always, texts, beams, k, form=-1, threads=1, module=_attention, feed=None):
    """The kernel on rows of texts (their words) of ``beams`` rows each (or ``feed``, the rows' words as
    given); the always-words' product made as the graph makes it (exact sums times the float32 scale)."""
    feed = feed or shortlist_rows.candidates([np.setdiff1d(ids, always) for ids in texts], beams).feed
    known = np.minimum(always, len(layer["w"]) - 1)
    raw = (_acc(a, layer, known).astype(np.float32) * layer["wscale"][known]).astype(np.float32)
    values, ids = np.empty((len(a), k), np.float32), np.empty((len(a), k), np.int64)
    module.shortlist_layer(a.view(np.int32), scale, np.ascontiguousarray(raw), always.astype(np.int32),
                           layer["w"].view(np.int32), layer["wsum"], layer["wscale"], layer["bias"], feed["row_starts"],
                           feed["row_counts"], feed["candidate_ids"], values, ids, threads, form)
    return values, ids


def _reference(a, scale, layer, texts, beams, k):
    """float64 log-softmax over each row's words (the logits as the graph computes them in float32)."""
    rows = [ids for ids, b in zip(texts, beams) for _ in range(b)]
    values, out = [], []
    for r, ids in enumerate(rows):
        logits = (_acc(a[r:r + 1], layer, ids)[0].astype(np.float32) * layer["wscale"][ids]) * scale[r, 0] + layer["bias"][ids]
        x = logits.astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        order = np.argsort(-logits, kind="stable")[:k]  # ties: the lower id
        values.append(lp[order])
        out.append(ids[order])
    return np.array(values), np.array(out)


def _words(rng: np.random.Generator, V: int, texts: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Always-words (maybe none) and each text's words (them and some others, at least k in all)."""
    always = np.sort(rng.choice(V, rng.integers(0, V // 2 + 1), replace=False))
    return always, [np.union1d(always, rng.choice(V, rng.integers(k, V + 1), replace=False)) for _ in range(texts)]


@settings(max_examples=30, deadline=None)
@given(O4=st.integers(1, 40), V=st.integers(12, 400), texts=st.integers(1, 5), beam=st.integers(1, 3),
       k=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_every_form_gives_the_references_answer_bit_for_bit_alike(O4, V, texts, beam, k, seed) -> None:
    """Exact integer sums whatever instructions compute them: every form on this CPU the same bits, and
    the float64 reference's top-k (ids exactly, values to rounding)."""
    rng = np.random.default_rng(seed)
    O = 4 * O4
    layer = _layer(rng, O, V)
    always, lists = _words(rng, V, texts, k)
    beams = [beam] * texts
    a = rng.integers(0, 256, (texts * beam, O)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.05, (texts * beam, 1)).astype(np.float32)
    got = [_run(a, scale, layer, always, lists, beams, k, form=form) for form in range(BEST + 1)]
    for values, ids in got[1:]:
        np.testing.assert_array_equal(values, got[0][0])
        np.testing.assert_array_equal(ids, got[0][1])
    want_values, want_ids = _reference(a, scale, layer, lists, beams, k)
    np.testing.assert_array_equal(got[0][1], want_ids)
    np.testing.assert_allclose(got[0][0], want_values, atol=2e-5)


def test_a_row_gives_the_same_bits_alone_and_on_threads() -> None:
    rng = np.random.default_rng(3)
    layer = _layer(rng, 256, 3000)
    always = np.arange(0, 3000, 3)
    lists = [np.union1d(always, rng.choice(3000, n, replace=False)) for n in (40, 1200, 700, 900)] * 5
    a = rng.integers(0, 256, (len(lists), 256)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.05, (len(lists), 1)).astype(np.float32)
    whole = _run(a, scale, layer, always, lists, [1] * len(lists), 8)
    threaded = _run(a, scale, layer, always, lists, [1] * len(lists), 8, threads=2)
    for mine, theirs in zip(whole, threaded):
        np.testing.assert_array_equal(mine, theirs)
    for r in (0, 7, len(lists) - 1):
        alone = _run(a[r:r + 1], scale[r:r + 1], layer, always, lists[r:r + 1], [1], 8)
        np.testing.assert_array_equal(alone[0][0], whole[0][r])
        np.testing.assert_array_equal(alone[1][0], whole[1][r])


def test_ties_go_to_the_lower_id_whichever_list_holds_it() -> None:
    """Words of equal logits: the lower id first, an always-word or the row's own."""
    rng = np.random.default_rng(5)
    layer = _layer(rng, 8, 12)
    layer["w"][:], layer["wsum"][:], layer["bias"][:] = 0, 0, 0.5
    a, scale = np.full((1, 8), 128, np.uint8), np.ones((1, 1), np.float32)
    values, ids = _run(a, scale, layer, np.array([4, 9]), [np.array([1, 4, 7, 9])], [1], 3)
    assert ids.tolist() == [[1, 4, 7]]
    np.testing.assert_allclose(values, np.log(0.25), rtol=1e-6)


@pytest.mark.parametrize("always, words, k, form, match", [
    ([], [1, 2, 3], 4, -1, "at least k = 4"),
    ([1], [2], 3, -1, "at least k = 3"),
    ([], [1, 3, 2], 2, -1, "ascending ids below V = 12 \\(got 2\\)"),
    ([], [1, 12], 2, -1, "ascending ids below V = 12 \\(got 12\\)"),
    ([12], [1, 2], 1, -1, "always holds 12, not a word id below V = 12"),
    ([], [1, 2], 1, BEST + 1, f"form {BEST + 1} is not available on this CPU"),
])
def test_bad_words_are_refused_naming_the_limit_and_the_value(always, words, k, form, match) -> None:
    layer = _layer(np.random.default_rng(0), 8, 12)
    a, scale = np.full((1, 8), 128, np.uint8), np.ones((1, 1), np.float32)
    feed = {"candidate_ids": np.array(words, np.int32), "row_starts": np.zeros(1, np.int64),
            "row_counts": np.array([len(words)], np.int64)}
    with pytest.raises(ValueError, match=match):
        _run(a, scale, layer, np.array(always, np.int64), None, [1], k, form=form, feed=feed)


def test_the_served_shortlist_scores_each_row_over_its_own_candidates(shortlisted: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-row step is the union's answer (its graphs: the batch's words, each row masked to its own) to
    rounding, on a real batch of the served engine: the same tokens, log-probabilities within 1e-5 (both
    with the graph's middle: the compiled one is tests/test_fused_middle.py's)."""
    monkeypatch.setattr(fused_middle, "offered", lambda: "compared with the graph's middle")
    engine = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
    runtime = engine.runtime
    assert runtime.shortlist_rows and runtime.attention_form == "fused"
    assert set(runtime._step_sessions) == {"rows"}  # the union's sessions are not built beside it
    monkeypatch.setattr(shortlist_rows, "load", lambda *a, **k: None)  # an engine serving the union
    union_runtime = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON).runtime
    assert not union_runtime.shortlist_rows
    batch = engine.new_batch()
    batch.add([((0, i), engine.prepare_text(t, DecodingOptions(beam_size=2), i)) for i, t in enumerate(TEXTS)])
    batch.step()
    rows = batch._candidates
    assert rows.per_row and len(rows.feed["row_counts"]) == len(batch._state)
    texts = [np.union1d(runtime.shortlist.always, t.candidates) for t in batch._texts]
    union = shortlist.candidates(runtime.output_layer, texts, batch._beams, pad_id=engine.special.pad)
    for fast, served in ((rows, runtime), (union, union_runtime)):
        out = served.step(batch._prev, batch._state, batch._context.device, 4, fast)
        if fast is rows:
            got = out
        else:
            np.testing.assert_array_equal(got.topk_ids, out.topk_ids)
            np.testing.assert_allclose(got.topk_log_probs, out.topk_log_probs, atol=1e-5)
            np.testing.assert_array_equal(got.next_state, out.next_state)
    allowed = [ids for ids, b in zip(texts, batch._beams) for _ in range(b)]
    assert all(set(row) <= set(ids.tolist()) for row, ids in zip(got.topk_ids, allowed))


def test_a_text_has_the_same_scores_alone_and_in_any_batch(shortlisted: Path) -> None:
    """Batch invariance, bit for bit: the union's width moved a row's normalizer; a row's own list does not."""
    engine = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
    for beam in (1, 3):
        options = DecodingOptions(beam_size=beam, return_scores=True)
        together = [(t.hypotheses[0].tokens, t.hypotheses[0].score) for t in engine.translate(TEXTS, options)]
        alone = [(r.hypotheses[0].tokens, r.hypotheses[0].score) for text in TEXTS
                 for r in engine.translate([text], options)]
        assert together == alone


def test_without_the_kernel_the_union_serves(shortlisted: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    from service.decoding import fused

    monkeypatch.setattr(fused, "_attention", None)
    engine = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
    assert engine.shortlist and not engine.runtime.shortlist_rows
    assert engine.translate(TEXTS[:2])[0].hypotheses[0].tokens
