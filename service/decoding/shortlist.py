"""A lexical shortlist: each step projects only onto the target pieces its texts may need.

What Marian calls ``--shortlist`` and CTranslate2 ``vocabulary mapping``. The
export stage (``export/graphs/shortlist.py``) stores, for each source piece, the
target pieces that most often translate it in the training corpus, plus the most
frequent target pieces; both are in ``shortlist.npz`` of the model repository
(checksummed like every file). A text's candidates are the union of its source
pieces' lists, the frequent pieces and the special and placeholder pieces.

Here the int8 step graph is rewritten once, in memory, so that its output layer
reads the candidates' columns instead of all ``vocab_size`` (``shortlist_graph``):
the output product's weight, its column scales and the output bias become graph
inputs, sliced by the batch (``Candidates``) only when texts join or leave; the
log-softmax and the top-k run over the candidates, and ``topk_ids`` come back as
vocabulary ids. A row is masked to its own text's candidates
(``row_bias``: the output bias at its candidates, ``NEG_LARGE`` elsewhere), so a text is scored over the same pieces whatever it is
batched with; only the rounding of its log-softmax normalizer can differ with the
width of the batch's union.

Where the fused step serves (the compiled kernels), the shortlist is served per
row instead (``service.decoding.shortlist_rows``): no union, each row's own words,
the same bits in any batch; the union's graphs here are its fallback.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service import config
from service.decoding.fused import _attention  # None where installed without a C compiler: numpy's union
from service.text import placeholders

WEIGHT, SCALE, BIAS = "output_product/weight", "output_product/weight_scale", "output_bias"
"""Names of the output layer's constants in the int8 step (``export.graphs.int8_step``)."""
INPUTS = {"shortlist_weight": (TensorProto.UINT8, ["out_size", "candidates"]),
          "shortlist_scale": (TensorProto.FLOAT, ["candidates"]),
          "row_bias": (TensorProto.FLOAT, ["rows", "candidates"]),
          "candidates": (TensorProto.INT64, ["candidates"])}
"""The gathered step's inputs. ``row_bias`` is the output bias at each row's own candidates and
``NEG_LARGE`` elsewhere: the graph's bias ``Add`` masks the row (ONNX Runtime's ``Where`` with a
scalar branch measured 12x slower than that ``Add`` at 160 x 8,000)."""
NEG_LARGE = -1e9  # a masked candidate's logit: exp() of it is 0 (not -inf: no NaN)
ALIGN = 16  # the union is padded to a multiple of this (repeated EOS columns, masked)


@dataclass(frozen=True)
class OutputLayer:
    """The full output layer's constants, sliced per batch."""

    weight: np.ndarray  # (out_size, vocab_size) uint8 (int8 in the u8 x s8 form)
    scale: np.ndarray  # (vocab_size,) float32
    bias: np.ndarray  # (vocab_size,) float32


def shortlist_graph(step: onnx.ModelProto, *, gather: bool = True, layer: bool = True
                    ) -> tuple[onnx.ModelProto, OutputLayer | None]:
    """The shortlist form of an int8 step graph, and the output layer's constants. ``gather``:
    the output layer reads the candidates' columns (inputs ``INPUTS``); else it keeps the whole
    vocabulary and only its bias becomes the input ``row_bias`` (rows, vocab_size), for a union
    too wide to pay. ValueError when the graph has no output layer of that shape (the generic
    int8 rewrite, fp32 graphs). ``layer=False``: the constants are not copied out (None)."""
    model = onnx.ModelProto()
    model.CopyFrom(step)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    if not all(name in inits for name in (WEIGHT, SCALE, BIAS)):
        raise ValueError("the step graph has no int8 output layer (output_product, output_bias)")
    if not any(n.op_type == "LogSoftmax" and "log_probs" in n.output for n in graph.node):
        raise ValueError("the step graph has no LogSoftmax writing log_probs")
    layer = _output_layer(inits) if layer else None
    renames = ({WEIGHT: "shortlist_weight", SCALE: "shortlist_scale", BIAS: "row_bias"} if gather
               else {BIAS: "row_bias"})
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    if not gather:
        graph.initializer.remove(inits[BIAS])
        graph.input.append(helper.make_tensor_value_info("row_bias", TensorProto.FLOAT, ["rows", "vocab_size"]))
        return model, layer
    weight_type = inits[WEIGHT].data_type  # uint8, or int8 in the u8 x s8 form
    kept = [n for n in graph.node if not ({"topk_log_probs", "topk_ids"} & set(n.output))]
    topk = [helper.make_node("Reshape", ["k", "shortlist/one_dim"], ["shortlist/k"], name="shortlist/k"),
            helper.make_node("Shape", ["candidates"], ["shortlist/width"], name="shortlist/width"),
            helper.make_node("Min", ["shortlist/k", "shortlist/width"], ["shortlist/kk"], name="shortlist/kk"),
            helper.make_node("TopK", ["log_probs", "shortlist/kk"], ["topk_log_probs", "shortlist/position"],
                             axis=1, name="shortlist/topk"),
            helper.make_node("Gather", ["candidates", "shortlist/position"], ["topk_ids"], axis=0,
                             name="shortlist/ids")]
    nodes = _live(kept + topk, [o.name for o in graph.output])
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    keep = [t for t in graph.initializer if t.name in used and t.name not in renames]
    del graph.initializer[:]
    graph.initializer.extend(keep + [numpy_helper.from_array(np.array([1], np.int64), "shortlist/one_dim")])
    graph.input.extend(helper.make_tensor_value_info(n, weight_type if n == "shortlist_weight" else t, s)
                       for n, (t, s) in INPUTS.items())
    _loosen_vocab_axis(graph)
    return model, layer


