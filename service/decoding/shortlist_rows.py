"""The shortlist per row: each row projects onto its own text's candidates, by a compiled kernel.

The shortlist's graphs (``service.decoding.shortlist``) project a batch onto the *union* of its
texts' candidates and mask each row to its own: at saturation, 100 texts' union is most of the
vocabulary, so the step costs what the full one does. Here the fused step (``service.decoding.fused``)
is cut before the output product (``split_output(at_product=True)``); its middle graph makes the product
for the words every text gets (``Shortlist.always``: the 1,000 most frequent and the special ones, a
dense product ONNX Runtime does well), and ``shortlist_layer.c`` computes, for each row, the products of
its own text's other words (about 170 for en-fr/4), then the log-softmax and top-k over both. A text's
own words are fed as ``ROW_INPUTS``: every text's ids one after another (``candidate_ids``), and each
row's start and count in them (a text's beams share one).

A row's scores are a function of its own inputs only: the same bits alone or in any batch (the
batch's width no longer moves the normalizer, as it did with the union). The form is checked at load
against the masked graph (the whole vocabulary, other words at ``NEG_LARGE``) on the known-answer
batch within ``fused.TOLERANCE``, and for batch invariance; refused with one log line otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from service.decoding import fused, fused_middle
from service.decoding.fused_graphs import (ALWAYS, OUTPUT_INPUT, SCALE, ProductLayer, split_output,
                                           split_step, with_next_product)
from service.decoding.shortlist import NEG_LARGE, Candidates, OutputLayer

ROW_INPUTS = ("candidate_ids", "row_starts", "row_counts")
SHARED = ("candidate_ids",)  # not one entry per row
NAMES = ["topk_log_probs", "topk_ids", "next_state", "attention"]


class RowShortlistStep(fused.FusedStep):
    """The fused step with ``shortlist_layer`` as its output layer (``run`` takes ``ROW_INPUTS`` too)."""

    def __init__(self, *args: Any, layer: ProductLayer, always: np.ndarray, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer, self.always = layer, always.astype(np.int32)
        self._tail_outputs[1:3] = [OUTPUT_INPUT, SCALE, ALWAYS]

    @classmethod
    def cut(cls, step: onnx.ModelProto, like: fused.FusedStep, always: np.ndarray, *,
            compiled: bool = False) -> RowShortlistStep:
        """``step`` (the served int8 step) cut before its output product, which the middle graph makes for
        the ``always`` words only; loaded as ``like``'s parts (its query session shared); ``compiled``: the
        middle graph run by ``fused_middle.MiddleKernel``; ValueError for a graph the cuts do not know."""
        query, tail, v = split_step(step)
        middle, layer = split_output(tail, at_product=True)
        assert like._load is not None
        tail = with_next_product(layer.with_product(middle, always, ALWAYS), query)
        kernel = fused_middle.MiddleKernel.of(tail, like.threads) if compiled else None
        return cls.loaded(query, tail, v, like._load, like.ctx_size, like.threads, like._box, like, bias=layer.bias,
                          layer=layer, always=always, tail_session=kernel)

    def _layer(self, out: Sequence[np.ndarray], feed: Mapping[str, np.ndarray]
               ) -> tuple[Callable[[], None], np.ndarray, np.ndarray]:
        """(the kernel's call, the top-k values and ids it fills) for the middle graph's outputs ``out``
        (``a``, its row scales and the always-words' product)."""
        a, scale, raw = out
        k, layer = int(feed["k"]), self.layer
        values, ids = np.empty((len(a), k), np.float32), np.empty((len(a), k), np.int64)
        args = (a.view(np.int32), scale, raw, self.always, layer.w, layer.wsum, layer.wscale, layer.bias,
                *(np.ascontiguousarray(feed[n]) for n in ("row_starts", "row_counts", "candidate_ids")), values, ids)
        return lambda: fused._attention.shortlist_layer(*args, self.threads), values, ids

    def stages(self, feed: Mapping[str, np.ndarray]) -> dict[str, Callable[[], object]]:
        product = self.query.run(None, {"state": feed["state"]})[0]
        attend, _, tail_feed = self._attention(product, feed)
        out = self.tail.run(self._tail_outputs, tail_feed)
        return {"query graph": lambda: self.query.run(None, {"state": feed["state"]}), "attention kernel": attend,
                "middle graph": lambda: self.tail.run(self._tail_outputs, tail_feed),
                "shortlist kernel": self._layer(out[1:4], feed)[0]}

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        names = list(names) if names is not None else NAMES
        if "log_probs" in names:
            raise ValueError("the per-row shortlist step gives no log_probs over the vocabulary")
        attend, alpha, tail_feed = self._attention(self.product(feed["state"]), feed)
        attend()
        next_state, *out = self.tail.run(self._tail_outputs, tail_feed)
        if len(out) > 3:
            self.keep(next_state, out[3])
        call, values, ids = self._layer(out[:3], feed)
        call()
        result = {"next_state": next_state, "topk_log_probs": values, "topk_ids": ids, "attention": alpha}
        return [result[n] for n in names]


def middle_form(step: Any) -> str:
    """``compiled`` where ``step`` is a per-row step whose middle is ``fused_middle.MiddleKernel``, else ``graph``."""
    return "compiled" if isinstance(getattr(step, "tail", None), fused_middle.MiddleKernel) else "graph"


def candidates(texts: Sequence[np.ndarray], beams: Sequence[int], always: int = 0) -> Candidates:
    """The step's ``ROW_INPUTS`` for texts of ``beams`` rows each (each text's own words: sorted, none of
    them one of the ``always`` always-words; ``Shortlist.of_text(own=True)``)."""
    counts = np.array([len(ids) for ids in texts], dtype=np.int64)
    starts = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    greedy = all(b == 1 for b in beams)  # (each text one row: no repeats)
    return Candidates(feed={"candidate_ids": np.concatenate([np.zeros(0, np.int32), *texts], dtype=np.int32),
                            "row_starts": starts if greedy else np.repeat(starts, beams),
                            "row_counts": counts if greedy else np.repeat(counts, beams)}, always=always)


def known_answer(feed: Mapping[str, np.ndarray], vocab: int, always: np.ndarray, seed: int = 0) -> list[np.ndarray]:
    """Each text's words for the known-answer batch's rows, two rows to a text (its beams): the
    always-words and a few hundred random others (or the whole vocabulary, where small)."""
    rng = np.random.default_rng(seed)
    size = min(vocab, max(int(feed["k"]), 300))
    return [np.union1d(always, rng.choice(vocab, size, replace=False)) for _ in range(-(-len(feed["state"]) // 2))]


def load(step: onnx.ModelProto, like: fused.FusedStep, masked: Any, layer: OutputLayer, always: np.ndarray,
         feed: Mapping[str, np.ndarray]) -> RowShortlistStep | None:
    """The per-row form of ``step`` (``always``: the shortlist's always-words) if the kernel is there and
    it agrees, on ``feed`` (the known-answer step feed), with ``masked`` (the shortlist's masked session:
    ``run(names, feed + row_bias)``); else None with one log line. Its middle by ``fused_middle.MiddleKernel``
    where offered and it passes the same check (and then its query graph by ``compiled_query``); else the
    graph's, with one log line."""
    texts = known_answer(feed, len(layer.bias), always)
    beams = [2] * (len(texts) - 1) + [len(feed["state"]) - 2 * (len(texts) - 1)]
    row_feed = {**feed, **candidates([np.setdiff1d(ids, always) for ids in texts], beams).feed}
    bias = np.full((len(texts), len(layer.bias)), NEG_LARGE, np.float32)
    for i, ids in enumerate(texts):
        bias[i, ids] = layer.bias[ids]
    reference = lambda f: masked.run(NAMES, {**f, "row_bias": np.repeat(bias, beams, axis=0)})  # noqa: E731
    check = lambda rows: fused.check(reference, rows, row_feed, NAMES, shared=SHARED)  # noqa: E731
    if (why := fused_middle.offered()) is None:
        found = fused.checked("compiled middle", "the step's middle", lambda: RowShortlistStep.cut(
            step, like, always, compiled=True), check)
        if found is not None:
            compiled_query(found, like, feed["state"])
            return found
    else:
        fused.log.info("compiled middle not offered (%s): the step's middle runs on ONNX Runtime's operators", why)
    return fused.checked("shortlist per row", "the shortlist", lambda: RowShortlistStep.cut(step, like, always), check)


def compiled_query(rows: RowShortlistStep, like: fused.FusedStep, state: np.ndarray) -> None:
    """``rows``' query graph (and ``like``'s, where they share it: joins run ``like``'s) by
    ``fused_middle.QueryKernel`` on its compiled middle's weights, if it gives the graph's bits on
    ``state``; else as it was, with one log line."""
    def problem(kernel: fused_middle.QueryKernel) -> str | None:
        same = np.array_equal(kernel.run(None, {"state": state})[0], rows.query.run(None, {"state": state})[0])
        return None if same else "its product is not the query graph's bits"
    kernel = fused.checked("compiled query", "the query graph",
                           lambda: fused_middle.QueryKernel.of(rows.graphs["query"], rows.tail), problem)
    if kernel is not None:
        if like.query is rows.query:
            like.query = kernel
        rows.query = kernel
