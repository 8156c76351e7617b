"""The numeric checks of ``nmt verify``: the serving runtime and engine against PyTorch.

Each check drives ``service.decoding.runtime.Runtime`` (the sessions the server
runs, with its session options) or the serving engine itself, so what is
verified is what serves: encoder and per-step parity on random padded batches
over a grid of shapes, padding invariance, and end-to-end greedy parity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from export.data.pairs import read_split
from export.train.model import RNNSearch
from export.train.search import greedy
from service.decoding.engine import Engine
from service.decoding.layout import pad_sources, width
from service.decoding.runtime import Runtime
from service.interface import Prepared
from service.models.manifest import (DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS,
                              Manifest)
from service.options import DecodingOptions
from service.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

DYNAMIC_AXES = frozenset({"batch", "rows", "src_len", "k"})
"""Contract axis names that must stay symbolic in the graphs."""
GRID_BATCHES = (1, 2, 7, 32)
GRID_SRC_LENS = (1, 5, 40)
STEPS = 3  # decoder steps checked per random batch
TOP_K = 4
PADDING_LEN, PADDING_EXTRA, PADDING_ROWS = 5, 7, 4  # sentence length, padding added, batch rows
PADDING_TRIALS = 4  # random batches of the padding check
GREEDY_BATCH = 32
GREEDY_MAX_LEN, GREEDY_MAX_RATIO = 200, 3.0
RANDOM_SOURCES, RANDOM_MAX_LEN = 64, 20  # greedy parity without a test split
FIRST_ID = EOS_ID + 1  # ids below are special tokens
ORT_ERRORS = (ort_state.Fail, ort_state.InvalidArgument, ort_state.RuntimeException,
              ort_state.InvalidGraph, ort_state.NotImplemented)


@dataclass(frozen=True)
class Tolerances:
    """Pass thresholds for one precision (max absolute differences)."""

    encoder: float  # annotations, keys, init_state vs PyTorch
    step: float  # log_probs, top-k values, next_state, attention vs PyTorch
    padding: float  # a sentence alone vs inside a longer padded batch
    greedy: float | None  # min share of token-identical greedy outputs; None: reported only


@dataclass(frozen=True)
class Check:
    """One row of the verification table."""

    name: str
    figure: str  # what was measured, as shown
    threshold: str  # what passes, as shown
    ok: bool
    key: str | None = None  # name of the figure in the manifest's ``parity``
    value: float | int | str | None = None  # the figure, for the manifest
    extra: dict = field(default_factory=dict)  # more manifest figures (what was measured on)


def max_diff(*pairs: tuple[np.ndarray, np.ndarray]) -> float:
    """Largest |a - b| over pairs of equally shaped arrays (a shape mismatch raises)."""
    worst = 0.0
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise ValueError(f"shape {a.shape} where PyTorch gives {b.shape}")
        worst = max(worst, float(np.abs(a.astype(np.float64) - b).max(initial=0.0)))
    return worst


def random_batch(rng: np.random.Generator, *, batch: int, src_len: int, vocab_size: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Random sources, EOS last, PAD after; mixed lengths, the first row full."""
    lengths = rng.integers(1, src_len + 1, size=batch)
    lengths[0] = src_len
    src = np.full((batch, src_len), PAD_ID, dtype=np.int64)  # (batch, src_len)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = rng.integers(FIRST_ID, vocab_size, size=n - 1)
        src[row, n - 1] = EOS_ID
    return src, lengths.astype(np.int64)


def declared_axes(manifest: Manifest, precision: str) -> list[str]:
    """Problems with the graphs' declared shapes: contract-dynamic axes fixed."""
    files = manifest.graphs[precision]
    problems = []
    for file, contract in ((files.encoder, {**ENCODER_INPUTS, **ENCODER_OUTPUTS}),
                           (files.decoder_step, {**DECODER_INPUTS, **DECODER_OUTPUTS})):
        graph = onnx.load(str(manifest.path(file)), load_external_data=False).graph
        for value in list(graph.input) + list(graph.output):
            dims = value.type.tensor_type.shape.dim
            for axis, dim in zip(contract.get(value.name, []), dims):
                if axis in DYNAMIC_AXES and not dim.dim_param:
                    problems.append(f"{file}: {value.name} axis {axis!r} fixed to {dim.dim_value}")
    return problems