def _output_layer(inits: dict[str, onnx.TensorProto]) -> OutputLayer:
    weight, scale, bias = (numpy_helper.to_array(inits[n]) for n in (WEIGHT, SCALE, BIAS))
    return OutputLayer(weight=np.ascontiguousarray(weight), scale=scale.reshape(-1), bias=bias.reshape(-1))


def _live(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in their order."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    need, live = list(outputs), set()
    while need:
        i = producer.get(need.pop())
        if i is not None and i not in live:
            live.add(i)
            need.extend(nodes[i].input)
    return [n for i, n in enumerate(nodes) if i in live]


def _loosen_vocab_axis(graph: onnx.GraphProto) -> None:
    """``log_probs`` is (rows, candidates) here, not (rows, vocab_size)."""
    for value in graph.output:
        if value.name == "log_probs":
            value.type.tensor_type.shape.dim[1].dim_param = "candidates"


@dataclass(frozen=True)
class Shortlist:
    """Per source piece, the target pieces it may bring; and those every text gets."""

    offsets: np.ndarray  # (src_vocab + 1,) int64: piece p's candidates are ids[offsets[p]:offsets[p + 1]]
    ids: np.ndarray  # (total,) int32 target ids
    always: np.ndarray  # (n,) int64 frequent, special and placeholder target ids

    def of_text(self, source_ids: Sequence[int], *, own: bool = False) -> np.ndarray:
        """(n,) sorted target ids a text may produce; ``own``: but the ``always`` ones."""
        offsets, ids = self._own if own else (self.offsets, self.ids)
        if _attention is not None:  # the compiled union (``shortlist_words.c``): the same ids, a tenth of the time
            out = np.empty(self._width, np.int32)
            words = out[:_attention.shortlist_words(offsets, ids, source_ids, out)].copy()
        else:
            parts = [ids[offsets[p]:offsets[p + 1]] for p in set(source_ids) if 0 <= p < len(offsets) - 1]
            words = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int32)
        return words if own else np.union1d(self.always, words)

    @functools.cached_property
    def _width(self) -> int:
        """Target ids are below this."""
        return int(self.ids.max()) + 1 if len(self.ids) else 1

    @functools.cached_property
    def _own(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, ids) of each source piece's candidates but the ``always`` ones (made once)."""
        keep = ~np.isin(self.ids, self.always)
        return np.concatenate([[0], np.cumsum(keep)])[self.offsets], self.ids[keep]


def always_ids(target: Any) -> list[int]:
    """Target ids every text gets: EOS, UNK and the placeholder tokens (a SentencePiece model)."""
    tokens = [target.piece_to_id(t) for t in placeholders.reserved_tokens()]
    return sorted({target.eos_id(), target.unk_id(), *(i for i in tokens if i != target.unk_id())})


def load_shortlist(path: Path, *, always: Sequence[int]) -> Shortlist:
    """``shortlist.npz`` (``offsets``, ``ids``, ``frequent``) plus the ids every text needs."""
    with np.load(path, allow_pickle=False) as data:
        offsets, ids, frequent = data["offsets"], data["ids"], data["frequent"]
    if offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{path}: offsets must rise from 0 to the number of ids")
    return Shortlist(offsets=offsets.astype(np.int64), ids=ids.astype(np.int32),
                     always=np.union1d(frequent.astype(np.int64), np.asarray(always, dtype=np.int64)))


ShortlistChoice = config.Shortlist
"""``--shortlist``: ``auto`` is on where the manifest shows it costs at most ``MAX_BLEU_LOSS``."""


