"""Fused attention: the int8 step's additive attention in one compiled pass instead of ONNX Runtime's.

The attention of the int8 step (``export.graphs.int8_step``) is a chain of CPU operators:
the query from the state product, ``keys + query`` (Add), Tanh, ``v`` (Gemm), the mask
(Where), Softmax and the context (MatMul over the annotations). The first three make a pass each
over rows x src_len x 512 floats, padding included, and the context reads every padded
annotation: on the Zen 4, a third of a 112-row step on one thread (``docs/speed-round2.md``).
``service/decoding/attention.c`` does the whole chain per row over its real columns only, in one
pass. The step graph is cut in two at load (in memory, as the int8 form and packed attention
are):

- the *query graph*: the state's ``QuantizeLinear`` and its product, whose output (rows, P)
  holds the query in its first A columns (``Split`` into query and the GRU's hidden gates);
- the kernel: the attention (rows, src_len) and context (rows, C) from the product's query,
  the keys, the annotations and each row's source length (the mask's prefix);
- the *rest graph*: everything else, reading the product and the context as inputs.

The outputs are not the ONNX Runtime chain's bits (its own tanh and sums in another order): the
fused step is checked at load against the graph on the known-answer batch within ``TOLERANCE``,
and against itself for batch invariance (each row alone, same bits), and refused with one log
line otherwise. Where the package was installed without a C compiler the kernel is missing and
the step is served as before (one log line).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger("nmt.fused")

try:
    from service.decoding import _attention
except ImportError as e:  # installed without a C compiler (setup.py: the extension is optional)
    _attention = None
    MISSING = f"the compiled kernel is missing ({e})"
else:
    MISSING = ""

PRODUCT, CONTEXT = "fused/state_product", "fused/context"
TOLERANCE = {"log_probs": 0.05, "topk_log_probs": 0.05, "next_state": 0.01, "attention": 1e-3}
"""Largest |difference| from the ONNX Runtime chain accepted on the known-answer batch, per output.
The context enters the step through an int8 ``QuantizeLinear``: a context value at a rounding
boundary moves by one quantum, which the products carry to the outputs."""
_CHAIN = ("Add", "Tanh", "Reshape", "Gemm", "Reshape", "Where", "Softmax", "Unsqueeze", "MatMul", "Reshape")


def _users(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in graph.node if name in n.input]


def _follow(graph: onnx.GraphProto, start: onnx.NodeProto) -> list[onnx.NodeProto]:
    chain = [start]
    for op in _CHAIN[1:]:
        users = _users(graph, chain[-1].output[0])
        if len(users) != 1 or users[0].op_type != op:
            raise ValueError(f"attention chain: {[u.op_type for u in users]} after {chain[-1].op_type}, "
                             f"where one {op} was expected")
        chain.append(users[0])
    return chain


def split_step(step: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto, np.ndarray]:
    """(query graph, rest graph, v) of an int8 step graph; ValueError for a graph whose attention
    is not the chain keys + Split(product)[0] -> Tanh -> Gemm (``v``) -> Where -> Softmax ->
    MatMul (annotations)."""
    step, original = onnx.ModelProto(), step
    step.CopyFrom(original)  # the rest graph's nodes are renamed in place
    graph = step.graph
    adds = [n for n in graph.node if n.op_type == "Add" and "keys" in n.input]
    if len(adds) != 1:
        raise ValueError(f"{len(adds)} Add nodes read 'keys', not one")
    chain = _follow(graph, adds[0])
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
    before = _ancestors(graph, product)
    gone = before | {n.output[0] for n in chain} | {unsqueeze.output[0]}
    gone |= {n.output[0] for n in graph.node if n.op_type == "Shape" and n.output[0] in chain[4].input}
    query = _subgraph(step, [n for n in graph.node if n.output[0] in before], ["state"], [product], "fused_query")
    rest_nodes = [n for n in graph.node if n.output[0] not in gone]
    rename = {product: PRODUCT, chain[-1].output[0]: CONTEXT}
    for node in rest_nodes:
        node.input[:] = [rename.get(i, i) for i in node.input]
    kept_inputs = [i.name for i in graph.input if i.name not in ("keys", "annotations", "src_mask")]
    outputs = [o.name for o in graph.output if o.name != "attention"]
    rest = _subgraph(step, rest_nodes, kept_inputs, outputs, "fused_rest",
                     extra_inputs=[(PRODUCT, ["rows", "product"]), (CONTEXT, ["rows", "ctx_size"])])
    return query, rest, v.astype(np.float32)


def _ancestors(graph: onnx.GraphProto, name: str) -> set[str]:
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


def _subgraph(step: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], inputs: list[str], outputs: list[str],
              name: str, extra_inputs: Sequence[tuple[str, list[str]]] = ()) -> onnx.ModelProto:
    graph = step.graph
    used = {i for n in nodes for i in n.input}
    values = {v.name: v for v in [*graph.input, *graph.output]}
    new_inputs = [values[i] for i in inputs] + [
        helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, axes) for n, axes in extra_inputs]
    sub = helper.make_graph(list(nodes), name, new_inputs,
                            [values.get(o) or helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT,
                                                                            ["rows", "product"])
                             for o in outputs],
                            [t for t in graph.initializer if t.name in used])
    model = helper.make_model(sub, opset_imports=list(step.opset_import), ir_version=step.ir_version)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:  # a node cut away had another reader
        raise ValueError(f"the {name} graph does not check: {str(e)[:200]}") from None
    return model


class FusedStep:
    """The step as query session -> kernel -> rest session, run like an ONNX Runtime session
    (``run(output_names, feed)``) on the padded step's feed."""

    def __init__(self, query: Any, rest: Any, v: np.ndarray, ctx_size: int,
                 load_graph: Callable[[bytes], Any] | None = None, threads: int = 1) -> None:
        """``threads``: the kernel's (rows split between them, at least 8 each; the same results)."""
        self.query, self.rest, self.v, self.ctx_size, self.threads = query, rest, v, ctx_size, threads
        self._rest_inputs = [i.name for i in rest.get_inputs()]
        self._load = load_graph

    @classmethod
    def of(cls, step: onnx.ModelProto, load_graph: Callable[[bytes], Any], ctx_size: int,
           threads: int = 1) -> FusedStep:
        """``step`` cut in two (``split_step``), each part loaded by ``load_graph`` (graph bytes ->
        an ONNX Runtime session); ValueError for a graph the rewrite does not know."""
        query, rest, v = split_step(step)
        return cls(load_graph(query.SerializeToString()), load_graph(rest.SerializeToString()), v, ctx_size,
                   load_graph, threads)

    def like(self, step: onnx.ModelProto) -> FusedStep:
        """Another step graph of the same model (a shortlist's) in the fused form, loaded alike."""
        assert self._load is not None
        return FusedStep.of(step, self._load, self.ctx_size, self.threads)

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        product = self.query.run(None, {"state": feed["state"]})[0]
        mask = feed["src_mask"]
        rows, src_len = mask.shape
        alpha = np.empty((rows, src_len), np.float32)
        context = np.empty((rows, self.ctx_size), np.float32)
        _attention.attend(product, np.ascontiguousarray(feed["keys"]),
                          np.ascontiguousarray(feed["annotations"]), mask.sum(axis=1, dtype=np.int64),
                          self.v, alpha, context, self.threads)
        values = {**feed, PRODUCT: product, CONTEXT: context}
        names = list(names) if names is not None else [o.name for o in self.rest.get_outputs()] + ["attention"]
        want = [n for n in names if n != "attention"]
        out = dict(zip(want, self.rest.run(want, {n: values[n] for n in self._rest_inputs})))
        out["attention"] = alpha
        return [out[n] for n in names]


