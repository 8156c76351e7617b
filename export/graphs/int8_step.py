"""The int8 decoder step, built node by node from the model's weights (``nmt export --quantize int8``).

The generic rewrite (``export.graphs.quantize``) turns every product of the traced
fp32 step into "quantize the row, int8 product, scale, add the bias": five
products, and about sixty element-wise nodes around them, which cost more
than the products themselves at 160 rows. This graph computes the same step
(``RNNSearch.step_log_probs`` + top-k, same inputs and outputs as the
contract in ``service/manifest.py``) with less work around the products:

- products that read the same activation are one product: ``state`` feeds the
  attention query and the GRU's hidden gates (512 x 2048); ``[E y; c]`` feeds
  the GRU's input gates and its share of the deep output (768 x 2048);
- activations whose range is fixed by the model are quantized with a constant
  scale, one ``QuantizeLinear``: the state and the attention context lie in
  [-1, 1] (a GRU state, a convex combination of GRU outputs), so their scale
  is 1/127; the target embedding is stored as uint8 with one scale for the
  table (its max |value| / 127, folded into the weights' rows), so the lookup
  *is* the quantized activation. With a constant A scale the product's scale,
  zero point and bias are all inside ``MatMulIntegerToFloat`` (its A scale is
  the constant 1, the 1/127 is folded into the per-column weight scales);
- only the deep output's maxout, whose range is not fixed, keeps a per-row
  scale (``max|t| / 127``): its row scale is applied by a ``Mul`` and the bias by
  an ``Add`` on the (rows, vocab) logits (see ``export.graphs.quantize`` on why the row
  scale is never ``MatMulIntegerToFloat``'s A scale);
- the log-probabilities are one ``LogSoftmax`` (the contract's ``log_probs``;
  "logits minus ``ReduceLogSumExp``" was measured 10x slower, and the top-k
  needs the normalizer anyway, so an output the service does not fetch costs
  nothing extra); the top-k is *blocked* (``_blocked_topk``): a vectorized
  ``ReduceMax`` over blocks of 64, a top-k of the block maxima, and a top-k
  over the k best blocks only, instead of TopK's scalar pass over the whole
  vocabulary (same values and ids, ties included).

- the attention's score ``v^T tanh(.)`` is a ``Gemm`` (1, A) x (rows * src_len,
  A)^T, measured 3x faster than the traced MatMul by (A, 1).

Every scale is a constant or a function of the row itself, and every other
node is row-wise, so a row's outputs are bit-identical alone or in any batch,
padded or not (``tests/test_int8_graph.py``; with at least one masked column,
as the service pads, ``service.decoding.layout.width``). A state outside [-1, 1] (never
produced by the model) would saturate, not wrap.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from export.graphs.quantize import CONTRIB_DOMAIN, QMAX, TINY, ZERO_POINT, symmetric_int8, unsigned
from export.train.model import NEG_LARGE, RNNSearch
from service.models.config import ModelConfig
from service.models.manifest import DECODER_INPUTS, DECODER_OUTPUTS, SIZES

OPSET = 17
UNIT = 1.0 / QMAX  # the scale of an activation in [-1, 1]
SYMBOLS = {"rows": "rows", "src_len": "src_len", "k": "k"}
TOPK_BLOCK = 64  # width of the blocks of the blocked top-k (measured best of 32, 64, 160 at 8k)


class _Graph:
    """Nodes and initializers under construction."""

    def __init__(self, prefix: str = "") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0
        self.prefix = prefix  # of generated names (a subgraph's must not shadow its graph's)

    def const(self, name: str, value: np.ndarray | float | int | list, dtype=np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, *, domain: str = "",
           **attrs) -> list[str]:
        self.count += 1
        names = outputs if isinstance(outputs, list) else [f"{self.prefix}{op_type.lower()}_{self.count}_{i}"
                                                           for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=f"{self.prefix}{op_type}_{self.count}",
                                           domain=domain, **attrs))
        return names

    def one(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        return self.op(op_type, inputs, [output] if output else 1, **attrs)[0]

    def product(self, name: str, x_uint8: str, weight: np.ndarray, *, a_scale: float,
                bias: np.ndarray | None, output: str | None = None) -> str:
        """x (rows, in) uint8 around 128 with scale ``a_scale`` @ weight (in, out) [+ bias]."""
        quantized, scale = symmetric_int8(weight.astype(np.float32), axis=0)  # (in, out), (1, out)
        inputs = [x_uint8, self.const(f"{name}/weight", unsigned(quantized), np.uint8), "one",
                  self.const(f"{name}/weight_scale", (scale.reshape(-1) * np.float32(a_scale)).astype(np.float32)),
                  "zero_point", "zero_point"]
        if bias is not None:
            inputs.append(self.const(f"{name}/bias", bias.astype(np.float32)))
        return self.op("MatMulIntegerToFloat", inputs, [output] if output else 1, domain=CONTRIB_DOMAIN)[0]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def topk_width(vocab: int, target: int | None) -> int | None:
    """The block width of the blocked top-k: a divisor of ``vocab`` near ``target`` (from half to
    twice it) leaving at least two blocks, else None (a plain TopK)."""
    if not target:
        return None
    widths = [w for w in range(max(target // 2, 1), 2 * target + 1) if vocab % w == 0 and vocab // w > 1]
    return min(widths, key=lambda w: abs(w - target), default=None)


def _attention(g: _Graph, model: RNNSearch, query: str) -> str:
    """Additive attention: v^T tanh(keys + W s), masked, softmax over src_len; the context."""
    A, C = model.config.attn_size, model.config.ctx_size
    hidden = g.one("Tanh", [g.one("Add", ["keys", g.one("Unsqueeze", [query, g.const("axis1", [1], np.int64)])])])
    # v as the left side of a Gemm (1, A) x (rows * src_len, A)^T: 3x faster than a MatMul by (A, 1)
    hidden = g.one("Reshape", [hidden, g.const("flat_hidden", [-1, A], np.int64)])  # (rows * src_len, A)
    v = _np(model.decoder.attention.v.weight).reshape(1, A)
    energy = g.one("Gemm", [g.const("attention_v", v), hidden], transB=1)
    energy = g.one("Reshape", [energy, g.one("Shape", ["src_mask"])])  # (rows, src_len)
    energy = g.one("Where", ["src_mask", energy, g.const("neg_large", NEG_LARGE)])  # (rows, src_len)
    alpha = g.one("Softmax", [energy], "attention", axis=1)
    context = g.one("MatMul", [g.one("Unsqueeze", [alpha, "axis1"]), "annotations"])  # (rows, 1, C)
    return g.one("Reshape", [context, g.const("rows_by_ctx", [-1, C], np.int64)])


def _deep_output(g: _Graph, model: RNNSearch, next_state: str, w_state: np.ndarray, pre_x: str) -> str:
    """Maxout over pairs of [s'; E y; c] W + b (the [E y; c] part, ``pre_x``, came with the GRU's
    input gates), then the vocabulary projection: the logits (rows, vocab)."""
    O, dec = model.config.out_size, model.decoder
    state_q2 = g.one("QuantizeLinear", [next_state, "unit", "zero_point"])
    pre = g.one("Add", [g.product("state_output_product", state_q2, w_state, a_scale=UNIT, bias=None), pre_x])
    pre = g.one("Reshape", [pre, g.const("pairs_shape", [0, 2, O], np.int64)])
    t = g.one("ReduceMax", [pre], axes=[1], keepdims=0)  # (rows, O), range not fixed: per-row scale
    t_max = g.one("Max", [g.one("ReduceMax", [g.one("Abs", [t])], axes=[1], keepdims=1),
                          g.const("tiny", TINY)])  # (rows, 1)
    t_q = g.one("QuantizeLinear", [g.one("Mul", [t, g.one("Div", [g.const("qmax", QMAX), t_max])]), "one",
                                   "zero_point"])
    w_out, b_out = _np(dec.output.weight).T, _np(dec.output.bias)  # (O, vocab)
    logits = g.product("output_product", t_q, w_out, a_scale=1.0, bias=None)
    return g.one("Add", [g.one("Mul", [logits, g.one("Mul", [t_max, g.const("inv_qmax", UNIT)])]),
                         g.const("output_bias", b_out)])


def build_int8_step(model: RNNSearch, *, topk_block: int | None = TOPK_BLOCK) -> onnx.ModelProto:
    """The int8 decoder-step graph of ``model`` (contract names and axes); ``topk_block``: the
    blocked top-k's block width (None: one TopK over the vocabulary)."""
    cfg = model.config
    dec = model.decoder
    H, E, A, O = cfg.dec_hidden_size, cfg.emb_size, cfg.attn_size, cfg.out_size
    g = _Graph()
    g.const("one", 1.0)
    g.const("zero_point", ZERO_POINT, np.uint8)
    g.const("unit", UNIT)

    # state (rows, H) in [-1, 1] -> uint8; one product for the query and the GRU's hidden gates
    w_ih, w_hh = _np(dec.cell.weight_ih).T, _np(dec.cell.weight_hh).T  # (E + C, 3H), (H, 3H): r, z, n
    b_ih, b_hh = _np(dec.cell.bias_ih), _np(dec.cell.bias_hh)
    w_query = _np(dec.attention.query.weight).T  # (H, A)
    state_q = g.one("QuantizeLinear", ["state", "unit", "zero_point"])
    from_state = g.product("state_product", state_q, np.concatenate([w_query, w_hh], axis=1), a_scale=UNIT,
                           bias=np.concatenate([np.zeros(A, np.float32), b_hh]))
    query, gh_rz, gh_n = g.op("Split", [from_state, g.const("split_state", [A, 2 * H, H], np.int64)], 3, axis=1)

    context = _attention(g, model, query)  # (rows, C)

    # y_{i-1}: a uint8 table with one scale for the whole table (folded into the weights' rows)
    table = _np(dec.embed.weight)  # (vocab, E)
    table_max = float(max(np.abs(table).max(), TINY))
    table_q = (np.clip(np.round(table / table_max * QMAX), -QMAX, QMAX) + ZERO_POINT).astype(np.uint8)
    emb_q = g.one("Gather", [g.const("embedding", table_q, np.uint8), "prev_tokens"], axis=0)  # (rows, E)
    ctx_q = g.one("QuantizeLinear", [context, "unit", "zero_point"])  # (rows, C), context in [-1, 1]
    x_q = g.one("Concat", [emb_q, ctx_q], axis=1)  # [E y; c] (rows, E + C)
    w_pre, b_pre = _np(dec.pre_output.weight).T, _np(dec.pre_output.bias)  # (H + E + C, 2 O): [s; E y; c]
    pairs = np.concatenate([np.arange(0, 2 * O, 2), np.arange(1, 2 * O, 2)])  # maxout pairs -> two halves
    w_pre, b_pre = w_pre[:, pairs], b_pre[pairs]
    w_x = np.concatenate([w_ih, w_pre[H:]], axis=1)  # (E + C, 3H + 2 O)
    w_x[:E] *= table_max  # rows of the embedding: its unit is table_max
    from_x = g.product("input_product", x_q, w_x, a_scale=UNIT, bias=np.concatenate([b_ih, b_pre]))
    gi_rz, gi_n, pre_x = g.op("Split", [from_x, g.const("split_x", [2 * H, H, 2 * O], np.int64)], 3, axis=1)

    # GRU cell (PyTorch's): r, z = sigmoid(gi + gh); n = tanh(gi_n + r * gh_n); s' = n + z (s - n)
    r, z = g.op("Split", [g.one("Sigmoid", [g.one("Add", [gi_rz, gh_rz])]), g.const("split_rz", [H, H], np.int64)],
                2, axis=1)
    n = g.one("Tanh", [g.one("Add", [gi_n, g.one("Mul", [r, gh_n])])])
    next_state = g.one("Add", [n, g.one("Mul", [z, g.one("Sub", ["state", n])])], "next_state")

    logits = _deep_output(g, model, next_state, w_pre[:H], pre_x)  # (rows, vocab)

    # log-probabilities: logits - logsumexp; the top-k on the logits
    log_probs = g.one("LogSoftmax", [logits], "log_probs", axis=1)
    k = g.one("Reshape", ["k", g.const("one_dim", [1], np.int64)])
    width = topk_width(cfg.tgt_vocab_size, topk_block)
    if width is not None:
        _blocked_topk(g, log_probs, k, cfg.tgt_vocab_size // width, width)
    else:
        g.op("TopK", [log_probs, k], ["topk_log_probs", "topk_ids"], axis=1)
    return _model(g, cfg)


def _blocked_topk(g: _Graph, x: str, k: str, blocks: int, width: int) -> None:
    """TopK over (rows, blocks * width) through the blocks with the k largest maxima: the k
    largest values all lie in them (a value outside is beaten by k block maxima), so one
    vectorized pass (ReduceMax over blocks) replaces most of TopK's scalar pass."""
    cube = g.one("Reshape", [x, g.const("topk_cube", [0, blocks, width], np.int64)])  # (rows, blocks, width)
    maxima = g.one("ReduceMax", [cube], axes=[2], keepdims=0)  # (rows, blocks)
    kb = g.one("Min", [k, g.const("topk_blocks", [blocks], np.int64)])  # k > blocks: every block
    _, best = g.op("TopK", [maxima, kb], 2, axis=1)  # (rows, kb) block ids, largest maximum first
    # in index order, so that ties among candidates resolve as TopK's do over the whole row
    best = g.op("TopK", [best, kb], 2, axis=1, largest=0)[0]
    picked = g.one("GatherND", [cube, g.one("Unsqueeze", [best, g.const("axis_last", [-1], np.int64)])],
                   batch_dims=1)  # (rows, kb, width)
    flat = g.one("Reshape", [picked, g.const("topk_flat", [0, -1], np.int64)])  # (rows, kb * width)
    g.op("TopK", [flat, k], ["topk_log_probs", "position"], axis=1)  # position in [0, kb * width)
    w = g.const("topk_width", width, np.int64)
    block = g.one("GatherElements", [best, g.one("Div", ["position", w])], axis=1)  # (rows, k)
    g.one("Add", [g.one("Mul", [block, w]), g.one("Mod", ["position", w])], "topk_ids")


def _model(g: _Graph, cfg: ModelConfig) -> onnx.ModelProto:
    dims = {symbol: size(cfg) for symbol, size in SIZES.items()}
    types = {"prev_tokens": TensorProto.INT64, "src_mask": TensorProto.BOOL, "k": TensorProto.INT64,
             "topk_ids": TensorProto.INT64}

    def value(name: str, axes: list[str]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT),
                                             [SYMBOLS.get(a) or dims[a] for a in axes])

    return contract_model(g, "decoder_step_int8", DECODER_INPUTS, DECODER_OUTPUTS, value,
                          producer="nmt-serve export.graphs.int8_step")


