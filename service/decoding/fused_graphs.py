"""The cuts of the int8 step graph around the fused kernels (``service.decoding.fused``).

``split_step`` cuts at the attention: the *query graph* (the state's product, whose first A
columns are the query) and the *rest graph* (everything after the attention, reading the product
and the context as inputs). ``split_output`` cuts the rest graph again before its output layer's
bias, log-softmax and top-k: the *middle graph* ends at the output product and each row's scale.
Each raises ValueError for a graph of another shape (the step then stays as it is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from service.decoding.packed import attention_chain

PRODUCT, CONTEXT = "fused/state_product", "fused/context"
RAW, SCALE = "fused/output_product", "fused/output_scale"  # the middle graph's outputs
OUTPUT_INPUT = "fused/output_input"  # or, cut before the product (``split_output(at_product=True)``), its uint8 input
NEXT_PRODUCT = "fused/next_state_product"  # and the next step's state product (``with_next_product``)
ALWAYS = "fused/always_product"  # the always-words' product of the per-row shortlist's middle graph (rows, F)
SHAPES = {PRODUCT: ["rows", "product"], CONTEXT: ["rows", "ctx_size"], RAW: ["rows", "vocab_size"], SCALE: ["rows", 1],
          NEXT_PRODUCT: ["rows", "product"], OUTPUT_INPUT: ["rows", "out_size"]}

_CHAIN = ("Add", "Tanh", "Reshape", "Gemm", "Reshape", "Where", "Softmax", "Unsqueeze", "MatMul", "Reshape")


def split_step(step: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto, np.ndarray]:
    """(query graph, rest graph, v) of an int8 step graph; ValueError for a graph whose attention
    is not the chain keys + Split(product)[0] -> Tanh -> Gemm (``v``) -> Where -> Softmax ->
    MatMul (annotations)."""
    step, original = onnx.ModelProto(), step
    step.CopyFrom(original)  # the rest graph's nodes are renamed in place
    graph = step.graph
    chain = attention_chain(graph, _CHAIN)
    add, gemm, where, softmax, matmul = chain[0], chain[3], chain[5], chain[6], chain[8]
    if softmax.output[0] != "attention" or "annotations" not in matmul.input or "src_mask" not in where.input:
        raise ValueError("the chain does not end in the 'attention' output and a product with 'annotations'")
    inits = {t.name: t for t in graph.initializer}
    unsqueeze = next((n for n in graph.node if n.output[0] in add.input and n.op_type == "Unsqueeze"), None)
    split = next((n for n in graph.node if unsqueeze is not None and unsqueeze.input[0] == n.output[0]), None)
    if split is None or split.op_type != "Split" or len(split.input) < 2 or split.input[1] not in inits:
        raise ValueError("the query is not the first output of a Split with constant sizes")
    v = numpy_helper.to_array(inits[gemm.input[0]]).reshape(-1) if gemm.input[0] in inits else None
    sizes = numpy_helper.to_array(inits[split.input[1]])
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    if v is None or axis not in (1, -1) or int(sizes[0]) != v.size or v.size % 16:
        raise ValueError("the query is not the product's first A columns, or v is not a constant of A (a "
                         "multiple of 16) floats")
    product = split.input[0]
    before = ancestors(graph, product)
    gone = before | {n.output[0] for n in chain} | {unsqueeze.output[0]}
    gone |= {n.output[0] for n in graph.node if n.op_type == "Shape" and n.output[0] in chain[4].input}
    query = subgraph(step, [n for n in graph.node if n.output[0] in before], ["state"], [product], "fused_query")
    rest_nodes = [n for n in graph.node if n.output[0] not in gone]
    rename = {product: PRODUCT, chain[-1].output[0]: CONTEXT}
    for node in rest_nodes:
        node.input[:] = [rename.get(i, i) for i in node.input]
    kept_inputs = [i.name for i in graph.input if i.name not in ("keys", "annotations", "src_mask")]
    outputs = [o.name for o in graph.output if o.name != "attention"]
    rest = subgraph(step, rest_nodes, kept_inputs + [PRODUCT, CONTEXT], outputs, "fused_rest")
    return query, rest, v.astype(np.float32)


def split_output(rest: onnx.ModelProto, *, at_product: bool = False) -> tuple[onnx.ModelProto, Any]:
    """(middle graph, bias) of a rest graph (``split_step``) whose ``log_probs`` is LogSoftmax(Mul(
    MatMulIntegerToFloat, scale) + bias) with a constant bias, and whose top-k reads only that: the
    middle graph outputs ``next_state``, ``RAW`` (the product) and ``SCALE`` (rows, 1); ValueError else.
    ``at_product``: the middle graph ends before the product, outputs ``next_state``, ``OUTPUT_INPUT``
    (its uint8 input) and ``SCALE``, and the second item is the ``ProductLayer``."""
    model = onnx.ModelProto()
    model.CopyFrom(rest)
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    softmax = producer.get("log_probs")
    add = producer.get(softmax.input[0]) if softmax is not None and softmax.op_type == "LogSoftmax" else None
    if add is None or add.op_type != "Add" or add.input[1] not in inits:
        raise ValueError("log_probs is not LogSoftmax(x + a constant bias)")
    mul = producer.get(add.input[0])
    product = producer.get(mul.input[0]) if mul is not None and mul.op_type == "Mul" else None
    if product is None or product.op_type != "MatMulIntegerToFloat":
        raise ValueError("the output layer's logits are not an int8 product times a scale")
    bias = numpy_helper.to_array(inits[add.input[1]]).reshape(-1).astype(np.float32)
    ends = [product.input[0]] if at_product else [mul.input[0]]
    keep = ancestors(graph, "next_state") | ancestors(graph, ends[0]) | ancestors(graph, mul.input[1])
    tail = [n for n in graph.node if n.output[0] not in keep]
    outside = {o.name for o in graph.output} - {"log_probs", "topk_log_probs", "topk_ids"}
    if any(set(n.output) & outside for n in tail):
        raise ValueError("the output layer's nodes make other outputs")
    out = OUTPUT_INPUT if at_product else RAW
    rename = {ends[0]: out, mul.input[1]: SCALE}
    nodes = [n for n in graph.node if n.output[0] in keep]
    for node in nodes:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, i) for i in node.input]
    used = {i for n in nodes for i in n.input}
    inputs = [i.name for i in graph.input if i.name in used]
    middle = subgraph(model, nodes, inputs, ["next_state", out, SCALE], "fused_middle",
                      types={OUTPUT_INPUT: onnx.TensorProto.UINT8})
    return middle, (ProductLayer.of(product, inits, bias) if at_product else bias)


@dataclass(frozen=True)
class ProductLayer:
    """The output layer's product and bias for ``shortlist_layer.c``: word c's weights as a row of s8
    (``w``, (V, O / 4) quads as int32), 128 x their sum (``wsum``), the product's scale (``wscale``: A
    scale x column scale, as ``MatMulIntegerToFloat`` computes it) and the bias, (V,) each; and the
    product's constants as the graph has them (``stored``: its inputs 1 to 5), to make it for some words."""

    w: np.ndarray
    wsum: np.ndarray
    wscale: np.ndarray
    bias: np.ndarray
    stored: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, product: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto], bias: np.ndarray) -> ProductLayer:
        """ValueError unless the product reads constant weights, scales and zero points (A's 128), no bias,
        and its input size is a multiple of 4."""
        names = list(product.input)
        if len(names) != 6 or not all(n in inits for n in names[1:]):
            raise ValueError("the output product's weight, scales and zero points are not constants (or it has a bias)")
        stored = tuple(numpy_helper.to_array(inits[n]) for n in names[1:])
        weight, a_scale, b_scale, a_zero, b_zero = stored
        if a_scale.size != 1 or a_zero.size != 1 or b_zero.size != 1 or int(a_zero.reshape(-1)[0]) != 128:
            raise ValueError("the output product has per-column zero points or an A zero point other than 128")
        w = (weight.astype(np.int16) - int(b_zero.reshape(-1)[0])).T  # (V, O)
        if weight.ndim != 2 or w.shape[1] % 4 or w.min() < -128 or w.max() > 127:
            raise ValueError(f"the output product's weight {weight.shape} is not s8 with a size a multiple of 4")
        w8 = np.ascontiguousarray(w.astype(np.int8))
        return cls(w=w8.view(np.int32), wsum=(128 * w.sum(axis=1)).astype(np.int32),
                   wscale=(np.float32(a_scale.reshape(-1)[0]) * b_scale.reshape(-1).astype(np.float32)).astype(np.float32),
                   bias=bias, stored=stored)

    def with_product(self, middle: onnx.ModelProto, words: np.ndarray, output: str) -> onnx.ModelProto:
        """``middle`` (ending in ``OUTPUT_INPUT``) also making the product for ``words`` alone (the same
        operator and constants, their columns): ``output`` (rows, len(words)), the full product's bits there."""
        model = onnx.ModelProto()
        model.CopyFrom(middle)
        weight, a_scale, b_scale, a_zero, b_zero = self.stored
        columns = {"weight": weight[:, words], "a_scale": a_scale, "b_scale": b_scale.reshape(-1)[words],
                   "a_zero": a_zero, "b_zero": b_zero}
        names = [f"fused/words/{n}" for n in columns]
        model.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), n)
                                       for n, v in zip(names, columns.values()))
        model.graph.node.append(helper.make_node("MatMulIntegerToFloat", [OUTPUT_INPUT, *names], [output],
                                                 domain="com.microsoft", name="fused/words/product"))
        model.graph.output.append(helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, ["rows", "words"]))
        return model


