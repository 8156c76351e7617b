"""Fused kernels: the int8 step's attention and output layer in compiled passes instead of ONNX Runtime's.

The attention of the int8 step (``export.graphs.int8_step``) is a chain of CPU operators:
the query from the state product, ``keys + query`` (Add), Tanh, ``v`` (Gemm), the mask
(Where), Softmax and the context (MatMul over the annotations). The first three make a pass each
over rows x src_len x 512 floats, padding included, and the context reads every padded
annotation: on the Zen 4, a third of a 112-row step on one thread (``docs/speed-round2.md``).
``service/decoding/attention.c`` does the whole chain per row over its real columns only, in one
pass. The output layer after its product (scale, bias, LogSoftmax, the blocked top-k) makes six
or more passes over rows x 8,000 floats; ``output_layer.c`` makes two. The step graph is cut at
load (in memory, as the int8 form and packed attention are; ``service.decoding.fused_graphs``):

- the *query graph*: the state's ``QuantizeLinear`` and its product, whose output (rows, P)
  holds the query in its first A columns (``Split`` into query and the GRU's hidden gates);
- the attention kernel: the attention (rows, src_len) and context (rows, C) from the product's
  query, the keys, the annotations and each row's source length (the mask's prefix);
- the *middle graph*: the GRU and the products up to the output product and its row scales;
- the output kernel: the top-k log-probabilities and their ids (and ``log_probs`` when asked).

Where the output layer has another shape (a shortlist's graphs) the *rest graph* (everything
after the attention) replaces the last two. The outputs are not the ONNX Runtime operators' bits
(their own exp and tanh, sums in another order): the fused step is checked at load against the
graph on the known-answer batch within ``TOLERANCE``, and against itself for batch invariance
(a row alone, same bits), and refused with one log line otherwise. Where the package was
installed without a C compiler the kernels are missing and the step is served as before (one
log line).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import onnx

from service.decoding.arrays import SLOTS
from service.decoding.fused_graphs import (CONTEXT, NEXT_PRODUCT, PRODUCT, RAW, SCALE, split_output,  # noqa: F401
                                           split_step, with_next_product)

T = TypeVar("T")
log = logging.getLogger("nmt.fused")
CARRIES = 4  # states whose product a fused step keeps (``FusedStep.keep``)

try:
    from service.decoding import _attention
except ImportError as e:  # installed without a C compiler (setup.py: the extension is optional)
    _attention = None
    MISSING = f"the compiled kernel is missing ({e})"
else:
    MISSING = ""

TOLERANCE = {"log_probs": 0.05, "topk_log_probs": 0.05, "next_state": 0.01, "attention": 1e-3}
"""Largest |difference| from the ONNX Runtime chain accepted on the known-answer batch, per output.
The context enters the step through an int8 ``QuantizeLinear``: a context value at a rounding
boundary moves by one quantum, which the products carry to the outputs."""
class FusedStep:
    """The step as query session -> attention kernel -> the rest (a session; or, where the output
    layer fits ``split_output``, the middle session -> output-layer kernel), run like an ONNX Runtime
    session (``run(output_names, feed)``) on the padded step's feed."""

    def __init__(self, query: Any, tail: Any, v: np.ndarray, ctx_size: int, *, bias: np.ndarray | None = None,
                 load_graph: Callable[[bytes], Any] | None = None, threads: int = 1,
                 graphs: dict[str, onnx.ModelProto] | None = None, box: list | None = None) -> None:
        """``tail``: the rest graph's session, or with ``bias`` (the output layer's) the middle
        graph's; ``threads``: the kernels' (rows split between them, at least 8 each; the same
        results); ``graphs``: the parts' graphs by name (for profiling)."""
        self.query, self.tail, self.v, self.ctx_size, self.bias = query, tail, v, ctx_size, bias
        self.threads, self.graphs, self._load = threads, graphs or {}, load_graph
        self._tail_inputs = [i.name for i in tail.get_inputs()]
        # with the output kernel: what the middle graph gives it, and the next step's product if it makes one
        made = {o.name for o in tail.get_outputs()}
        self._tail_outputs = ["next_state", RAW, SCALE, *([NEXT_PRODUCT] if NEXT_PRODUCT in made else [])]
        # [(a state, its product)], newest last, at most CARRIES: made by the runs (their next_state)
        # and by ``follow`` and ``join``; shared by the steps of one runtime (``like``), whichever runs
        # next, and kept for several states: two lanes' batches take turns on one runtime
        self._box: list[tuple[Any, np.ndarray]] = box if box is not None else []

    @classmethod
    def of(cls, step: onnx.ModelProto, load_graph: Callable[[bytes], Any], ctx_size: int,
           threads: int = 1, box: list | None = None, like: FusedStep | None = None) -> FusedStep:
        """``step`` cut (``split_step``, then ``split_output`` where it fits), each graph loaded by
        ``load_graph`` (graph bytes -> an ONNX Runtime session; ``quiet=True``: the query graph's, whose
        pool must not spin: it runs at joins only, and a second spinning pool slows the first);
        ValueError for a step graph the first cut does not know. ``like``: a fused step whose query
        session serves this one too where the query graphs are the same (a shortlist's step)."""
        query, tail, v = split_step(step)
        try:
            middle, bias = split_output(tail)
            tail = with_next_product(middle, query)
        except ValueError:  # an output layer of another shape (a shortlist's): the rest graph does it
            bias = None
        return cls.loaded(query, tail, v, load_graph, ctx_size, threads, box, like, bias=bias)

    @classmethod
    def loaded(cls, query: onnx.ModelProto, tail: onnx.ModelProto, v: np.ndarray, load_graph: Callable[[bytes], Any],
               ctx_size: int, threads: int, box: list | None, like: FusedStep | None, **extra: Any) -> FusedStep:
        """``cls`` of the cut graphs ``query`` and ``tail``, each loaded by ``load_graph`` (the query's
        quiet), or ``like``'s query session where its query graph is the same; ``extra``: more arguments;
        ``tail_session``: what runs ``tail`` instead of a session of it (a compiled middle)."""
        same = like is not None and like.graphs.get("query") == query
        query_session = like.query if same else load_graph(query.SerializeToString(), quiet=True)
        tail_session = extra.pop("tail_session", None) or load_graph(tail.SerializeToString())
        return cls(query_session, tail_session, v, ctx_size, load_graph=load_graph,
                   threads=threads, graphs={"query": query, "tail": tail}, box=box, **extra)

    def like(self, step: onnx.ModelProto) -> FusedStep:
        """Another step graph of the same model (a shortlist's) in the fused form, loaded alike."""
        assert self._load is not None
        return FusedStep.of(step, self._load, self.ctx_size, self.threads, self._box, like=self)

    def stages(self, feed: Mapping[str, np.ndarray]) -> dict[str, Callable[[], object]]:
        """Each part of ``run`` on ``feed`` alone, by name (for benchmarks); the parts' inputs made once."""
        product = self.query.run(None, {"state": feed["state"]})[0]
        attend, alpha, tail_feed = self._attention(product, feed)
        out = {"query graph": lambda: self.query.run(None, {"state": feed["state"]}), "attention kernel": attend}
        if self.bias is None:
            return {**out, "rest graph": lambda: self.tail.run(["topk_log_probs", "topk_ids", "next_state"], tail_feed)}
        _, raw, scale, *_ = self.tail.run(self._tail_outputs, tail_feed)
        top = self._top(raw, int(feed["k"]), False)
        return {**out, "middle graph": lambda: self.tail.run(self._tail_outputs, tail_feed),
                "output kernel": lambda: _attention.output_layer(raw, scale, self.bias, *top, self.threads)}

    def _attention(self, product: np.ndarray, feed: Mapping[str, np.ndarray]
                   ) -> tuple[Callable[[], None], np.ndarray, dict[str, np.ndarray]]:
        """(the attention kernel's call, the attention it fills, the tail graph's feed with the context
        it fills) for ``feed`` and the state's ``product``."""
        mask = feed["src_mask"]
        alpha = np.empty(mask.shape, np.float32)
        context = np.empty((mask.shape[0], self.ctx_size), np.float32)
        keys, annotations = np.ascontiguousarray(feed["keys"]), np.ascontiguousarray(feed["annotations"])
        lengths = mask.sum(axis=1, dtype=np.int64)
        values = {**feed, PRODUCT: product, CONTEXT: context}
        slots = () if feed.get(SLOTS) is None else (feed[SLOTS],)  # rows where they lie (``layout.SlottedContext``)
        return (lambda: _attention.attend(product, keys, annotations, lengths, self.v, alpha, context, self.threads,
                                          *slots), alpha, {n: values[n] for n in self._tail_inputs})

    @staticmethod
    def _top(raw: np.ndarray, k: int, log_probs: bool) -> tuple[np.ndarray, ...]:
        """The output kernel's arrays to fill: top-k values and ids, and the log-probabilities or None."""
        rows = len(raw)
        return (np.empty((rows, k), np.float32), np.empty((rows, k), np.int64),
                np.empty(raw.shape, np.float32) if log_probs else None)

    @property
    def _carried(self) -> bool:
        """Whether the runs make the next step's product (the middle graph of ``with_next_product``)."""
        return NEXT_PRODUCT in self._tail_outputs

    def _carried_for(self, state: Any) -> np.ndarray | None:
        return next((product for kept, product in reversed(list(self._box)) if kept is state), None)

    def keep(self, state: Any, product: np.ndarray) -> None:
        """Remember ``product`` as ``state``'s (benchmarks use it to time a running batch's step)."""
        self._box[:] = [*(c for c in self._box[-(CARRIES - 1):] if c[0] is not state), (state, product)]

    def follow(self, state: Any, rows: Any, index: np.ndarray) -> None:
        """``rows`` = ``state[index]`` (a beam reordered, rows removed): the carried product follows."""
        product = self._carried_for(state)
        if product is not None:
            self.keep(rows, product[index])

    def join(self, state: Any, joined: Any, new: np.ndarray) -> None:
        """``joined`` = ``state`` (or None) with the ``new`` rows after it (texts joined): the product
        carried for ``state`` grows by the new rows' (the query graph on them alone: a row's product does
        not depend on the rows beside it)."""
        before = None if state is None else self._carried_for(state)
        if self._carried and (state is None or before is not None):
            fresh = self.query.run(None, {"state": new})[0]
            self.keep(joined, fresh if before is None else np.concatenate([before, fresh]))

    def product(self, state: Any) -> np.ndarray:
        """The state's product: carried from the last run when ``state`` is its next_state (or
        followed it), else by the query graph (texts joined, or another caller's state)."""
        product = self._carried_for(state)
        return product if product is not None else self.query.run(None, {"state": state})[0]

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        attend, alpha, tail_feed = self._attention(self.product(feed["state"]), feed)
        attend()
        names = list(names) if names is not None else ["log_probs", "topk_log_probs", "topk_ids", "next_state",
                                                       "attention"]
        if self.bias is None:
            want = [n for n in names if n != "attention"]
            out = dict(zip(want, self.tail.run(want, tail_feed)))
        else:
            next_state, raw, scale, *carried = self.tail.run(self._tail_outputs, tail_feed)
            if carried:
                self.keep(next_state, carried[0])
            top = self._top(raw, int(feed["k"]), "log_probs" in names)
            _attention.output_layer(raw, scale, self.bias, *top, self.threads)
            out = {"next_state": next_state, **dict(zip(("topk_log_probs", "topk_ids", "log_probs"), top))}
        out["attention"] = alpha
        return [out[n] for n in names]