def contract_model(g: _Graph, name: str, inputs: dict, outputs: dict, value, *, producer: str
                   ) -> onnx.ModelProto:
    """The checked model of graph ``g`` with the contract's inputs and outputs (``value`` gives
    each one's type and shape)."""
    graph = helper.make_graph(g.nodes, name, [value(n, a) for n, a in inputs.items()],
                              [value(n, a) for n, a in outputs.items()], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(CONTRIB_DOMAIN, 1)],
                              producer_name=producer)
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_int8_step(model: RNNSearch, target: Path) -> None:
    onnx.save(build_int8_step(model), str(target))


def product_floor(step: onnx.ModelProto) -> onnx.ModelProto:
    """The matrix-product floor of an int8 graph: only its ``MatMulIntegerToFloat`` nodes, each
    reading a uint8 graph input ``a<i>`` (rows, in_features) and writing ``y<i>``, with the same
    constant weights, scales, zero points and bias. Timed at the step's row count and threads,
    it is what the step would cost if everything around its products were free."""
    inits = {t.name: t for t in step.graph.initializer}
    nodes, inputs, outputs, kept = [], [], [], {}
    for i, node in enumerate(n for n in step.graph.node if n.op_type == "MatMulIntegerToFloat"):
        weight = inits[node.input[1]]
        inputs.append(helper.make_tensor_value_info(f"a{i}", TensorProto.UINT8, ["rows", weight.dims[0]]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["rows", weight.dims[1]]))
        for name in node.input[1:]:
            if name and name not in kept:
                kept[name] = inits[name]
        nodes.append(helper.make_node("MatMulIntegerToFloat", [f"a{i}", *node.input[1:]], [f"y{i}"],
                                      name=f"product_{i}", domain=CONTRIB_DOMAIN))
    graph = helper.make_graph(nodes, "product_floor", inputs, outputs, list(kept.values()))
    model = helper.make_model(graph, opset_imports=list(step.opset_import))
    model.ir_version = step.ir_version
    onnx.checker.check_model(model)
    return model