def with_next_product(middle: onnx.ModelProto, query: onnx.ModelProto) -> onnx.ModelProto:
    """``middle`` also computing the query graph's product of ``next_state`` (output ``NEXT_PRODUCT``):
    the next step's product, made in this step's run instead of a run of its own (the same nodes and
    weights, so the same bits: ``service.decoding.fused`` checks it at load)."""
    model = onnx.ModelProto()
    model.CopyFrom(middle)
    graph = model.graph
    made = {o for n in query.graph.node for o in n.output}
    (product,) = [o.name for o in query.graph.output]
    rename = {"state": "next_state", **{t: f"fused/next/{t}" for t in made}, product: NEXT_PRODUCT}
    for node in query.graph.node:
        copy = graph.node.add()
        copy.CopyFrom(node)
        copy.name = f"fused/next/{node.name}" if node.name else ""
        copy.input[:] = [rename.get(i, i) for i in node.input]
        copy.output[:] = [rename.get(o, o) for o in node.output]
    have = {t.name for t in graph.initializer}
    graph.initializer.extend(t for t in query.graph.initializer if t.name not in have)
    graph.output.append(helper.make_tensor_value_info(NEXT_PRODUCT, onnx.TensorProto.FLOAT, SHAPES[NEXT_PRODUCT]))
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise ValueError(f"the middle graph with the next product does not check: {str(e)[:200]}") from None
    return model


