"""The int8 decoder step built from the weights (``export.graphs.int8_step``) and its product floor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.graphs import int8_step, parity, quantize, verify
from export.train.checkpoint import load_checkpoint
from export.train.model import RNNSearch
from service.models.config import ModelConfig
from service.models.manifest import DECODER_INPUTS, DECODER_OUTPUTS, load_manifest
from service.text.tokenizer import BOS_ID, PAD_ID


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def step_feed(model: RNNSearch, rng: np.random.Generator, *, rows: int, src_len: int, k: int = 3
              ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Decoder-step inputs from the model's own encoder on random padded sources (lengths too)."""
    cfg = model.config
    src, lengths = verify.random_batch(rng, batch=rows, src_len=src_len, vocab_size=cfg.src_vocab_size)
    with torch.inference_mode():
        annotations, keys, state = model.encoder(torch.from_numpy(src), torch.from_numpy(lengths))
    prev = rng.integers(verify.FIRST_ID, cfg.tgt_vocab_size, size=rows).astype(np.int64)
    prev[0] = BOS_ID
    return {"prev_tokens": prev, "state": state.numpy(), "annotations": annotations.numpy(),
            "keys": keys.numpy(), "src_mask": src != PAD_ID, "k": np.array(k, dtype=np.int64)}, lengths


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint: Path) -> RNNSearch:
    return load_checkpoint(tiny_checkpoint).model().eval()


@pytest.fixture(scope="module")
def odd_model() -> RNNSearch:
    """Sizes unlike the tiny model's (every width distinct, vocabulary larger than one block)."""
    torch.manual_seed(3)
    config = ModelConfig(src_vocab_size=70, tgt_vocab_size=90, emb_size=24, enc_hidden_size=20,
                         dec_hidden_size=36, attn_size=28, out_size=10, dropout=0.0)
    return RNNSearch(config).eval()


def test_graph_keeps_the_contract(tiny_model: RNNSearch) -> None:
    model = int8_step.build_int8_step(tiny_model)
    onnx.checker.check_model(model, full_check=True)
    graph = model.graph
    assert [i.name for i in graph.input] == list(DECODER_INPUTS)
    assert [o.name for o in graph.output] == list(DECODER_OUTPUTS)
    for value, axes in [*zip(graph.input, DECODER_INPUTS.values()), *zip(graph.output, DECODER_OUTPUTS.values())]:
        dims = value.type.tensor_type.shape.dim
        assert [d.dim_param for d, a in zip(dims, axes) if a in verify.DYNAMIC_AXES] == \
            [a for a in axes if a in verify.DYNAMIC_AXES], value.name
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulIntegerToFloat") == 4  # state, [E y; c], s' and the output layer
    inits = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "MatMulIntegerToFloat":  # u8 x u8: exact where u8 x s8 saturates (AVX2)
            assert inits[node.input[1]].data_type == TensorProto.UINT8
            assert node.input[5] == "zero_point"
    assert "GRU" not in ops and "DynamicQuantizeLinear" not in ops and "ReduceLogSumExp" not in ops


@pytest.mark.parametrize("which", ["tiny_model", "odd_model"])
def test_parity_with_pytorch(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which)
    sess = session(int8_step.build_int8_step(model))
    rng = np.random.default_rng(0)
    worst = 0.0
    for rows, src_len in ((1, 1), (5, 7), (13, 4)):
        feed, _ = step_feed(model, rng, rows=rows, src_len=src_len)
        out = dict(zip(DECODER_OUTPUTS, sess.run(list(DECODER_OUTPUTS), feed)))
        t = {n: torch.from_numpy(feed[n]) for n in ("prev_tokens", "state", "annotations", "keys", "src_mask")}
        with torch.inference_mode():
            log_probs, state, alpha = model.step_log_probs(t["prev_tokens"], t["state"], t["annotations"],
                                                           t["keys"], t["src_mask"])
        k = int(feed["k"])
        worst = max(worst, parity.max_diff((out["log_probs"], log_probs.numpy()),
                                           (out["topk_log_probs"], log_probs.topk(k, dim=1).values.numpy()),
                                           (out["next_state"], state.numpy()), (out["attention"], alpha.numpy())))
        # the top-k is the top-k of the graph's own log-probabilities, in order
        lp = out["log_probs"]
        assert np.array_equal(np.take_along_axis(lp, out["topk_ids"], axis=1), out["topk_log_probs"])
        assert np.all(np.diff(out["topk_log_probs"], axis=1) <= 0)
        assert np.allclose(np.exp(lp).sum(1), 1.0, atol=1e-4)
    assert 0 < worst <= verify.TOLERANCES["int8"].step


def test_batch_invariance_bit_exact(odd_model: RNNSearch) -> None:
    """A row alone (one masked column, as the service pads) and inside wider padded batches of any
    size and order: bit-identical outputs."""
    sess = session(int8_step.build_int8_step(odd_model))
    rng = np.random.default_rng(7)
    feed, lengths = step_feed(odd_model, rng, rows=9, src_len=12)
    names = list(DECODER_OUTPUTS)
    together = dict(zip(names, sess.run(names, feed)))
    row = int(np.argmin(lengths[1:])) + 1  # a short row inside the batch
    n = int(lengths[row])
    for rows in ([row], [row, 0], [7, row, 2, 8, 1]):
        part = dict(zip(names, sess.run(names, {**{k: v[rows] for k, v in feed.items() if k != "k"},
                                                "k": feed["k"]})))
        for name in names:
            assert np.array_equal(part[name][rows.index(row)], together[name][row]), name
    width = n + 1  # alone, as wide as its source plus one masked column
    alone = {k: (v[row:row + 1, :width] if k in ("annotations", "keys", "src_mask") else v[row:row + 1])
             for k, v in feed.items() if k != "k"}
    alone = dict(zip(names, sess.run(names, {**alone, "k": feed["k"]})))
    for name in ("log_probs", "topk_log_probs", "topk_ids", "next_state"):
        assert np.array_equal(alone[name][0], together[name][row]), name
    assert np.array_equal(alone["attention"][0], together["attention"][row, :width])
    assert not together["attention"][row, n:].any()