def encode(runtime: Runtime, src: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """annotations, keys, init_state of the serving runtime's encoder."""
    out = runtime.encode(src, lengths)
    return [out.annotations, out.keys, out.init_state]


def run_step(runtime: Runtime, prev: np.ndarray, state: np.ndarray, annotations: np.ndarray,
         keys: np.ndarray, src_mask: np.ndarray, *, k: int) -> dict[str, np.ndarray]:
    """Every output of the serving runtime's decoder step."""
    return runtime.step_outputs(prev, state, runtime.context(annotations, keys, src_mask), k)


@torch.inference_mode()
def compare_batch(runtime: Runtime, model: RNNSearch, src: np.ndarray, lengths: np.ndarray,
                  rng: np.random.Generator) -> tuple[float, float]:
    """(encoder, step) max |ONNX - PyTorch| on one padded batch, STEPS decoder steps."""
    ann, keys, state = model.encoder(torch.from_numpy(src), torch.from_numpy(lengths))
    encoder = max_diff(*zip(encode(runtime, src, lengths), (ann.numpy(), keys.numpy(), state.numpy())))
    mask = torch.from_numpy(src != PAD_ID)  # (batch, src_len)
    prev = torch.full((len(src),), BOS_ID, dtype=torch.long)
    k = min(TOP_K, model.config.tgt_vocab_size)
    step = 0.0
    for _ in range(STEPS):
        out = run_step(runtime, prev.numpy(), state.numpy(), ann.numpy(), keys.numpy(), mask.numpy(), k=k)
        log_probs, next_state, alpha = model.step_log_probs(prev, state, ann, keys, mask)
        step = max(step, max_diff((out["log_probs"], log_probs.numpy()),
                                  (out["topk_log_probs"], log_probs.topk(k, dim=1).values.numpy()),
                                  (out["next_state"], next_state.numpy()),
                                  (out["attention"], alpha.numpy())))
        state = next_state  # both sides get the same inputs: per-step error, not drift
        prev = torch.from_numpy(rng.integers(FIRST_ID, model.config.tgt_vocab_size, size=len(src)))
    return encoder, step


def check_grid(runtime: Runtime, model: RNNSearch, manifest: Manifest, precision: str,
               tol: Tolerances, rng: np.random.Generator) -> list[Check]:
    """Dynamic axes, encoder parity and step parity over the batch x src_len grid."""
    problems = declared_axes(manifest, precision)
    encoder = step = float("nan")
    ran = 0
    for batch in GRID_BATCHES:
        for src_len in GRID_SRC_LENS:
            src, lengths = random_batch(rng, batch=batch, src_len=src_len,
                                        vocab_size=model.config.src_vocab_size)
            try:
                e, s = compare_batch(runtime, model, src, lengths, rng)
            except (*ORT_ERRORS, ValueError) as err:
                problems.append(f"batch {batch} src_len {src_len}: {str(err).splitlines()[0][:100]}")
                continue
            encoder, step, ran = np.fmax(encoder, e), np.fmax(step, s), ran + 1
    shapes = len(GRID_BATCHES) * len(GRID_SRC_LENS)
    grid = f"batch {','.join(map(str, GRID_BATCHES))} x src_len {','.join(map(str, GRID_SRC_LENS))}"
    return [
        Check("dynamic axes", problems[0] if problems else f"{ran}/{shapes} shapes ran", grid,
              not problems, key="dynamic_shapes_ran", value=ran),
        Check("encoder parity", f"{encoder:.2e}", f"<= {tol.encoder:g}", bool(encoder <= tol.encoder),
              key="encoder_max_abs_diff", value=float(encoder)),
        Check("step parity", f"{step:.2e}", f"<= {tol.step:g}", bool(step <= tol.step),
              key="step_max_abs_diff", value=float(step)),
    ]


def check_padding(runtime: Runtime, vocab_sizes: tuple[int, int], tol: Tolerances,
                  rng: np.random.Generator) -> Check:
    """A sentence alone vs row 0 of a batch padded to a longer source, each as wide as the server
    makes it (``service.decoding.layout.width``), over ``PADDING_TRIALS`` batches: the same bits
    are expected (``tol.padding`` 0)."""
    n, padded = PADDING_LEN, width(PADDING_LEN + PADDING_EXTRA)
    alone_width = width(n)
    diff = 0.0
    try:
        for _ in range(PADDING_TRIALS):
            src, lengths = random_batch(rng, batch=PADDING_ROWS, src_len=padded, vocab_size=vocab_sizes[0])
            src[0], lengths[0] = PAD_ID, n
            src[0, :n] = random_batch(rng, batch=1, src_len=n, vocab_size=vocab_sizes[0])[0][0]
            src[1, :] = random_batch(rng, batch=1, src_len=padded, vocab_size=vocab_sizes[0])[0][0]
            lengths[1] = padded
            alone_src, alone_len = src[:1, :alone_width], lengths[:1]
            alone, together = encode(runtime, alone_src, alone_len), encode(runtime, src, lengths)
            diff = max(diff, max_diff(*((a[0, :n], t[0, :n]) for a, t in zip(alone[:2], together[:2])),
                                      (alone[2][0], together[2][0])))
            a_state, t_state = alone[2], together[2]
            prev = np.full(PADDING_ROWS, BOS_ID, dtype=np.int64)
            for _ in range(STEPS):
                a = run_step(runtime, prev[:1], a_state, alone[0], alone[1], alone_src != PAD_ID, k=1)
                t = run_step(runtime, prev, t_state, together[0], together[1], src != PAD_ID, k=1)
                diff = max(diff, max_diff((a["log_probs"][0], t["log_probs"][0]),
                                          (a["next_state"][0], t["next_state"][0]),
                                          (a["attention"][0], t["attention"][0, :alone_width]),
                                          (np.zeros(padded - alone_width), t["attention"][0, alone_width:])))
                a_state, t_state = a["next_state"], t["next_state"]
                prev = rng.integers(FIRST_ID, vocab_sizes[1], size=PADDING_ROWS).astype(np.int64)
    except ORT_ERRORS as err:
        return Check("padding invariance", str(err).splitlines()[0][:100], f"<= {tol.padding:g}", False)
    return Check("padding invariance", f"{diff:.2e}", f"<= {tol.padding:g}", diff <= tol.padding,
                 key="padding_max_abs_diff", value=diff)


def engine_greedy(engine: Engine, sources: list[list[int]]) -> list[list[int]]:
    """Greedy target ids from the serving engine itself (``service.decoding.engine``): the parity
    check covers the code that serves, not a second decoding loop."""
    options = DecodingOptions(max_decoding_length=GREEDY_MAX_LEN, max_length_ratio=GREEDY_MAX_RATIO)
    decoded = engine.decode([Prepared(text="", source_ids=tuple(ids), source_pieces=tuple(map(str, ids)),
                                      placeholders=(), options=options) for ids in sources])
    return [list(d.hypotheses[0].tokens) for d in decoded]


def check_greedy(engine: Engine, model: RNNSearch, sources: list[list[int]], label: str,
                 tol: Tolerances) -> Check:
    """Share of sentences whose ONNX greedy output is token-identical to PyTorch's."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # little padding
    identical = 0
    threshold = "reported" if tol.greedy is None else f">= {tol.greedy:.1%}"
    for start in range(0, len(order), GREEDY_BATCH):
        src, lengths = pad_sources([sources[i] for i in order[start:start + GREEDY_BATCH]], PAD_ID)
        ref = greedy(model, torch.from_numpy(src), torch.from_numpy(lengths), max_len=GREEDY_MAX_LEN,
                     max_ratio=GREEDY_MAX_RATIO)
        try:
            got = engine_greedy(engine, [sources[i] for i in order[start:start + GREEDY_BATCH]])
        except ORT_ERRORS as err:
            return Check(f"greedy parity ({label})", str(err).splitlines()[0][:100], threshold, False)
        identical += sum(r.tokens == g for r, g in zip(ref, got))
    share = identical / max(len(sources), 1)
    return Check(f"greedy parity ({label})", f"{share:.2%} of {len(sources)}", threshold,
                 tol.greedy is None or share >= tol.greedy, key="greedy_identical_share", value=share,
                 extra={"greedy_sentences": len(sources), "greedy_source": label})


def greedy_sources(manifest: Manifest, test_split: Path | None, max_sentences: int | None,
                   vocab_size: int, rng: np.random.Generator) -> tuple[list[list[int]], str]:
    """Test-split sources as the service encodes them, or random ones without a split."""
    if test_split is None:
        lengths = rng.integers(1, RANDOM_MAX_LEN + 1, size=RANDOM_SOURCES)
        sources = [rng.integers(FIRST_ID, vocab_size, size=n - 1).tolist() + [EOS_ID] for n in lengths]
        return sources[:max_sentences], "random sources"
    tok = Tokenizer(manifest.path(manifest.source_tokenizer), manifest.path(manifest.target_tokenizer))
    pairs = read_split(test_split)[:max_sentences]
    return [tok.encode(p.src_raw).ids for p in pairs], test_split.name


