"""The int8 encoder with its bidirectional GRU as our compiled kernel (``encoder.c``).

ONNX Runtime's ``GRU`` runs in fp32: every token's input projections, then the recurrence, a small
product per time step. The kernel reads the input projections from a table made once at load (every
source token's ``W x + Wb``, ``x`` as the graph's own embedding makes it, computed in fp32 and kept
as float16: no product per token), and runs the recurrence in int8: the state quantized per row (``max |h| / 127``), the
recurrent weights per output column, the products exact integer sums. The rest of the encoder (the
keys and the initial decoder state from the annotations) stays the graph's, cut at ``annotations``.

At load (``load``) the fused encoder must agree with the graph on a known-answer batch within
``TOLERANCE`` and give each row alone the bits it gives it in a batch (which also covers what the
rewrite does not read from the graph: a zero initial state, the lengths from ``src_lengths``); else
the graph serves, with one log line. Measured (speed and BLEU) in ``docs/speed-round2.md``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from service.decoding import fused
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
                 threads: int = 1) -> None:
        """``table`` (V, 2, 3H) input projections with their biases (and ``Rb`` for z and r);
        ``recurrent`` (2, 3H, H) float32 ``R``; ``bias_n`` (2, H) ``Rb`` of the candidate; ``rest``:
        a session of the graph from ``annotations`` to ``keys`` and ``init_state``."""
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
        return cls(table, r, b[:, 5 * size:], load_graph(rest.SerializeToString()), threads)

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        ids = np.ascontiguousarray(feed["src_ids"], np.int64)
        lengths = np.ascontiguousarray(feed["src_lengths"], np.int64)
        annotations = np.empty((*ids.shape, 2 * self.size), np.float32)
        _attention.gru_encode(self.table, ids, lengths, self.weights, self.weights8, self.colsum, self.wscale,
                              self.bias_n, annotations, self.threads)
        keys, init_state = self.rest.run(["keys", "init_state"], {"annotations": annotations})
        found = {"annotations": annotations, "keys": keys, "init_state": init_state}
        return [found[n] for n in (names or OUTPUTS)]


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