def ancestors(graph: onnx.GraphProto, name: str) -> set[str]:
    """The nodes ``name`` depends on, by their first output."""
    producer = {o: n for n in graph.node for o in n.output}
    found: set[str] = set()
    todo = [name]
    while todo:
        node = producer.get(todo.pop())
        if node is not None and node.output[0] not in found:
            found.add(node.output[0])
            todo.extend(node.input)
    return found


def subgraph(step: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], inputs: list[str], outputs: list[str],
             name: str, shapes: Mapping[str, list] | None = None, types: Mapping[str, int] | None = None
             ) -> onnx.ModelProto:
    """A graph of ``nodes`` of ``step``; inputs and outputs named, their types from ``step`` or, for
    the cuts' own tensors, ``shapes`` or ``SHAPES`` (float32 unless ``types`` says)."""
    graph = step.graph
    used = {i for n in nodes for i in n.input}
    values = {v.name: v for v in [*graph.input, *graph.output]}
    declared = [values.get(n) or helper.make_tensor_value_info(n, (types or {}).get(n, onnx.TensorProto.FLOAT),
                                                             (shapes or SHAPES).get(n, ["rows", "product"]))
                for n in [*inputs, *outputs]]
    sub = helper.make_graph(list(nodes), name, declared[:len(inputs)], declared[len(inputs):],
                            [t for t in graph.initializer if t.name in used])
    model = helper.make_model(sub, opset_imports=list(step.opset_import), ir_version=step.ir_version)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:  # a node cut away had another reader
        raise ValueError(f"the {name} graph does not check: {str(e)[:200]}") from None
    return model


