"""Batch-invariant int8 graphs (``nmt export --quantize int8``): per-row activation scales.

ONNX Runtime's ``quantize_dynamic`` quantizes each activation with one scale
for the whole tensor (``DynamicQuantizeLinear``), so a row's result depends on
the other rows of its batch (measured: up to 2e-2 on log-probabilities), which
breaks "a sentence decoded alone and inside a padded batch gives the same
tokens". Weight-only ``MatMulNBits`` (8 bits) keeps rows independent to ~4e-6
but was only 1.2-1.35x faster than fp32 at 32 rows (accuracy level 4), and
slower than fp32 at the default level. So every matrix product with a constant
weight is rewritten here into standard ONNX ops:

- weights: int8, symmetric, one scale per output column, fixed at export,
  stored as uint8 around a zero point of 128 (``unsigned``): ONNX Runtime's
  u8 x s8 kernel for AVX2 without VNNI adds pairs of products in saturating
  16-bit lanes (``vpmaddubsw``), which wrecks these products (measured on an
  AVX2-only host: the u8 x s8 graphs of models/en-fr/1 gave encoder 0.53 and
  step 1.73 max |diff| vs PyTorch, tolerance 0.1 / 0.25); u8 x u8 products are
  exact int32 on every CPU (same host: 0.070 / 0.163, the figures u8 x s8 gives
  where it is exact, VNNI or AMX), for ~14% more product time there;
- activations: one scale per row (per vector along the last axis),
  ``max|x| / 127``, computed in the graph; uint8 around a zero point of 128;
- the int32 product (exact in any order) is scaled by the weight scales inside
  ONNX Runtime's ``MatMulIntegerToFloat`` (``com.microsoft``; A's scale is the
  constant 1), then ``* row_scale (+ bias)``: one pass over the output fewer
  than ``MatMulInteger -> Cast -> Mul``, which matters for the (rows, vocab)
  output layer (measured 4.94 -> 4.30 ms per step at 160 rows, 2 threads,
  bit-identical results).

A row's outputs depend only on that row: bit-identical alone or in any batch.
Embedding tables become int8 with one scale per token. Left in fp32: the
encoder's GRU op, products with a computed right-hand side (the attention
context) and matrix-vector products (attention ``v``: fewer than
``MIN_COLUMNS`` outputs, where quantizing costs more than it saves).

The row scale is applied by its own ``Mul``, never as ``MatMulIntegerToFloat``'s
``a_scale``: that input is one per-tensor scale, and ONNX Runtime gives wrong
results when it is given a per-row one (measured, through its fusion of
``MatMulInteger -> Cast -> Mul(Mul(a_scale, b_scale))``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

SCHEME = "int8-per-row"
"""Recorded in the manifest as ``graphs.int8.scheme``."""
QMAX = 127.0  # symmetric int8 range [-127, 127]
ZERO_POINT = 128  # uint8 activations: 128 + round(x / row_scale) lies in [1, 255]
TINY = 1e-30  # scale floor: an all-zero row (padding) quantizes to zeros, not NaN
MIN_COLUMNS = 8
REDUCE_AXES_AS_INPUT = 18  # opset from which ReduceMax takes its axes as an input
PREFIX = "int8/"  # names of everything added here
CONTRIB_DOMAIN = "com.microsoft"  # ONNX Runtime's operators (MatMulIntegerToFloat)
CONSTANTS = {"qmax": (QMAX, np.float32), "tiny": (TINY, np.float32), "one": (1.0, np.float32),
             "zero_point": (ZERO_POINT, np.uint8), "last_axis": ([-1], np.int64)}


def quantize_graph(source: Path, target: Path) -> None:
    """Write the int8 variant of the fp32 graph ``source`` to ``target``."""
    model = quantize_model(onnx.load(str(source)))
    onnx.checker.check_model(model)
    onnx.save(model, str(target))


def quantize_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite Gather/MatMul/Gemm nodes on constant 2-D tensors, in place."""
    graph = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    weights = {t.name: t for t in graph.initializer}
    added = [numpy_helper.from_array(np.array(v, dtype=t), PREFIX + k) for k, (v, t) in CONSTANTS.items()]
    rows: dict[str, tuple[str, str]] = {}  # activation -> (quantized, row scale), shared by its consumers
    nodes: list[NodeProto] = []
    for node in graph.node:
        if (table := embedding_table(node, weights)) is not None:
            nodes += gather_nodes(node, table, added)
        elif (found := matmul_weight(node, weights)) is not None:
            weight, bias = found
            if node.input[0] not in rows:
                quantize_nodes, rows[node.input[0]] = row_quantize_nodes(node.input[0], opset)
                nodes += quantize_nodes
            nodes += matmul_nodes(node, weight, bias, rows[node.input[0]], added)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    used = {name for n in nodes for name in n.input}
    kept = [t for t in [*graph.initializer, *added] if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return model


def embedding_table(node: NodeProto, weights: dict[str, TensorProto]) -> np.ndarray | None:
    """The (vocab_size, emb_size) table of an embedding lookup, else None."""
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    if node.op_type != "Gather" or axis != 0 or node.input[0] not in weights:
        return None
    table = numpy_helper.to_array(weights[node.input[0]])
    return table if table.ndim == 2 and table.dtype == np.float32 else None


def matmul_weight(node: NodeProto, weights: dict[str, TensorProto]) -> tuple[np.ndarray, str | None] | None:
    """(weight as (in_features, out_features), bias name) of a quantizable product, else None."""
    if node.op_type not in ("MatMul", "Gemm") or node.input[1] not in weights:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm" and (attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0
                                   or attrs.get("beta", 1.0) != 1.0):
        return None
    weight = numpy_helper.to_array(weights[node.input[1]])
    if weight.ndim != 2 or weight.dtype != np.float32:
        return None
    if attrs.get("transB", 0):
        weight = weight.T
    if weight.shape[1] < MIN_COLUMNS:
        return None
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    return weight, bias