def kernel_threads(intra_op_threads: int | None, shared_pool: bool, spinning: bool) -> int:
    """The kernels' threads: one beside a spinning ONNX Runtime pool (whose workers keep the other
    cores busy between runs: a second kernel thread there made a 112-row step 1.5x slower on the
    Zen 4, ``docs/speed-round2.md``); else the engine's intra-op threads (the cores for the default)."""
    if spinning:
        return 1
    from service.process import cores

    return intra_op_threads if intra_op_threads and not shared_pool else cores()[0]


def check(reference: Callable, fused: FusedStep, feed: Mapping[str, np.ndarray], names: Sequence[str],
          shared: Sequence[str] = ()) -> str | None:
    """None when ``fused`` agrees with the graph (``reference``: feed -> outputs ``names``) within
    ``TOLERANCE`` on ``feed`` and gives each row alone the bits it gives it in the batch (``shared``:
    inputs that are not one entry per row, given whole)."""
    whole = fused.run(names, feed)
    if (problem := beyond(names, reference(feed), whole, TOLERANCE)) is not None:
        return problem
    state = whole[list(names).index("next_state")] if "next_state" in names else None
    carried = fused._carried_for(state) if state is not None else None
    if carried is not None:
        if not np.array_equal(carried, fused.query.run(None, {"state": state})[0]):
            return "the next step's product made in the step is not the query graph's"
    for row in (0, len(feed["state"]) - 1):
        alone = fused.run(names, {n: (v if v.ndim == 0 or n in shared else v[row:row + 1]) for n, v in feed.items()})
        for name, a, b in zip(names, whole, alone):
            if name != "topk_ids" and not np.array_equal(a[row:row + 1], b):
                return f"row {row} alone: {name} is not the bits it has in the batch"
    return None


