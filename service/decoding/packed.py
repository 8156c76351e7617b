"""Packed attention: the int8 step's scores over real source positions only, not the padding.

A running batch pads every row's context to its widest source (``layout.width``),
and at saturation most of it is padding: busy batches of 128 rows drawn from the
test split (texts stay about as many steps as they are long) have 20 to 34 % of
their columns real (``loadtest/results/bench_packed_xeon.md``). The additive
attention's score ``v^T tanh(keys + W s)`` makes three passes over rows x
columns x 512 floats (add, tanh, ``v``), about half of the step. This rewrite,
done once in memory at load like the int8 form (``service.decoding.int8_form``),
computes the score at the positions each row reads and no others:

- ``key_index`` (packed,): positions in the flattened keys (rows x src_len, A);
  each row's run rounded up to a multiple of ``layout.WIDTH_MULTIPLE`` (the extra
  positions are masked), so that every score column sits at the same place within
  a group of 4 as in the padded graph (the ``Gemm``'s columns in a tail group are
  computed differently; see ``layout.width``);
- ``key_rows`` (packed,): the row of each position (which query it adds);
- ``score_index`` (rows, src_len): where each (row, column)'s score lies in the
  packed scores, or ``packed`` for a masked column, which reads ``NEG_LARGE``.

keys (rows x src_len, A) --Gather key_index--> + Gather(query, key_rows) -> tanh ->
``v`` Gemm -> (packed,) ++ [NEG_LARGE] --Gather score_index--> (rows, src_len) ->
the graph's own softmax and context. Every packed score is computed by the same
nodes on the same values as the padded graph's, so the outputs are the same bits
(``tests/test_packed_attention.py``). The indices change only with the batch's
layout (``Runtime.context``), not every step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.decoding.int8_form import known_answer as same_bits
from service.decoding.layout import WIDTH_MULTIPLE
from service.errors import ModelRepositoryError

log = logging.getLogger("nmt.packed")

INPUTS = {"key_index": ["packed"], "key_rows": ["packed"], "score_index": ["rows", "src_len"]}
_CHAIN = ("Add", "Tanh", "Reshape", "Gemm", "Reshape", "Where", "Softmax")


def _consumer(graph: onnx.GraphProto, name: str) -> onnx.NodeProto:
    users = [n for n in graph.node if name in n.input]
    if len(users) != 1:
        raise ValueError(f"{name!r} has {len(users)} readers, not one")
    return users[0]


def attention_chain(graph: onnx.GraphProto, ops: tuple[str, ...]) -> list[onnx.NodeProto]:
    """The nodes from the one Add reading ``keys`` through ``ops`` (each node the only reader of the
    one before); ValueError for a graph whose attention is another chain (also ``service.decoding.fused_graphs``)."""
    adds = [n for n in graph.node if n.op_type == "Add" and "keys" in n.input]
    if len(adds) != 1:
        raise ValueError(f"{len(adds)} Add nodes read 'keys', not one")
    chain = [adds[0]]
    for op in ops[1:]:
        chain.append(_consumer(graph, chain[-1].output[0]))
        if chain[-1].op_type != op:
            raise ValueError(f"attention chain: {chain[-1].op_type} where {op} was expected")
    return chain


def pack_attention(step: onnx.ModelProto) -> onnx.ModelProto:
    """The int8 step graph (``export.graphs.int8_step``) with packed attention scores; ValueError
    when the graph's attention is not the chain keys + query -> Tanh -> Reshape -> Gemm (``v``)
    -> Reshape -> Where (mask) -> Softmax."""
    model = onnx.ModelProto()
    model.CopyFrom(step)
    graph = model.graph
    chain = attention_chain(graph, _CHAIN)
    add, tanh, _, gemm, _, where, softmax = chain
    unsqueeze = next((n for n in graph.node if n.output[0] in add.input and n.op_type == "Unsqueeze"), None)
    if unsqueeze is None:
        raise ValueError("the query reaches the score Add through no Unsqueeze")
    query = unsqueeze.input[0]
    masked = next((numpy_helper.to_array(t) for t in graph.initializer if t.name == where.input[2]), None)
    if masked is None or masked.size != 1:
        raise ValueError("the masked score is no constant")
    keys = next((i for i in graph.input if i.name == "keys"), None)
    if keys is None or len(keys.type.tensor_type.shape.dim) != 3:
        raise ValueError("no graph input 'keys' of (rows, src_len, key_size)")
    keys_width = keys.type.tensor_type.shape.dim[2].dim_value

    def node(op: str, inputs: list[str], name: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [f"packed/{name}"], name=f"packed/{name}", **attrs)

    new = [
        node("Reshape", ["keys", "packed/keys_shape"], "flat_keys"),
        node("Gather", ["packed/flat_keys", "key_index"], "keys", axis=0),
        node("Gather", [query, "key_rows"], "queries", axis=0),
        node("Add", ["packed/keys", "packed/queries"], "sum"),
        node("Tanh", ["packed/sum"], "hidden"),
        helper.make_node("Gemm", [gemm.input[0], "packed/hidden"], ["packed/energy"], name="packed/energy",
                         transB=1),
        node("Reshape", ["packed/energy", "packed/flat"], "flat_energy"),
        node("Concat", ["packed/flat_energy", "packed/neg_large"], "scores", axis=0),
        helper.make_node("Gather", ["packed/scores", "score_index"], [where.output[0]], name="packed/energies",
                         axis=0),
    ]
    gone = {id(n) for n in (unsqueeze, add, tanh, chain[2], gemm, chain[4], where)}
    shape_nodes = [n for n in graph.node if n.op_type == "Shape" and n.output[0] in chain[4].input]
    gone |= {id(n) for n in shape_nodes}
    kept = [n for n in graph.node if id(n) not in gone]
    at = kept.index(softmax)
    del graph.node[:]
    graph.node.extend(kept[:at] + new + kept[at:])
    graph.initializer.extend([
        numpy_helper.from_array(np.array([-1, keys_width], np.int64), "packed/keys_shape"),
        numpy_helper.from_array(np.array([-1], np.int64), "packed/flat"),
        numpy_helper.from_array(masked.reshape(1), "packed/neg_large")])
    for name, axes in INPUTS.items():
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT64, axes))
    if not any("src_mask" in n.input for n in graph.node):
        kept_inputs = [i for i in graph.input if i.name != "src_mask"]
        del graph.input[:]
        graph.input.extend(kept_inputs)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:  # a node removed here had another reader
        raise ValueError(f"the rewritten graph does not check: {str(e)[:200]}") from None
    return model


def indices(lengths: np.ndarray, columns: int) -> dict[str, np.ndarray]:
    """The packed graph's index inputs for rows of source ``lengths`` (rows,) padded to
    ``columns``. Each row's run is its length rounded up to ``WIDTH_MULTIPLE``, or ``columns`` where
    that is less (a width the service never uses, ``layout.width``: there, as in the padded
    graph, a row's last bits may depend on the batch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    runs = _runs(lengths, columns)
    starts = np.concatenate([[0], np.cumsum(runs)])
    packed = int(starts[-1])
    rows = np.repeat(np.arange(len(lengths)), runs)  # (packed,)
    within = np.arange(packed) - np.repeat(starts[:-1], runs)  # position inside its row's run
    column = np.arange(columns)[None, :]
    score_index = np.where(column < lengths[:, None], starts[:-1, None] + column, packed)
    return {"key_index": rows * columns + within, "key_rows": rows, "score_index": score_index.astype(np.int64)}


PACKED_SHARE_MAX = 0.5
"""Above this share of the rows x columns packed, the padded step serves (same bits): the
packed step's two gathers (keys and queries) then cost about what the skipped padding saves.
Measured (``loadtest/bench_packed.py``, 8 to 160 rows, padded / packed): Zen 4, 53-60 % packed
0.91-1.01x, 33-42 % 1.03-1.11x, 22-38 % 1.06-1.21x; Xeon with AMX, 48-53 % 1.02-1.04x, 60-78 %
0.97-1.00x (``bench_packed_short_zen4.md``, ``bench_packed_zen4.md``, ``bench_packed_xeon.md``)."""


def _runs(lengths: np.ndarray, columns: int) -> np.ndarray:
    """(rows,) each row's packed run: its length rounded up to ``WIDTH_MULTIPLE``, at most ``columns``."""
    return np.minimum(-(-lengths // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, columns)


def pays(lengths: np.ndarray, columns: int) -> bool:
    """Whether the packed step is worth its gathers for rows of source ``lengths`` padded to
    ``columns`` (decided before any index is built)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int(_runs(lengths, columns).sum()) <= PACKED_SHARE_MAX * len(lengths) * columns


def feed_lengths(src_mask: np.ndarray) -> np.ndarray:
    """Each row's source length from its mask (rows, src_len) bool: masks are prefixes."""
    return src_mask.sum(axis=1, dtype=np.int64)


def step_inputs(padded: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """The packed step's inputs (name: axes) from the padded step's: no mask, the indices instead."""
    return {**{name: axes for name, axes in padded.items() if name != "src_mask"}, **INPUTS}


def to_packed(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A padded step's feed as the packed step's."""
    out = {name: value for name, value in feed.items() if name != "src_mask"}
    return {**out, **indices(feed_lengths(feed["src_mask"]), feed["src_mask"].shape[1])}


def known_answer(padded: Callable, packed_run: Callable, feed: Mapping[str, np.ndarray]) -> str | None:
    """None when the packed step gives the padded step's bits on ``feed`` (a padded feed)."""
    return same_bits(padded, lambda f: packed_run(to_packed(f)), feed)


def load(step: onnx.ModelProto, load_step: Callable[[bytes], Any], padded: Callable,
         feed: Mapping[str, np.ndarray]) -> tuple[Any, onnx.ModelProto] | None:
    """(session, graph) of ``step`` with packed attention, if it gives the padded step's bits on
    the known-answer ``feed``; else None, with one log line. ``load_step``: graph bytes -> an ONNX
    Runtime session; ``padded``: the padded step's runner (feed -> outputs)."""
    try:
        model = pack_attention(step)
        session = load_step(model.SerializeToString())
        problem = known_answer(padded, lambda f: session.run(None, dict(f)), feed)
    except (ValueError, ModelRepositoryError) as e:  # a graph the rewrite does not know
        problem = f"rewrite failed: {e}"
    if problem is not None:
        log.warning("packed attention refused (%s): the step scores every padded column", problem)
        return None
    return session, model