def check(reference: Callable, fused: FusedStep, feed: Mapping[str, np.ndarray], names: Sequence[str]
          ) -> str | None:
    """None when ``fused`` agrees with the graph (``reference``: feed -> outputs ``names``) within
    ``TOLERANCE`` on ``feed`` and gives each row alone the bits it gives it in the batch."""
    for name, a, b in zip(names, reference(feed), fused.run(names, feed)):
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.shape == b.shape else np.inf
        if name in TOLERANCE and not diff <= TOLERANCE[name]:
            return f"{name} differs from the graph's by {diff:.3g} (at most {TOLERANCE[name]})"
    whole = fused.run(names, feed)
    for row in (0, len(feed["state"]) - 1):
        alone = fused.run(names, {n: (v if v.ndim == 0 else v[row:row + 1]) for n, v in feed.items()})
        for name, a, b in zip(names, whole, alone):
            if name != "topk_ids" and not np.array_equal(a[row:row + 1], b):
                return f"row {row} alone: {name} is not the bits it has in the batch"
    return None


def load(step: onnx.ModelProto, load_graph: Callable[[bytes], Any], reference: Callable,
         feed: Mapping[str, np.ndarray], names: Sequence[str], threads: int = 1) -> FusedStep | None:
    """The fused form of ``step`` if the kernel is there and ``check`` accepts it on ``feed`` (a
    padded step feed; ``reference``: feed -> the graph's outputs ``names``), else None with one
    log line. ``load_graph``: graph bytes -> an ONNX Runtime session."""
    if _attention is None:
        log.warning("fused attention unavailable (%s): the step runs on ONNX Runtime's operators", MISSING)
        return None
    try:
        fused = FusedStep.of(step, load_graph, feed["annotations"].shape[2], threads)
        problem = check(reference, fused, feed, names)
    except ValueError as e:  # a graph the rewrite does not know
        problem = f"rewrite failed: {e}"
    if problem is not None:
        log.warning("fused attention refused (%s): the step runs on ONNX Runtime's operators", problem)
        return None
    return fused
