"""The int8 encoder with its bidirectional GRU as our compiled kernel (``encoder.c``).

ONNX Runtime's ``GRU`` runs in fp32: every token's input projections, then the recurrence, a small
product per time step. The kernel reads the input projections from a table made once at load (every
source token's ``W x + Wb``, ``x`` as the graph's own embedding makes it, computed in fp32 and kept
as float16: no product per token), and runs the recurrence in int8: the state quantized per row (``max |h| / 127``), the
recurrent weights per output column, the products exact integer sums. The rest of the encoder (the
keys and the initial decoder state from the annotations, cut at ``annotations``) runs as a second kernel
(``encoder_rest.c``, ``rest_kernel``: real positions only, the keys the graph's bits as written) where the
CPU has AVX-512 VNNI (``fused_middle.products_offered``), else as the graph (one log line where refused).

At load (``load``) the fused encoder must agree with the graph on a known-answer batch within
``TOLERANCE`` and give each row alone the bits it gives it in a batch (which also covers what the
rewrite does not read from the graph: a zero initial state, the lengths from ``src_lengths``); else
the graph serves, with one log line. Measured (speed and BLEU) in ``docs/speed-round2.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from service.decoding import fused, fused_middle
from service.decoding.fused import _attention, beyond
from service.decoding.fused_graphs import ancestors, subgraph
from service.decoding.int8_form import source_vocabulary

OUTPUTS = ("annotations", "keys", "init_state")
# the graph against the fused encoder on the known-answer batch: the int8 recurrence's rounding
# (measured on en-fr/4's test split: docs/speed-round2.md)
TOLERANCE = {"annotations": 0.08, "keys": 0.5, "init_state": 0.08}


class FusedEncoder:
    """Runs like an ONNX Runtime session (``run(names, feed)``) on ``src_ids`` and ``src_lengths``."""

    def __init__(self, table: np.ndarray, recurrent: np.ndarray, bias_n: np.ndarray, rest: Any,
                 threads: int = 1, *, rest_kernel: Rest | None = None, rest_graph: onnx.ModelProto | None = None
                 ) -> None:
        """``table`` (V, 2, 3H) input projections with their biases (and ``Rb`` for z and r);
        ``recurrent`` (2, 3H, H) float32 ``R``; ``bias_n`` (2, H) ``Rb`` of the candidate; ``rest``:
        a session of ``rest_graph``, the graph from ``annotations`` to ``keys`` and ``init_state``
        (None where ``rest_kernel``, ``encoder_rest.c``'s constants, computes them)."""
        self.table = np.ascontiguousarray(table, np.float16).view(np.uint16)  # half the memory of float32
        self.rest, self.threads = rest, threads
        self.size = recurrent.shape[2]
        scale = np.abs(recurrent).max(axis=2) / 127.0  # (2, 3H), per output column
        scale[scale == 0] = 1.0
        quantized = np.rint(recurrent / scale[:, :, None]).astype(np.int16)  # (2, 3H, H)
        pairs = quantized.transpose(0, 2, 1).reshape(2, self.size // 2, 2, -1).transpose(0, 1, 3, 2)
        self.weights = np.ascontiguousarray(pairs).view(np.int32).reshape(2, self.size // 2, -1)
        quads = quantized.astype(np.int8).transpose(0, 2, 1).reshape(2, self.size // 4, 4, -1).transpose(0, 1, 3, 2)
        self.weights8 = np.ascontiguousarray(quads).view(np.int32).reshape(2, self.size // 4, -1)  # VNNI's u8 x s8
        self.colsum = (quantized.astype(np.int32).sum(axis=2) * 128).astype(np.int32)
        self.wscale = np.ascontiguousarray(scale, np.float32)
        self.bias_n = np.ascontiguousarray(bias_n, np.float32)
        self.rest_kernel, self.rest_graph = rest_kernel, rest_graph

    @classmethod
    def of(cls, encoder: onnx.ModelProto, load_graph: Callable[[bytes], Any], threads: int = 1) -> FusedEncoder:
        """From an encoder graph with one bidirectional ``GRU`` (linear_before_reset, zero initial
        state, lengths from ``src_lengths``) whose outputs read ``annotations`` only; ValueError else."""
        graph = encoder.graph
        grus = [n for n in graph.node if n.op_type == "GRU"]
        if len(grus) != 1:
            raise ValueError(f"{len(grus)} GRU nodes (one expected)")
        gru = grus[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in gru.attribute}
        if attrs.get("direction") != b"bidirectional" or attrs.get("linear_before_reset") != 1 or \
                set(attrs) - {"direction", "linear_before_reset", "hidden_size"} or len(gru.input) < 5:
            raise ValueError(f"the GRU is not bidirectional with linear_before_reset and default activations ({attrs})")
        inits = {t.name: t for t in graph.initializer}
        if not all(name in inits for name in gru.input[1:4]):
            raise ValueError("the GRU's weights are not constants")
        w, r, b = (numpy_helper.to_array(inits[name]).astype(np.float32) for name in gru.input[1:4])
        size = r.shape[2]
        embed = subgraph(encoder, [n for n in graph.node if n.output[0] in ancestors(graph, gru.input[0])],
                         ["src_ids", "src_lengths"], [gru.input[0]], "fused_embedding",
                         {gru.input[0]: ["src_len", "batch", "emb_size"]})
        vocabulary = source_vocabulary(encoder)
        x = load_graph(embed.SerializeToString()).run(None, {
            "src_ids": np.arange(vocabulary, dtype=np.int64)[None], "src_lengths": np.array([vocabulary])})[0]
        x = x.reshape(vocabulary, -1)  # (V, E): one text of every token, in order
        bias = b[:, :3 * size].copy()
        bias[:, :2 * size] += b[:, 3 * size:5 * size]  # Rb of z and r add to the input's
        table = np.stack([x @ w[d].T + bias[d] for d in range(2)], axis=1)
        rest_nodes = [n for n in graph.node if n.output[0] not in ancestors(graph, "annotations")]
        outputs = [o.name for o in graph.output if o.name != "annotations"]
        rest = subgraph(encoder, rest_nodes, ["annotations"], outputs, "fused_encoder_rest")
        kernel = None
        if fused_middle.products_offered() is None:  # the rest by encoder_rest.c where its products serve
            try:
                kernel = rest_kernel(rest)
            except ValueError as e:
                fused.log.info("compiled encoder rest refused (%s): it runs on ONNX Runtime's operators", e)
        return cls(table, r, b[:, 5 * size:], None if kernel else load_graph(rest.SerializeToString()), threads,
                   rest_kernel=kernel, rest_graph=rest)

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        ids = np.ascontiguousarray(feed["src_ids"], np.int64)
        lengths = np.ascontiguousarray(feed["src_lengths"], np.int64)
        annotations = np.empty((*ids.shape, 2 * self.size), np.float32)
        _attention.gru_encode(self.table, ids, lengths, self.weights, self.weights8, self.colsum, self.wscale,
                              self.bias_n, annotations, self.threads)
        if self.rest_kernel is not None:
            rest = self.rest_kernel
            keys = np.empty((*ids.shape, rest.keys[4]), np.float32)
            init_state = np.empty((len(ids), rest.init[4]), np.float32)
            _attention.encoder_rest([annotations, lengths, *rest.keys[:4], *rest.init[:4], keys, init_state],
                                    (rest.qmax, rest.tiny), rest.offset, self.threads)
        else:
            keys, init_state = self.rest.run(["keys", "init_state"], {"annotations": annotations})
        found = {"annotations": annotations, "keys": keys, "init_state": init_state}
        return [found[n] for n in (names or OUTPUTS)]


# the rest graph's operators but its constants, in order: the initial state's product, then the keys'
ROW_PRODUCT = ("Abs", "ReduceMax", "Max", "Div", "Div", "Mul", "QuantizeLinear", "MatMulIntegerToFloat", "Mul", "Add")
REST_OPS = ("Gather", "Slice", *ROW_PRODUCT, "Tanh", *ROW_PRODUCT)


@dataclass(frozen=True)
class Rest:
    """``encoder_rest.c``'s constants: the keys' and the initial state's products (``fused_middle.product_constants``:
    panels, colsum, mult, bias, width), the row quantizer's ``qmax`` and ``tiny``, and where the initial
    state's input starts in an annotation (``offset``)."""

    keys: tuple
    init: tuple
    qmax: float
    tiny: float
    offset: int


def rest_kernel(rest: onnx.ModelProto) -> Rest:
    """``Rest`` of the encoder's rest graph (annotations -> keys, init_state): ValueError for another shape."""
    graph = rest.graph
    nodes = [n for n in graph.node if n.op_type != "Constant"]
    if tuple(n.op_type for n in nodes) != REST_OPS or sorted(o.name for o in graph.output) != ["init_state", "keys"]:
        raise ValueError("the rest graph is not the keys' and the initial state's row-quantized products")
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(helper.get_attribute_value(n.attribute[0]))
                      for n in graph.node if n.op_type == "Constant" and len(n.attribute) == 1})
    value = lambda name: constants[name] if name in constants else fused_middle.missing(name)  # noqa: E731
    gather, cut = nodes[0], nodes[1]
    starts, ends, axes, *steps = (value(name).reshape(-1) for name in cut.input[1:])
    if value(gather.input[1]).size != 1 or int(value(gather.input[1])) != 0 or \
            helper.get_attribute_value(gather.attribute[0]) != 1 or list(axes) != [1] or \
            any(list(step) != [1] for step in steps) or ends[0] < 2**31:
        raise ValueError("the initial state does not read the annotations' first position from an offset to the end")
    products = []
    for first, source, out in ((2, cut.output[0], "init_state"), (13, "annotations", "keys")):
        ops = nodes[first:first + len(ROW_PRODUCT)]
        scalars = [float(value(ops[i].input[j])) for i, j in ((2, 1), (3, 1), (4, 0), (6, 1))]  # tiny, qmax, one, one
        zero, add = int(value(ops[6].input[2])), ops[9]
        bias = value(add.input[0] if add.input[1] == ops[8].output[0] else add.input[1])
        if ops[0].input[0] != source or ops[5].input[0] != source or scalars[2:] != [1.0, 1.0] or zero != 128 or \
                {a.name: helper.get_attribute_value(a) for a in ops[1].attribute} != {"axes": [-1], "keepdims": 1}:
            raise ValueError(f"{out}'s input is not quantized per row around 128")
        panels, colsum, mult, _, width = fused_middle.product_constants(ops[7], value)
        padded = np.zeros(len(mult), np.float32)
        padded[:width] = bias.reshape(-1)
        products.append(((panels, colsum, mult, padded, width), scalars[:2]))
    (init, (tiny, qmax)), (keys, same) = products
    if same != [tiny, qmax]:
        raise ValueError("the keys and the initial state quantize with other constants")
    if any(size % 16 for size in (keys[4], init[4], 4 * keys[0].shape[1], 4 * init[0].shape[1])):
        raise ValueError("the keys, the initial state or their inputs are not a multiple of 16 wide")
    return Rest(keys=keys, init=init, qmax=qmax, tiny=tiny, offset=int(starts[0]))


def check(reference: Callable, encoder: FusedEncoder, feed: Mapping[str, np.ndarray]) -> str | None:
    """None when ``encoder`` agrees with the graph (``reference``: feed -> its outputs) within ``TOLERANCE``
    on ``feed`` and gives its first and last rows alone the bits it gives them in the batch."""
    whole = encoder.run(OUTPUTS, feed)
    if (problem := beyond(OUTPUTS, reference(feed), whole, TOLERANCE)) is not None:
        return problem
    for row in (0, len(feed["src_lengths"]) - 1):
        length = int(feed["src_lengths"][row])
        alone = encoder.run(OUTPUTS, {"src_ids": feed["src_ids"][row:row + 1, :length],
                                    "src_lengths": feed["src_lengths"][row:row + 1]})
        for name, a, b in zip(OUTPUTS, whole, alone):
            if not np.array_equal(a[row:row + 1, :length] if a.ndim == 3 else a[row:row + 1], b):
                return f"row {row} alone: {name} is not the bits it has in the batch"
    return None


def load(encoder: onnx.ModelProto, load_graph: Callable[[bytes], Any], reference: Callable,
         feed: Mapping[str, np.ndarray], threads: int = 1) -> FusedEncoder | None:
    """The fused form of ``encoder`` if the kernel is there and ``check`` accepts it on ``feed``
    (``reference``: feed -> the graph's outputs), else None with one log line. ``load_graph``:
    graph bytes -> an ONNX Runtime session."""
    return fused.checked("fused encoder", "the encoder", lambda: FusedEncoder.of(encoder, load_graph, threads),
                         lambda built: check(reference, built, feed))
