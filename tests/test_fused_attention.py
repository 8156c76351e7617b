"""Fused attention (``service.decoding.fused``, ``service/decoding/attention.c``): the int8 step's
additive attention by the compiled kernel, checked against a float64 reference, against the
graph's own operators, and for batch invariance."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.decoding import fused
from service.decoding.engine import Engine
from service.options import DecodingOptions

# the kernel is built by `pip install -e .` (setup.py); a checkout installed without a C compiler
# has none, and the service then runs on ONNX Runtime's operators (tested below with it hidden)
_attention = pytest.importorskip("service.decoding._attention", reason="installed without a C compiler")


def _reference(query, keys, annotations, lengths, v):
    """The attention in float64 with numpy's tanh: (alpha, context)."""
    rows, src_len, _ = keys.shape
    alpha = np.zeros((rows, src_len))
    for r, n in enumerate(lengths):
        energy = np.tanh(query[r].astype(np.float64) + keys[r, :n]) @ v
        e = np.exp(energy - energy.max())
        alpha[r, :n] = e / e.sum()
    return alpha, np.einsum("rs,rsc->rc", alpha, annotations.astype(np.float64))


def _inputs(rng, rows, src_len, A, C, product_extra=0):
    lengths = rng.integers(1, src_len + 1, rows).astype(np.int64)
    product = rng.normal(0, 2, (rows, A + product_extra)).astype(np.float32)
    keys = rng.normal(0, 2, (rows, src_len, A)).astype(np.float32)
    annotations = rng.uniform(-1, 1, (rows, src_len, C)).astype(np.float32)
    v = rng.normal(0, 0.3, A).astype(np.float32)
    return product, keys, annotations, lengths, v


def _attend(product, keys, annotations, lengths, v):
    alpha = np.full(keys.shape[:2], np.nan, np.float32)
    context = np.full((keys.shape[0], annotations.shape[2]), np.nan, np.float32)
    _attention.attend(product, keys, annotations, lengths, v, alpha, context)
    return alpha, context


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), src_len=st.integers(1, 13), blocks=st.integers(1, 4), C=st.integers(1, 40),
       extra=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_kernel_matches_a_float64_reference_and_zeroes_the_padding(rows, src_len, blocks, C, extra, seed) -> None:
    product, keys, annotations, lengths, v = _inputs(np.random.default_rng(seed), rows, src_len, 16 * blocks, C, extra)
    alpha, context = _attend(product, keys, annotations, lengths, v)
    want_alpha, want_context = _reference(product[:, :16 * blocks], keys, annotations, lengths, v)
    np.testing.assert_allclose(alpha, want_alpha, atol=2e-6)
    np.testing.assert_allclose(context, want_context, atol=1e-5)
    padding = np.arange(src_len)[None, :] >= lengths[:, None]
    assert np.all(alpha[padding] == 0.0)


def test_tanh_holds_across_its_range() -> None:
    """One row, one column, v = e_i: the energy is tanh(q_i + k_i); softmax of one column is 1, so
    read tanh through two columns: alpha = sigmoid(2 (t0 - t1)) pins t0 - t1."""
    x = np.linspace(-20, 20, 4001, dtype=np.float32)
    A = 16
    product = np.zeros((len(x), A), np.float32)
    keys = np.zeros((len(x), 2, A), np.float32)
    keys[:, 0, 0] = x  # column 0 scores tanh(x), column 1 scores tanh(0) = 0
    v = np.zeros(A, np.float32)
    v[0] = 1.0
    alpha, _ = _attend(product, keys, np.zeros((len(x), 2, 1), np.float32), np.full(len(x), 2, np.int64), v)
    t = np.log(alpha[:, 0].astype(np.float64) / alpha[:, 1])  # = tanh(x) - 0
    np.testing.assert_allclose(t, np.tanh(x.astype(np.float64)), atol=1e-6)


def test_a_row_gives_the_same_bits_alone_and_in_any_batch_or_padding() -> None:
    rng = np.random.default_rng(3)
    product, keys, annotations, lengths, v = _inputs(rng, 12, 20, 64, 48, 32)
    alpha, context = _attend(product, keys, annotations, lengths, v)
    for r in (0, 5, 11):
        n = int(lengths[r])
        for width in sorted({n, 20, 33}):  # the row alone, padded to its length, the batch's and a wider one
            k = np.zeros((1, width, 64), np.float32)
            a = np.zeros((1, width, 48), np.float32)
            k[0, :n], a[0, :n] = keys[r, :n], annotations[r, :n]
            one_alpha, one_context = _attend(product[r:r + 1].copy(), k, a, lengths[r:r + 1], v)
            assert np.array_equal(one_alpha[0, :n], alpha[r, :n]) and np.array_equal(one_context[0], context[r])