def test_exported_repository_uses_the_built_step(tiny_repository: Path) -> None:
    m = load_manifest(tiny_repository)
    graph = onnx.load(str(m.path(m.graphs["int8"].decoder_step))).graph
    assert graph.name == "decoder_step_int8"
    assert m.raw["parity"]["int8"]["padding_max_abs_diff"] == 0.0


def test_product_floor_builds_and_runs(tiny_model: RNNSearch, tiny_repository: Path) -> None:
    step = int8_step.build_int8_step(tiny_model)
    floor = int8_step.product_floor(step)
    assert {n.op_type for n in floor.graph.node} == {"MatMulIntegerToFloat"}
    assert len(floor.graph.node) == sum(n.op_type == "MatMulIntegerToFloat" for n in step.graph.node)
    sess = session(floor)
    rng = np.random.default_rng(1)
    inits = {t.name: t for t in floor.graph.initializer}
    feed = {n.input[0]: rng.integers(0, 256, size=(6, inits[n.input[1]].dims[0])).astype(np.uint8)
            for n in floor.graph.node}
    outs = sess.run(None, feed)
    for node, out in zip(floor.graph.node, outs):
        assert out.shape == (6, inits[node.input[1]].dims[1])
    # the generic rewrite's step (the previous int8 graph) has a floor too: its five products
    old = quantize.quantize_model(onnx.load(str(tiny_repository / "decoder_step.onnx")))
    assert len(int8_step.product_floor(old).graph.node) == 5


def test_products_are_exact_at_the_extremes() -> None:
    """uint8 activations at 255 against weights at +-127: the int32 product is exact (a u8 x s8
    kernel adding pairs in saturating 16-bit lanes, AVX2 without VNNI, gets this wrong)."""
    rng = np.random.default_rng(2)
    k, n = 64, 16
    weight = rng.choice([-1.0, 1.0], size=(k, n)).astype(np.float32)  # every column's max: +-127
    g = int8_step._Graph()
    g.const("one", 1.0)
    g.const("zero_point", quantize.ZERO_POINT, np.uint8)
    out = g.product("p", "a", weight, a_scale=1.0, bias=None, output="y")
    graph = helper.make_graph(g.nodes, "p", [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, k])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [None, n])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(quantize.CONTRIB_DOMAIN, 1)])
    a = np.full((3, k), 255, dtype=np.uint8)
    a[1] = 1
    a[2, ::2] = 0
    got = session(model).run(None, {"a": a})[0]
    scale = numpy_helper.to_array(next(t for t in g.inits if t.name == "p/weight_scale"))
    exact = (a.astype(np.int64) - quantize.ZERO_POINT) @ np.round(weight * 127).astype(np.int64)
    np.testing.assert_allclose(got, exact * scale, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 5, 45, 90])
def test_blocked_topk_is_the_plain_topk(odd_model: RNNSearch, k: int) -> None:
    """Values and ids identical to one TopK over the vocabulary (90 = 2 blocks of 45), ties too."""
    assert int8_step.topk_width(90, int8_step.TOPK_BLOCK) == 45
    blocked = int8_step.build_int8_step(odd_model)
    assert sum(n.op_type == "TopK" for n in blocked.graph.node) == 3
    plain = int8_step.build_int8_step(odd_model, topk_block=None)
    rng = np.random.default_rng(k)
    feed, _ = step_feed(odd_model, rng, rows=11, src_len=6, k=k)
    a, b = session(blocked).run(None, feed), session(plain).run(None, feed)
    for name, x, y in zip(DECODER_OUTPUTS, a, b):
        assert np.array_equal(x, y), name
    # ties: a row of equal log-probabilities resolves to the lowest ids, as TopK does
    lp = np.zeros((2, 90), dtype=np.float32)
    lp[1, 50:] = 1.0
    graph = helper.make_graph([], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 90]),
                                        helper.make_tensor_value_info("k", TensorProto.INT64, [])], [], [])
    g = int8_step._Graph()
    int8_step._blocked_topk(g, "x", g.one("Reshape", ["k", g.const("one_dim", [1], np.int64)]), 2, 45)
    graph.node.extend(g.nodes)
    graph.initializer.extend(g.inits)
    graph.output.extend([helper.make_tensor_value_info("topk_log_probs", TensorProto.FLOAT, [None, None]),
                         helper.make_tensor_value_info("topk_ids", TensorProto.INT64, [None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    values, ids = session(model).run(None, {"x": lp, "k": np.array(k, dtype=np.int64)})
    assert ids[0].tolist() == list(range(k)) and ids[1].tolist() == list(range(50, 50 + k))[:40] + \
        list(range(0, max(k - 40, 0)))
