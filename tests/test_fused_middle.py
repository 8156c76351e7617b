"""The compiled middle of the int8 step (service/decoding/fused_middle.py, middle.c): against the middle
graph it replaces on a real batch of a tiny model, its products' bits against ONNX Runtime's, its forms and
batch invariance, what it refuses, and where the engine uses it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from loadtest.step_graphs import graph_middle
from service.decoding import fused_middle
from service.decoding.engine import Engine
from service.decoding.fused_graphs import ALWAYS, CONTEXT, NEXT_PRODUCT, OUTPUT_INPUT, PRODUCT, SCALE
from service.decoding.shortlist import ShortlistChoice
from service.options import DecodingOptions

_attention = pytest.importorskip("service.decoding._attention", reason="installed without a C compiler")
VNNI = _attention.gru_form() == "avx512-vnni"
TEXTS = ["1 2 3 4 5", "9 8 7 6 5 4 3 2 1", "4 4 4", "0 1 0 1 7 7", "3 3 9"]


@pytest.fixture(scope="module")
def served(shortlisted: Path) -> tuple:
    """(the per-row step with the graph's middle, its middle graph, a feed of it from a real batch)."""
    with graph_middle():
        engine = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
    step = engine.runtime._step_sessions["rows"]
    batch = engine.new_batch()
    batch.add([((0, i), engine.prepare_text(t, DecodingOptions(beam_size=2), i)) for i, t in enumerate(TEXTS)])
    batch.step()
    state = engine.runtime.host_state(batch._state)
    rng = np.random.default_rng(0)
    feed = {"prev_tokens": batch._prev, "state": state, PRODUCT: step.query.run(None, {"state": state})[0],
            CONTEXT: rng.normal(0, 0.4, (len(state), step.ctx_size)).astype(np.float32)}
    return step, step.graphs["tail"], feed


def test_the_compiled_middle_gives_the_graphs_outputs(served) -> None:
    """Against the graph's session on a real batch: the next state to the GRU's rounding (its own sigmoid and
    tanh), the output layer's input within one quantum, its scale and the always-words' products closely."""
    step, graph, feed = served
    kernel = fused_middle.MiddleKernel.of(graph, form=0)
    want = dict(zip(fused_middle.OUTPUTS, step.tail.run(list(fused_middle.OUTPUTS), feed)))
    got = dict(zip(fused_middle.OUTPUTS, kernel.run(None, feed)))
    assert [got[n].shape for n in fused_middle.OUTPUTS] == [want[n].shape for n in fused_middle.OUTPUTS]
    assert got[OUTPUT_INPUT].dtype == np.uint8
    np.testing.assert_allclose(got["next_state"], want["next_state"], atol=2e-6)
    assert np.abs(got[OUTPUT_INPUT].astype(int) - want[OUTPUT_INPUT]).max() <= 1
    np.testing.assert_allclose(got[SCALE], want[SCALE], rtol=1e-5)
    np.testing.assert_allclose(got[ALWAYS], want[ALWAYS], atol=0.05 * np.abs(want[ALWAYS]).max())
    np.testing.assert_allclose(got[NEXT_PRODUCT], want[NEXT_PRODUCT], atol=0.05 * np.abs(want[NEXT_PRODUCT]).max())


def test_its_products_are_onnx_runtimes_bits(served) -> None:
    """The next step's product from the kernel's own next state is the query graph's, bit for bit (the same
    integer sums, scaled and biased in two roundings), and so is the always-words' product of its output
    layer input (the graph's product on the kernel's bytes)."""
    step, graph, feed = served
    out = dict(zip(fused_middle.OUTPUTS, fused_middle.MiddleKernel.of(graph, form=0).run(None, feed)))
    np.testing.assert_array_equal(out[NEXT_PRODUCT], step.query.run(None, {"state": out["next_state"]})[0])
    product = next(n for n in graph.graph.node if n.output[0] == ALWAYS)
    inputs = [onnx.helper.make_tensor_value_info(OUTPUT_INPUT, onnx.TensorProto.UINT8, ["rows", None])]
    outputs = [onnx.helper.make_tensor_value_info(ALWAYS, onnx.TensorProto.FLOAT, ["rows", None])]
    single = onnx.helper.make_graph([product], "always", inputs, outputs,
                                    [t for t in graph.graph.initializer if t.name in product.input])
    model = onnx.helper.make_model(single, opset_imports=list(graph.opset_import), ir_version=graph.ir_version)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(out[ALWAYS], session.run(None, {OUTPUT_INPUT: out[OUTPUT_INPUT]})[0])


@pytest.mark.skipif(not VNNI, reason=f"this CPU has no AVX-512 VNNI (its int8 products: {_attention.gru_form()}): "
                                     "only the plain form runs here")
def test_the_vnni_form_gives_the_plain_forms_bits(served) -> None:
    step, graph, feed = served
    plain = fused_middle.MiddleKernel.of(graph, form=0).run(None, feed)
    for threads in (1, 2):
        fast = fused_middle.MiddleKernel.of(graph, threads=threads, form=fused_middle.VNNI).run(None, feed)
        for name, a, b in zip(fused_middle.OUTPUTS, plain, fast):
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_has_the_same_bits_alone_as_in_the_batch(served, threads: int) -> None:
    _, graph, feed = served
    kernel = fused_middle.MiddleKernel.of(graph, threads=threads)
    whole = kernel.run(None, feed)
    for row in (0, len(feed["state"]) - 1):
        alone = kernel.run(None, {n: v[row:row + 1] for n, v in feed.items()})
        for name, a, b in zip(fused_middle.OUTPUTS, whole, alone):
            np.testing.assert_array_equal(a[row:row + 1], b, err_msg=name)


def test_bad_inputs_are_refused_naming_them(served) -> None:
    _, graph, feed = served
    kernel = fused_middle.MiddleKernel.of(graph, form=0)
    vocabulary = kernel.emb.shape[0]
    with pytest.raises(ValueError, match=f"prev holds {vocabulary}, not a word id below {vocabulary}"):
        kernel.run(None, {**feed, "prev_tokens": np.full_like(feed["prev_tokens"], vocabulary)})
    with pytest.raises(ValueError, match="shapes do not agree"):
        kernel.run(None, {**feed, CONTEXT: feed[CONTEXT][:1]})
    with pytest.raises(ValueError, match="form 1 is not available"):
        fused_middle.MiddleKernel.of(graph, form=1).run(None, feed)


def test_a_middle_graph_of_another_shape_is_refused(served) -> None:
    _, graph, _ = served
    other = onnx.ModelProto()
    other.CopyFrom(graph)
    tanh = next(n for n in other.graph.node if n.op_type == "Tanh")
    tanh.op_type = "Relu"
    with pytest.raises(ValueError, match="not the int8 step's GRU"):
        fused_middle.MiddleKernel.of(other)
    other.CopyFrom(graph)
    split = next(t for t in other.graph.initializer if t.name == other.graph.node[8].input[1])
    split.CopyFrom(onnx.numpy_helper.from_array(np.array([2, 3], np.int64), split.name))  # the gates' Split
    with pytest.raises(ValueError, match="do not split"):
        fused_middle.MiddleKernel.of(other)


def test_the_engine_runs_it_where_offered_and_the_graph_elsewhere(shortlisted: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The decision with the CPU's form faked: AVX-512 VNNI gets the kernel (checked at load like the rest of
    the fused step), AVX2 the graph's middle with one log line; both translate."""
    class Faked:
        def __init__(self, form: str) -> None:
            self.form = form

        def gru_form(self) -> str:
            return self.form

        def __getattr__(self, name: str):
            return getattr(_attention, name)

    for form, compiled in (("avx512-vnni", True), ("avx2", False)):
        monkeypatch.setattr(fused_middle, "_attention", Faked(form))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nmt.fused"):
            engine = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
        tail = engine.runtime._step_sessions["rows"].tail
        assert isinstance(tail, fused_middle.MiddleKernel) is compiled
        query = engine.runtime._step_sessions["rows"].query  # the joins' too: one query for both steps
        assert isinstance(query, fused_middle.QueryKernel) is compiled and engine.runtime._fused.query is query
        assert engine.shortlist_reason.endswith(f"each row over its own words, middle {'compiled' if compiled else 'graph'}")
        said = [r.getMessage() for r in caplog.records if "compiled middle" in r.getMessage()]
        assert said == ([] if compiled else ["compiled middle not offered (this CPU's int8 products are avx2, not "
                                             "AVX-512 VNNI): the step's middle runs on ONNX Runtime's operators"])
        assert engine.translate(TEXTS[:2])[0].hypotheses[0].tokens
    monkeypatch.setattr(fused_middle, "_attention", None)
    assert fused_middle.offered() == "the compiled kernels are missing"


def test_bench_middle_runs_on_a_shipped_repository(shortlisted: Path, reversal_corpus: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``loadtest/bench_middle.py`` on a shortlisted repository (the kernel's plain form where this CPU has no
    AVX-512 VNNI): a row per draw and a median per row count, every row the same best word both ways."""
    import json

    from loadtest import bench_middle

    if not VNNI:
        monkeypatch.setattr(fused_middle, "products_offered", lambda: None)
    out = tmp_path / "bench_middle"
    assert bench_middle.main([str(shortlisted), "--texts", str(reversal_corpus / "test.jsonl"), "--rows", "1", "6",
                              "--draws", "1", "--rounds", "1", "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    assert "| 6 | median |" in text and text.count("| 100.0% |") == 2
    draws = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert all(d["compiled step ms"] > 0 and d["graph middle ms"] > 0 for v in draws.values() for d in v)


@pytest.mark.parametrize("form", [0, fused_middle.VNNI])
def test_the_query_kernel_gives_the_query_graphs_bits(served, form: int) -> None:
    """``QueryKernel`` (the query graph on the middle kernel's next product): ONNX Runtime's bits on a real
    batch's states, on states past the quantizer's range, on one row, and on none; each row alone as in the batch."""
    if form == fused_middle.VNNI and not VNNI:
        pytest.skip(f"this CPU has no AVX-512 VNNI (its int8 products: {_attention.gru_form()})")
    step, graph, feed = served
    for threads in (1, 2):
        kernel = fused_middle.QueryKernel.of(step.graphs["query"], fused_middle.MiddleKernel.of(graph, threads, form))
        wide = np.random.default_rng(1).normal(0, 3, (9, feed["state"].shape[1])).astype(np.float32)
        for state in (feed["state"], wide, wide[:1], wide[:0]):
            got = kernel.run(None, {"state": state})[0]
            np.testing.assert_array_equal(got, step.query.run(None, {"state": state})[0])
            np.testing.assert_array_equal(got[-1:], kernel.run(None, {"state": state[-1:]})[0])


def test_a_query_graph_that_is_not_the_middles_next_product_is_refused(served) -> None:
    step, graph, feed = served
    kernel = fused_middle.MiddleKernel.of(graph, form=0)
    other = onnx.ModelProto()
    other.CopyFrom(step.graphs["query"])
    weight = next(t for t in other.graph.initializer if t.name == other.graph.node[1].input[1])
    changed = onnx.numpy_helper.to_array(weight).copy()
    changed[0, 0] ^= 1
    weight.CopyFrom(onnx.numpy_helper.from_array(changed, weight.name))
    with pytest.raises(ValueError, match="not the middle's next product"):
        fused_middle.QueryKernel.of(other, kernel)
    other.graph.node[0].op_type = "DynamicQuantizeLinear"
    with pytest.raises(ValueError, match="not a state's quantizer and product"):
        fused_middle.QueryKernel.of(other, kernel)
    query = fused_middle.QueryKernel.of(step.graphs["query"], kernel)
    with pytest.raises(ValueError, match="shapes do not agree"):
        _attention.state_product((np.ascontiguousarray(feed["state"][:, :-2]), *query.product[:4],
                                  np.empty((len(feed["state"]), query.product[4]), np.float32)), 1.0)
    with pytest.raises(ValueError, match="must be .* with colsum"):  # out's width is not the product's
        _attention.state_product((feed["state"], *query.product[:4], np.empty((len(feed["state"]), 8), np.float32)),
                                 1.0)


def test_a_query_kernel_that_differs_from_the_graph_is_not_used(shortlisted: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The check at load: a kernel whose product is off by one ulp leaves ONNX Runtime's query session, one log line."""
    monkeypatch.setattr(fused_middle, "offered", lambda: None)  # the compiled middle (its plain form without VNNI)
    run = fused_middle.QueryKernel.run
    monkeypatch.setattr(fused_middle.QueryKernel, "run", lambda self, names, feed: [
        np.nextafter(p, np.inf) for p in run(self, names, feed)])
    with caplog.at_level(logging.INFO, logger="nmt.fused"):
        engine = Engine(shortlisted, precision="int8", intra_op_threads=1, shortlist=ShortlistChoice.ON)
    rows = engine.runtime._step_sessions["rows"]
    assert isinstance(rows.tail, fused_middle.MiddleKernel) and isinstance(rows.query, ort.InferenceSession)
    assert [r.getMessage() for r in caplog.records if "compiled query" in r.getMessage()] == [
        "compiled query refused (its product is not the query graph's bits): the query graph runs on ONNX Runtime's "
        "operators"]
    assert engine.translate(TEXTS[:2])[0].hypotheses[0].tokens