@pytest.mark.parametrize("bad, message", [
    (lambda x: {**x, "keys": x["keys"].astype(np.float64)}, "keys: a C-contiguous float32"),
    (lambda x: {**x, "annotations": x["annotations"][:, :, ::2]}, "annotations: a C-contiguous"),
    (lambda x: {**x, "lengths": x["lengths"].astype(np.int32)}, "lengths: a C-contiguous int64"),
    (lambda x: {**x, "v": x["v"][:8].copy()}, "shapes do not agree"),
    (lambda x: {**x, "alpha": np.zeros((2, 3), np.float32)}, "shapes do not agree"),
])
def test_kernel_refuses_arrays_it_cannot_read(bad, message) -> None:
    product, keys, annotations, lengths, v = _inputs(np.random.default_rng(0), 3, 5, 16, 8)
    args = bad({"product": product, "keys": keys, "annotations": annotations, "lengths": lengths, "v": v,
                "alpha": np.zeros((3, 5), np.float32), "context": np.zeros((3, 8), np.float32)})
    with pytest.raises(ValueError, match=message):
        _attention.attend(*args.values())


def test_split_step_cuts_the_graph_at_the_attention(tiny_repository: Path) -> None:
    engine = Engine(tiny_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    step = onnx.load(str(engine.manifest.path(engine.manifest.graphs["int8"].decoder_step)))
    query, rest, v = fused.split_step(step)
    assert [i.name for i in query.graph.input] == ["state"] and len(query.graph.output) == 1
    rest_inputs = {i.name for i in rest.graph.input}
    assert {"keys", "annotations", "src_mask"}.isdisjoint(rest_inputs)
    assert {fused.PRODUCT, fused.CONTEXT, "state", "prev_tokens", "k"} <= rest_inputs
    assert "attention" not in {o.name for o in rest.graph.output}
    assert not any(n.op_type in ("Tanh", "Softmax") and "keys" in str(n.input) for n in rest.graph.node)
    assert v.shape == (32,)  # the tiny model's attn_size
    broken = onnx.ModelProto()
    broken.CopyFrom(step)
    next(n for n in broken.graph.node if n.op_type == "Softmax").op_type = "LogSoftmax"
    with pytest.raises(ValueError, match="attention chain"):
        fused.split_step(broken)


def test_fused_step_agrees_with_the_graph_and_the_engine_serves_it(reversal_repository: Path) -> None:
    graph = Engine(reversal_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1)
    assert engine.runtime.attention_form == "fused" and graph.runtime.attention_form == "packed"
    feed = engine.runtime._step_feed()
    names = ["log_probs", "topk_log_probs", "next_state", "attention"]
    want = graph.runtime._padded.run(names, feed)
    got = engine.runtime.step_session(False).run(names, feed)
    for name, a, b in zip(names, want, got):
        assert np.abs(a - b).max() <= fused.TOLERANCE[name], name
    assert_serves_as_the_graph(engine, graph)


def assert_serves_as_the_graph(engine: Engine, graph: Engine) -> None:
    """``engine`` translates as ``graph`` does (greedy, beam 4), and a text's score is the same bits
    alone and in a batch (batch invariance)."""
    digits = ["3 1 4 1 5 9 2 6", "2 7 1 8", "1 6 1 8 0 3 3 9 8 8 7", "5", "9 9 8 2 4 4 3 5 3"]
    for options in (DecodingOptions(), DecodingOptions(beam_size=4)):
        fused_out = [t.hypotheses[0].text for t in engine.translate(digits, options)]
        assert fused_out == [t.hypotheses[0].text for t in graph.translate(digits, options)]
        assert fused_out[0] == "6 2 9 5 1 4 1 3"  # the reversal model reverses
        alone = [engine.translate([d], options)[0].hypotheses[0] for d in digits]
        batch = engine.translate(digits, options)
        assert [h.score for h in alone] == [t.hypotheses[0].score for t in batch]


def assert_falls_back(repository: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                      form: str, fallback: str, tolerances: dict, output: str) -> None:
    """Without the kernel, and when its check fails (``tolerances[output]`` below any difference), the
    engine's ``form`` (a Runtime property) is ``fallback``, with the log line naming why, and it translates."""
    name = "fused " + form.removesuffix("_form")
    caplog.set_level(logging.WARNING, logger="nmt.fused")
    monkeypatch.setattr(fused, "_attention", None)
    monkeypatch.setattr(fused, "MISSING", "the compiled kernel is missing (test)")
    assert getattr(Engine(repository, precision="int8", intra_op_threads=1).runtime, form) == fallback
    assert f"{name} unavailable (the compiled kernel is missing (test))" in caplog.text
    monkeypatch.setattr(fused, "_attention", _attention)
    monkeypatch.setitem(tolerances, output, -1.0)  # every difference is too large
    caplog.clear()
    engine = Engine(repository, precision="int8", intra_op_threads=1)
    assert getattr(engine.runtime, form) == fallback
    assert f"{name} refused ({output} differs from the graph's" in caplog.text
    assert engine.translate(["1 2 3"])[0].hypotheses[0].text == "3 2 1"


def test_without_the_kernel_or_when_its_check_fails_the_step_stays_on_the_graph(
        reversal_repository: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert_falls_back(reversal_repository, monkeypatch, caplog, "attention_form", "packed", fused.TOLERANCE, "attention")


def test_fp32_and_cuda_graphs_keep_their_attention(reversal_repository: Path) -> None:
    assert Engine(reversal_repository, precision="fp32", intra_op_threads=1).runtime.attention_form == "padded"


def test_the_shortlist_sessions_are_fused_too(reversal_repository: Path, reversal_corpus: Path,
                                              tmp_path: Path) -> None:
    import shutil

    from export.graphs import shortlist as build
    from service.decoding.shortlist import ShortlistChoice

    repo = tmp_path / "reversal" / "1"
    shutil.copytree(reversal_repository, repo)
    build.write(repo, reversal_corpus, build.ShortlistConfig(per_source=8, frequent=4, min_count=1))
    engine = Engine(repo, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
    graph = Engine(repo, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON, fused_attention=False)
    assert all(isinstance(s, fused.FusedStep) for s in engine.runtime._step_sessions.values())
    assert all(s.query is engine.runtime._fused.query for s in engine.runtime._step_sessions.values())
    texts = ["4 5 6", "1 2 3 4 5 6 7 8 9", "7 0 7"]
    for options in (DecodingOptions(), DecodingOptions(beam_size=3)):
        got = [t.hypotheses[0].text for t in engine.translate(texts, options)]
        assert got == [t.hypotheses[0].text for t in graph.translate(texts, options)]
        assert got[0] == "6 5 4"


def test_session_options_reach_both_parts(reversal_repository: Path) -> None:
    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1)
    step = engine.runtime.step_session(False)
    assert isinstance(step.query, ort.InferenceSession) and isinstance(step.tail, ort.InferenceSession)
    assert step.query.get_session_options().intra_op_num_threads == 1
    assert step.tail.get_session_options().intra_op_num_threads == 1
    assert step.threads == 1 and step.bias is not None  # the reversal step's output layer is fused too


def _log_softmax64(raw, scale, bias):
    x = raw.astype(np.float64) * scale + bias
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), V=st.integers(1, 300), k=st.integers(1, 12), threads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_output_kernel_matches_a_float64_log_softmax_and_its_top_k(rows, V, k, threads, seed) -> None:
    k = min(k, V)
    rng = np.random.default_rng(seed)
    raw = rng.normal(0, 4, (rows, V)).astype(np.float32)
    raw[:, rng.integers(0, V, 3)] = raw[0, 0]  # some ties
    scale, bias = rng.uniform(0.1, 2, (rows, 1)).astype(np.float32), rng.normal(0, 1, V).astype(np.float32)
    values, ids, log_probs = np.empty((rows, k), np.float32), np.empty((rows, k), np.int64), np.empty((rows, V), np.float32)
    _attention.output_layer(raw, scale, bias, values, ids, log_probs, threads)
    want = _log_softmax64(raw, scale, bias)
    np.testing.assert_allclose(log_probs, want, atol=2e-5)
    # the k best of the kernel's own log-probabilities, descending, ties to the lower id (ONNX Runtime's TopK)
    order = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_array_equal(values, np.take_along_axis(log_probs, order, axis=1))


def test_output_kernel_rows_do_not_depend_on_their_batch_or_threads() -> None:
    rng = np.random.default_rng(5)
    raw = rng.normal(0, 4, (40, 1000)).astype(np.float32)
    scale, bias = rng.uniform(0.1, 2, (40, 1)).astype(np.float32), rng.normal(0, 1, 1000).astype(np.float32)
    out = {}
    for threads in (1, 2, 4):
        values, ids = np.empty((40, 5), np.float32), np.empty((40, 5), np.int64)
        _attention.output_layer(raw, scale, bias, values, ids, None, threads)
        out[threads] = values, ids
    assert all(np.array_equal(out[1][i], out[t][i]) for t in (2, 4) for i in (0, 1))
    for r in (0, 17, 39):
        values, ids = np.empty((1, 5), np.float32), np.empty((1, 5), np.int64)
        _attention.output_layer(raw[r:r + 1].copy(), scale[r:r + 1].copy(), bias, values, ids)
        assert np.array_equal(values[0], out[1][0][r]) and np.array_equal(ids[0], out[1][1][r])


def test_output_kernel_refuses_a_k_it_cannot_give() -> None:
    raw, scale, bias = np.zeros((2, 4), np.float32), np.ones((2, 1), np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="1 <= k <= min"):
        _attention.output_layer(raw, scale, bias, np.empty((2, 5), np.float32), np.empty((2, 5), np.int64))
    with pytest.raises(ValueError, match="ids: a C-contiguous int64"):
        _attention.output_layer(raw, scale, bias, np.empty((2, 2), np.float32), np.empty((2, 2), np.int32))


def test_split_output_ends_the_middle_graph_at_the_output_product(tiny_repository: Path) -> None:
    engine = Engine(tiny_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    step = onnx.load(str(engine.manifest.path(engine.manifest.graphs["int8"].decoder_step)))
    middle, bias = fused.split_output(fused.split_step(step)[1])
    assert [o.name for o in middle.graph.output] == ["next_state", fused.RAW, fused.SCALE]
    assert not {"LogSoftmax", "TopK"} & {n.op_type for n in middle.graph.node}
    assert bias.shape == (engine.vocab_size,)
    rest = fused.split_step(step)[1]
    next(n for n in rest.graph.node if n.op_type == "LogSoftmax").op_type = "Softmax"
    with pytest.raises(ValueError, match="log_probs is not LogSoftmax"):
        fused.split_output(rest)


def test_the_next_product_is_carried_from_the_step_through_beam_reorders(reversal_repository: Path) -> None:
    """The middle graph makes the next step's state product: the query graph runs once per join,
    not once per step, and the translations keep their bits."""
    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1)
    step = engine.runtime.step_session(False)
    runs = []
    query_run = step.query.run
    step.query.run = lambda *a, **k: runs.append(1) or query_run(*a, **k)
    graph = Engine(reversal_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    for options in (DecodingOptions(), DecodingOptions(beam_size=3)):
        runs.clear()
        got = engine.translate(["1 2 3 4 5 6 7 8"], options)[0]
        assert got.steps > 5 and len(runs) == 1, (got.steps, len(runs))
        assert got.hypotheses[0].text == graph.translate(["1 2 3 4 5 6 7 8"], options)[0].hypotheses[0].text
    carrying = step._tail_outputs
    step._tail_outputs = [n for n in carrying if n != fused.NEXT_PRODUCT]  # the query graph at every step
    runs.clear()
    uncarried = engine.translate(["3 1 4 1 5", "9 2 6"], DecodingOptions(beam_size=3))
    assert len(runs) == max(t.steps for t in uncarried)
    step._tail_outputs = carrying
    carried = engine.translate(["3 1 4 1 5", "9 2 6"], DecodingOptions(beam_size=3))
    assert [h.score for t in carried for h in t.hypotheses] == [h.score for t in uncarried for h in t.hypotheses]


def test_texts_joining_a_running_batch_extend_the_carried_product(reversal_repository: Path) -> None:
    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1)
    step = engine.runtime.step_session(False)
    batch = engine.new_batch()
    batch.add([((0, 0), engine.prepare_text("1 2 3 4 5 6 7", DecodingOptions(), 0))])
    batch.step()
    batch.step()
    batch.add([((1, 0), engine.prepare_text("9 8", DecodingOptions(beam_size=2), 0))])  # two more rows
    state, product = step._box[-1]
    assert state is batch._state and len(product) == 3
    assert np.array_equal(product, step.query.run(None, {"state": engine.runtime.host_state(state)})[0])


def test_two_batches_taking_turns_keep_their_own_carried_products(reversal_repository: Path) -> None:
    """Two lanes' batches step in turns on one runtime: each finds its state's product."""
    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1)
    step = engine.runtime.step_session(False)
    runs = []
    query_run = step.query.run
    step.query.run = lambda *a, **k: runs.append(1) or query_run(*a, **k)
    batches = [engine.new_batch(), engine.new_batch()]
    for i, batch in enumerate(batches):
        batch.add([((i, 0), engine.prepare_text("1 2 3 4 5 6 7 8 9", DecodingOptions(beam_size=2), 0))])
    for _ in range(6):
        for batch in batches:
            batch.step()
    assert len(runs) == 2  # one per join, none per step