def load(step: onnx.ModelProto, load_graph: Callable[[bytes], Any], reference: Callable,
         feed: Mapping[str, np.ndarray], names: Sequence[str], threads: int = 1) -> FusedStep | None:
    """The fused form of ``step`` if the kernel is there and ``check`` accepts it on ``feed`` (a
    padded step feed; ``reference``: feed -> the graph's outputs ``names``), else None with one
    log line. ``load_graph``: graph bytes -> an ONNX Runtime session."""
    return checked("fused attention", "the step", lambda: FusedStep.of(step, load_graph, feed["annotations"].shape[2],
                                                                        threads),
                   lambda fused: check(reference, fused, feed, names))


def beyond(names: Sequence[str], want: Sequence[np.ndarray], got: Sequence[np.ndarray],
           tolerance: Mapping[str, float]) -> str | None:
    """The first output (of those ``tolerance`` names) whose largest |difference| from the graph's is
    over its tolerance, said in words; None if none is."""
    for name, a, b in zip(names, want, got):
        diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.shape == b.shape else np.inf
        if name in tolerance and not diff <= tolerance[name]:
            return f"{name} differs from the graph's by {diff:.3g} (at most {tolerance[name]})"
    return None


def checked(name: str, part: str, build: Callable[[], T], problem: Callable[[T], str | None]) -> T | None:
    """``build()`` if the kernel is there, the rewrite knows the graph (no ValueError) and ``problem``
    finds none; else None with one log line saying why ``part`` runs on ONNX Runtime's operators."""
    if _attention is None:
        log.warning("%s unavailable (%s): %s runs on ONNX Runtime's operators", name, MISSING, part)
        return None
    try:
        fused = build()
        why = problem(fused)
    except ValueError as e:  # a graph the rewrite does not know
        why = f"rewrite failed: {e}"
    if why is not None:
        log.warning("%s refused (%s): %s runs on ONNX Runtime's operators", name, why, part)
        return None
    return fused
