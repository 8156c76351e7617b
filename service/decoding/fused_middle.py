"""The int8 step's middle as one compiled kernel (``middle.c``) instead of an ONNX Runtime run.

With the per-row shortlist (``service.decoding.shortlist_rows``) the fused step runs, between the
attention kernel and the shortlist kernel, a *middle graph* of about thirty operators: the context
quantized, the input product, the GRU cell, the deep output's product and maxout quantized per row,
the always-words' product and the next step's state product. At 44 rows on the Zen 4 its four
products took 0.71 ms of its 0.88 (``docs/speed-round2.md``); the rest was glue, one operator and
one pass at a time. ``middle.c`` computes the whole graph per row in one call: its products as ONNX
Runtime's (the same integer sums, ``acc * mult + bias`` in two roundings: the same bits), the GRU's
sigmoid and tanh its own.

``MiddleKernel.of`` reads the constants from the middle graph and raises ValueError for a graph of
another shape (its operators are checked in order; the known-answer check at load covers the
arithmetic). It runs like the middle graph's session. Offered where the CPU has AVX-512 VNNI (the
products' fast exact form, the only one measured against ONNX Runtime's); elsewhere the graph runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from service.decoding.fused import _attention
from service.decoding.fused_graphs import ALWAYS, CONTEXT, NEXT_PRODUCT, OUTPUT_INPUT, PRODUCT, SCALE

INPUTS = ("prev_tokens", "state", PRODUCT, CONTEXT)
OUTPUTS = ("next_state", OUTPUT_INPUT, SCALE, ALWAYS, NEXT_PRODUCT)
# the middle graph's operators, in order (export/graphs/int8_step.py cut by service.decoding.fused_graphs)
OPS = ("Split", "Gather", "QuantizeLinear", "Concat", "MatMulIntegerToFloat", "Split", "Add", "Sigmoid", "Split",
       "Mul", "Add", "Tanh", "Sub", "Mul", "Add", "QuantizeLinear", "MatMulIntegerToFloat", "Add", "Reshape",
       "ReduceMax", "Abs", "ReduceMax", "Max", "Div", "Mul", "QuantizeLinear", "Mul", "MatMulIntegerToFloat",
       "QuantizeLinear", "MatMulIntegerToFloat")
VNNI = 2  # middle.c's form with AVX-512 VNNI


def products_offered() -> str | None:
    """None where ``middle.c``'s int8 products serve here (AVX-512 VNNI; the encoder's rest uses them too),
    else why not."""
    if _attention is None:
        return "the compiled kernels are missing"
    if _attention.gru_form() != "avx512-vnni":
        return f"this CPU's int8 products are {_attention.gru_form()}, not AVX-512 VNNI"
    return None


def offered() -> str | None:
    """None where the compiled middle serves here, else why not (benchmarks and tests replace it to build an
    engine with the graph's middle beside one with the kernel)."""
    return products_offered()


@dataclass(frozen=True)
class Named:
    name: str


def panels(weight: np.ndarray, zero: int) -> np.ndarray:
    """``weight`` (K, J) less its zero point as s8, in ``middle.c``'s panels (ceil(J / 64), K / 4, 64) of quads."""
    w = weight.astype(np.int16) - zero
    if w.min() < -128 or w.max() > 127 or w.shape[0] % 4:
        raise ValueError(f"a weight {weight.shape} is not s8 around its zero point with rows a multiple of 4")
    K, J = w.shape
    padded = np.zeros((K, -(-J // 64) * 64), np.int8)
    padded[:, :J] = w
    quads = np.ascontiguousarray(padded.reshape(K // 4, 4, -1, 64).transpose(2, 0, 3, 1))
    return quads.view(np.int32).reshape(quads.shape[:3])


class MiddleKernel:
    """The middle graph's constants for ``middle.c``; ``run(names, feed)`` as its session."""

    def __init__(self, emb: np.ndarray, products: Sequence[tuple], scalars: tuple[float, ...], threads: int = 1,
                 form: int = -1) -> None:
        self.emb, self.products, self.scalars, self.threads, self.form = emb, list(products), scalars, threads, form
        self._constants = [emb, *(a for p in products for a in p[:4])]  # the kernel's arguments every step shares

    @classmethod
    def of(cls, middle: onnx.ModelProto, threads: int = 1, form: int = -1) -> MiddleKernel:
        nodes = list(middle.graph.node)
        if tuple(n.op_type for n in nodes) != OPS:
            raise ValueError("the middle graph is not the int8 step's GRU and deep output")
        inits = {t.name: numpy_helper.to_array(t) for t in middle.graph.initializer}
        value = lambda name: inits[name] if name in inits else missing(name)  # noqa: E731
        split_state, gather, quantize = nodes[0], nodes[1], nodes[2]
        emb = value(gather.input[0])
        unit, zero = (float(value(quantize.input[1])), int(value(quantize.input[2])))
        same_quantizer = all(nodes[i].input[1:] == quantize.input[1:] for i in (15, 28))
        if emb.dtype != np.uint8 or emb.shape[1] % 4 or zero != 128 or not same_quantizer:
            raise ValueError("the embedding is not u8 quads, or the quantizers are not one scale around 128")
        H, O = int(value(split_state.input[1])[-1]), len(value(nodes[16].input[3]).reshape(-1))
        if list(value(nodes[5].input[1])) != [2 * H, H, O] or \
                list(value(nodes[8].input[1])) != [H, H] or list(value(nodes[18].input[1]))[1:] != [2, O // 2] or \
                _attributes(nodes[19]) != {"axes": [1], "keepdims": 0}:
            raise ValueError("the gates and the deep output do not split as 2H, H, O and O's halves")
        out_q = nodes[25]
        if float(value(out_q.input[1])) != 1.0 or int(value(out_q.input[2])) != 128:
            raise ValueError("the output layer's input is not quantized by 1 around 128")
        products = [product_constants(n, value) for n in (nodes[4], nodes[16], nodes[27], nodes[29])]
        qmax, tiny, inv_qmax = (float(value(nodes[i].input[j])) for i, j in ((23, 0), (22, 1), (26, 1)))
        return cls(np.ascontiguousarray(emb).view(np.int32), products, (unit, qmax, tiny, inv_qmax), threads, form)

    def get_inputs(self) -> list[Named]:
        return [Named(n) for n in INPUTS]

    def get_outputs(self) -> list[Named]:
        return [Named(n) for n in OUTPUTS]

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        state = np.ascontiguousarray(feed["state"], np.float32)
        rows, (_, so, words, nxt) = len(state), self.products
        out = {"next_state": np.empty_like(state), OUTPUT_INPUT: np.empty((rows, so[4] // 2), np.uint8),
               SCALE: np.empty((rows, 1), np.float32), ALWAYS: np.empty((rows, words[4]), np.float32),
               NEXT_PRODUCT: np.empty((rows, nxt[4]), np.float32)}
        arrays = [np.ascontiguousarray(feed["prev_tokens"], np.int64), state,
                  *(np.ascontiguousarray(feed[n], np.float32) for n in (PRODUCT, CONTEXT)), *self._constants,
                  *(out[n].view(np.int32) if n == OUTPUT_INPUT else out[n] for n in OUTPUTS)]
        _attention.middle(arrays, self.scalars, self.threads, self.form)
        return [out[n] for n in (names or OUTPUTS)]


class QueryKernel:
    """The query graph (``fused_graphs.split_step``: the state's ``QuantizeLinear`` and product) run by ``query.c``
    on the middle kernel's next product: the same weights (``with_next_product`` copied them from this graph) in
    the panels the middle reads every step. It runs at joins (the new texts' first states), where ONNX Runtime's
    own prepacked copy is cold: 189 us for 4 rows in a steady-state engine loop against 39 us run alone
    [avx2 avx512_vnni] (``docs/speed-round2.md``). ``run(names, feed)`` as the query graph's session."""

    def __init__(self, middle: MiddleKernel) -> None:
        self.middle, self.product = middle, middle.products[3]

    @classmethod
    def of(cls, query: onnx.ModelProto, middle: MiddleKernel) -> QueryKernel:
        """ValueError unless ``query`` is the middle's next product on its own input (quantizer and constants)."""
        nodes = list(query.graph.node)
        if tuple(n.op_type for n in nodes) != ("QuantizeLinear", "MatMulIntegerToFloat"):
            raise ValueError("the query graph is not a state's quantizer and product")
        inits = {t.name: numpy_helper.to_array(t) for t in query.graph.initializer}
        value = lambda name: inits[name] if name in inits else missing(name)  # noqa: E731
        quantizer = (float(value(nodes[0].input[1])), int(value(nodes[0].input[2])))
        theirs, ours = product_constants(nodes[1], value), middle.products[3]
        same = quantizer == (middle.scalars[0], 128) and theirs[4] == ours[4] and all(
            (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
            for a, b in zip(theirs[:4], ours[:4]))
        if not same:
            raise ValueError("the query graph's quantizer or product is not the middle's next product")
        return cls(middle)

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        state = np.ascontiguousarray(feed["state"], np.float32)
        out = np.empty((len(state), self.product[4]), np.float32)
        _attention.state_product((state, *self.product[:4], out), self.middle.scalars[0], self.middle.threads,
                                 self.middle.form)
        return [out]


def product_constants(node: onnx.NodeProto, value: Any) -> tuple:
    """(panels, colsum, mult, bias or None, output width) of a ``MatMulIntegerToFloat`` with constant weights."""
    weight, a_scale, b_scale, a_zero, b_zero = (value(name) for name in node.input[1:6])
    if a_scale.size != 1 or a_zero.size != 1 or b_zero.size != 1 or int(a_zero.reshape(-1)[0]) != 128:
        raise ValueError(f"the product {node.name or node.output[0]} has per-row scales or an A zero point but 128")
    w = panels(weight, int(b_zero.reshape(-1)[0]))
    J, width = weight.shape[1], w.shape[0] * 64
    signed = weight.astype(np.int32) - int(b_zero.reshape(-1)[0])
    colsum = np.zeros(width, np.int32)
    colsum[:J] = 128 * signed.sum(axis=0)
    mult = np.zeros(width, np.float32)
    mult[:J] = np.float32(a_scale.reshape(-1)[0]) * np.broadcast_to(b_scale.reshape(-1).astype(np.float32), (J,))
    bias = None
    if len(node.input) > 6 and node.input[6]:
        bias = np.zeros(width, np.float32)
        bias[:J] = value(node.input[6]).reshape(-1)
    return w, colsum, mult, bias, J


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def missing(name: str) -> Any:
    """``value``'s answer for a name that is not a constant: ValueError."""
    raise ValueError(f"{name} is not a constant of the graph")