def symmetric_int8(values: np.ndarray, *, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales, one scale per slice along ``axis`` (kept as size 1)."""
    scale = np.maximum(np.abs(values).max(axis=axis, keepdims=True), TINY) / QMAX
    quantized = np.clip(np.round(values / scale), -QMAX, QMAX).astype(np.int8)
    return quantized, scale.astype(np.float32)


def unsigned(quantized: np.ndarray) -> np.ndarray:
    """int8 weights as uint8 around ``ZERO_POINT``: products are then u8 x u8 (see the module doc)."""
    return (quantized.astype(np.int16) + ZERO_POINT).astype(np.uint8)


def row_quantize_nodes(x: str, opset: int) -> tuple[list[NodeProto], tuple[str, str]]:
    """x (..., in_features) float -> uint8 around 128 and its scale (..., 1), one per row:
    the nodes and the names of (quantized, scale)."""
    p = f"{PREFIX}{x}/"
    reduce = (helper.make_node("ReduceMax", [p + "abs", PREFIX + "last_axis"], [p + "max"], keepdims=1)
              if opset >= REDUCE_AXES_AS_INPUT else
              helper.make_node("ReduceMax", [p + "abs"], [p + "max"], axes=[-1], keepdims=1))
    return [helper.make_node("Abs", [x], [p + "abs"]), reduce,
            helper.make_node("Max", [p + "max", PREFIX + "tiny"], [p + "max_safe"]),
            helper.make_node("Div", [p + "max_safe", PREFIX + "qmax"], [p + "scale"]),  # (..., 1)
            helper.make_node("Div", [PREFIX + "one", p + "scale"], [p + "inverse"]),
            helper.make_node("Mul", [x, p + "inverse"], [p + "scaled"]),  # in [-127, 127]
            # scale 1 and zero point 128: round half to even, + 128, saturate to uint8
            helper.make_node("QuantizeLinear", [p + "scaled", PREFIX + "one", PREFIX + "zero_point"],
                             [p + "quantized"])], (p + "quantized", p + "scale")


def matmul_nodes(node: NodeProto, weight: np.ndarray, bias: str | None, row: tuple[str, str],
                 added: list[TensorProto]) -> list[NodeProto]:
    """int32 product of the quantized row and weights, scaled back to float (+ bias)."""
    quantized, scale = symmetric_int8(weight, axis=0)  # (in_features, out_features), (1, out_features)
    p, out = f"{PREFIX}{node.name or node.output[0]}/", node.output[0]
    added += [numpy_helper.from_array(unsigned(quantized), p + "weight"),
              numpy_helper.from_array(scale.reshape(-1), p + "weight_scale")]
    scaled = p + "row_scaled" if bias else out
    nodes = [helper.make_node("MatMulIntegerToFloat",  # int32 product * 1 * weight_scale, as float (u8 x u8)
                              [row[0], p + "weight", PREFIX + "one", p + "weight_scale", PREFIX + "zero_point",
                               PREFIX + "zero_point"],
                              [p + "column_scaled"], domain=CONTRIB_DOMAIN),
             helper.make_node("Mul", [p + "column_scaled", row[1]], [scaled])]
    if bias:
        nodes.append(helper.make_node("Add", [scaled, bias], [out]))
    return nodes


def gather_nodes(node: NodeProto, table: np.ndarray, added: list[TensorProto]) -> list[NodeProto]:
    """Embedding lookup in an int8 table with one scale per token."""
    quantized, scale = symmetric_int8(table, axis=1)  # (vocab_size, emb_size), (vocab_size, 1)
    p, out = f"{PREFIX}{node.name or node.output[0]}/", node.output[0]
    added += [numpy_helper.from_array(quantized, p + "table"), numpy_helper.from_array(scale, p + "scale")]
    return [helper.make_node("Gather", [p + "table", node.input[1]], [p + "int8"]),
            helper.make_node("Gather", [p + "scale", node.input[1]], [p + "row_scale"]),
            helper.make_node("Cast", [p + "int8"], [p + "float"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [p + "float", p + "row_scale"], [out])]