def test_bench_fused_runs_on_a_shipped_repository(reversal_repository: Path, reversal_corpus: Path,
                                                  tmp_path: Path) -> None:
    from loadtest import bench_fused

    out = tmp_path / "bench_fused"
    assert bench_fused.main([str(reversal_repository), "--texts", str(reversal_corpus / "test.jsonl"), "--rows", "1",
                             "9", "--draws", "1", "--rounds", "1", "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    assert "| 9 | median |" in text and "| 100.0% |" in text  # the same best word in every row
    profile = json.loads(out.with_suffix(".json").read_text())["profile"]
    assert {"attention kernel (compiled, timed)", "output kernel (compiled, timed)"} <= set(profile["fused"])
    assert "LogSoftmax" in profile["before"] and "LogSoftmax" not in profile["fused"]


_CLONES = {"arch=x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "arch=x86-64-v3": {"avx2", "fma"},
           "arch=x86-64": set()}


SOURCES = ("attention", "output_layer", "encoder", "shortlist_layer", "middle", "shortlist_words",  # setup.py's
           "encoder_rest", "query")


@pytest.mark.parametrize("target", list(_CLONES))
def test_each_clone_of_the_kernels_matches_the_references(target: str, tmp_path: Path) -> None:
    """The build holds the kernels for AVX-512, AVX2 + FMA and the baseline; the CPU picks one. Each is
    compiled alone here (``NMT_TARGET``) and checked against the float64 references, so a clone this
    machine would not pick is still tested wherever the CPU can run it."""
    import importlib.machinery
    import importlib.util
    import shutil
    import subprocess
    import sysconfig

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if not _CLONES[target] <= flags:
        pytest.skip(f"this CPU cannot run the {target} clone (lacks {sorted(_CLONES[target] - flags)})")
    source = Path(fused.__file__).parent
    built = tmp_path / f"_attention{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([compiler, "-O3", "-std=gnu11", "-Wno-psabi", "-shared", "-fPIC", f"-DNMT_TARGET=\"{target}\"",
                    f"-I{sysconfig.get_paths()['include']}", *(str(source / f"{name}.c") for name in SOURCES),
                    "-o", str(built)], check=True, capture_output=True, timeout=120)
    spec = importlib.util.spec_from_loader("_attention", importlib.machinery.ExtensionFileLoader("_attention", str(built)))
    clone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clone)
    rng = np.random.default_rng(11)
    product, keys, annotations, lengths, v = _inputs(rng, 9, 13, 48, 40, 8)
    alpha, context = np.empty((9, 13), np.float32), np.empty((9, 40), np.float32)
    clone.attend(product, keys, annotations, lengths, v, alpha, context)
    want_alpha, want_context = _reference(product[:, :48], keys, annotations, lengths, v)
    np.testing.assert_allclose(alpha, want_alpha, atol=2e-6)
    np.testing.assert_allclose(context, want_context, atol=1e-5)
    raw = rng.normal(0, 4, (7, 203)).astype(np.float32)
    scale, bias = rng.uniform(0.1, 2, (7, 1)).astype(np.float32), rng.normal(0, 1, 203).astype(np.float32)
    values, ids, log_probs = np.empty((7, 6), np.float32), np.empty((7, 6), np.int64), np.empty((7, 203), np.float32)
    clone.output_layer(raw, scale, bias, values, ids, log_probs)
    np.testing.assert_allclose(log_probs, _log_softmax64(raw, scale, bias), atol=2e-5)
    np.testing.assert_array_equal(ids, np.argsort(-log_probs, axis=1, kind="stable")[:, :6])
    from test_fused_encoder import _encode, _encoder, _model
    from test_fused_encoder import _inputs as _gru_inputs
    from test_fused_encoder import _reference as _gru_reference

    table, recurrent, bias_n = _model(rng, 23, 32)
    src, src_lengths = _gru_inputs(rng, 6, 9, 23)
    want = _gru_reference(table, recurrent, bias_n, src, src_lengths)
    for form in range(1 + ("avx2" in flags) + ({"avx512_vnni", "avx512bw"} <= flags)):  # its products' forms here
        got = _encode(_encoder(table, recurrent, bias_n), src, src_lengths, form=form, module=clone)
        np.testing.assert_allclose(got, want, atol=1e-3)