MAX_BLEU_LOSS = 0.3
SPLITS, SEARCHES = ("test", "long"), ("greedy", "beam5")


def decide(choice: ShortlistChoice, record: Any, *, precision: str) -> tuple[bool, str]:
    """Whether to use the repository's shortlist, and why. ``record``: the manifest's ``shortlist``
    (``export/graphs/shortlist.py``, with ``bleu`` from ``loadtest/quality_engine.py --shortlist``)."""
    if choice is ShortlistChoice.OFF:
        return False, "--shortlist off"
    if not isinstance(record, dict) or "file" not in record:
        return False, "the repository has no shortlist"
    if precision != "int8":
        return False, "the shortlist rewrites the int8 step only"
    if choice is ShortlistChoice.ON:
        return True, "--shortlist on"
    bleu = record.get("bleu") if isinstance(record.get("bleu"), dict) else {}
    losses = []
    for split in SPLITS:
        for search in SEARCHES:
            pair = (bleu.get(split) or {}).get(search) or {}
            if not all(isinstance(pair.get(k), (int, float)) for k in ("full", "shortlist")):
                return False, f"no measured {split} {search} BLEU in the manifest's shortlist.bleu"
            losses.append(pair["full"] - pair["shortlist"])
    if max(losses) > MAX_BLEU_LOSS:
        return False, f"it loses {max(losses):.2f} BLEU (> {MAX_BLEU_LOSS})"
    return True, f"within {max(max(losses), 0):.2f} BLEU of the full vocabulary (test, long; greedy, beam 5)"


MAX_GATHERED_SHARE = 0.5
"""Above this share of the vocabulary, the step keeps the whole (prepacked) output layer and only
masks: a gathered product packs its weight at every run (measured on a Zen 3 at 160 rows: 6.3 ms
plus 1.65 ms per 1,000 candidates, against 12.9 ms for the whole layer)."""


@dataclass(frozen=True)
class Candidates:
    """The step's output-layer inputs for one batch layout."""

    feed: dict[str, np.ndarray]  # the gathered INPUTS, or row_bias alone (the whole vocabulary), or per row
    always: int = 0  # per row: the always-words every row is scored over besides its own (``shortlist_rows``)

    @property
    def gathered(self) -> bool:
        return "candidates" in self.feed

    @property
    def per_row(self) -> bool:
        """Each row's own candidates (``service.decoding.shortlist_rows``), no union."""
        return "row_counts" in self.feed

    @property
    def width(self) -> int:
        """Words a row is scored over: the union's (padded), or the widest row's."""
        return self.always + int(self.feed["row_counts"].max()) if self.per_row else self.feed["row_bias"].shape[1]


def _row_bias(layer: OutputLayer, texts: Sequence[np.ndarray], beams: Sequence[int], width: int,
              columns: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """(rows, width): each text's ``beams`` rows hold the output bias at its own candidates'
    columns (``columns(ids)``) and ``NEG_LARGE`` elsewhere."""
    per_text = np.full((len(texts), width), NEG_LARGE, dtype=np.float32)  # (texts, width)
    for i, ids in enumerate(texts):
        per_text[i, columns(ids)] = layer.bias[ids]
    beams = np.asarray(beams)
    return per_text if np.all(beams == 1) else np.repeat(per_text, beams, axis=0)


def candidates(layer: OutputLayer, texts: Sequence[np.ndarray], beams: Sequence[int], *, pad_id: int
               ) -> Candidates:
    """The union of the texts' candidates, each text's ``beams`` rows masked to its own: gathered
    (padded to a multiple of ``ALIGN`` with masked ``pad_id`` columns) while the union is at most
    ``MAX_GATHERED_SHARE`` of the vocabulary, else over the whole vocabulary."""
    vocab = len(layer.scale)
    present = np.zeros(vocab, dtype=bool)
    for ids in texts:
        present[ids] = True
    union = np.flatnonzero(present)
    if len(union) > MAX_GATHERED_SHARE * vocab:
        return Candidates(feed={"row_bias": _row_bias(layer, texts, beams, vocab, lambda ids: ids)})
    width = -(-len(union) // ALIGN) * ALIGN
    position = np.zeros(vocab, dtype=np.int64)
    position[union] = np.arange(len(union))
    union = np.concatenate([union, np.full(width - len(union), pad_id, dtype=np.int64)])
    return Candidates(feed={"shortlist_weight": np.take(layer.weight, union, axis=1),  # (out_size, width)
                            "shortlist_scale": layer.scale[union], "candidates": union,
                            "row_bias": _row_bias(layer, texts, beams, width, lambda ids: position[ids])})
