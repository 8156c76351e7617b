"""The int8 products' form for this CPU: u8 x s8 where it is exact and fast, u8 x u8 elsewhere.

The int8 graphs (``export.graphs.quantize``, ``export.graphs.int8_step``) store
every weight as uint8 around a zero point of 128 (``MatMulIntegerToFloat`` with
uint8 A and B): exact on every CPU, but ONNX Runtime's slow form. Its u8 x s8
kernels are the fast form on CPUs with AVX-512 VNNI, AVX-VNNI or AMX, where they
accumulate in 32 bits and are exact; on AVX2 alone they add pairs of products in
saturating 16-bit lanes (``vpmaddubsw``) and are wrong (measured on a Zen 3:
step outputs off by up to 7e3). So the form is chosen per CPU at load:

- ``u8s8``: each uint8 weight ``w`` becomes the int8 ``w - 128`` with zero point 0
  (the same integers: ``(w - 128) - 0 == w - 128``), converted once, in memory;
- ``u8u8``: the graph as shipped.

Because the two forms compute the same integer products, their outputs must be
bit-identical where both are exact. ``known_answer`` runs both on a fixed batch at
load, and a difference (a CPU flag that lies, a kernel that is not exact) falls
back to ``u8u8`` with one log line.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from service import config

log = logging.getLogger("nmt.int8")

CPUINFO = Path("/proc/cpuinfo")
FAST_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""Flags of CPUs whose u8 x s8 kernels accumulate in 32 bits (exact) and are ONNX Runtime's fast
path (VNNI's ``vpdpbusd``, AMX tiles)."""
INT8_PRODUCTS = ("MatMulIntegerToFloat", "MatMulInteger")
ZERO_POINT_U8 = 128
S8_ZERO_POINT = "int8_form/zero_point_s8"


class Int8Form(str, enum.Enum):
    """How the int8 products multiply: activations uint8 by weights uint8 or int8."""

    U8S8 = "u8s8"  # fast and exact with VNNI or AMX
    U8U8 = "u8u8"  # exact everywhere; the graphs as shipped


FormChoice = config.Int8Form
"""``--int8-form``: ``auto`` decides from the CPU's flags."""


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where there is no such file."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def reported_flags(flags: Iterable[str] | None = None) -> list[str]:
    """The flags that decide int8 speed (AVX2, AVX-512, VNNI, AMX) this CPU has: what every
    benchmark's report names beside its figures."""
    return sorted(set(cpu_flags() if flags is None else flags) & {"avx2", "avx512f", *FAST_FLAGS})


def decide(choice: FormChoice, flags: Iterable[str]) -> tuple[Int8Form, str]:
    """The form to try, and why (for the startup log)."""
    if choice is not FormChoice.AUTO:
        return Int8Form(choice.value), "asked (--int8-form)"
    found = sorted(set(flags) & set(FAST_FLAGS))
    if found:
        return Int8Form.U8S8, f"the CPU has {', '.join(found)}: u8 x s8 is exact and fast"
    return Int8Form.U8U8, "no VNNI or AMX: u8 x s8 would saturate 16-bit sums (AVX2)"


def to_s8(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` whose int8 products read int8 weights (``w - 128``, zero point 0), and
    how many products changed. A product whose weight is not a uint8 constant with the constant
    zero point 128 is left as it is."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    converted: set[str] = set()
    changed = 0
    for node in out.graph.node:
        if node.op_type not in INT8_PRODUCTS or len(node.input) < 2:
            continue
        weight_at, zero_at = (1, 5) if node.op_type == "MatMulIntegerToFloat" else (1, 3)
        weight = inits.get(node.input[weight_at])
        zero = inits.get(node.input[zero_at]) if len(node.input) > zero_at else None
        if (weight is None or zero is None or weight.data_type != onnx.TensorProto.UINT8
                or not _is_u8_128(zero)):
            continue
        if weight.name not in converted:
            values = numpy_helper.to_array(weight).astype(np.int16) - ZERO_POINT_U8  # (in, out)
            weight.CopyFrom(numpy_helper.from_array(values.astype(np.int8), weight.name))
            converted.add(weight.name)
        node.input[zero_at] = S8_ZERO_POINT
        changed += 1
    if changed:
        out.graph.initializer.append(numpy_helper.from_array(np.array(0, dtype=np.int8), S8_ZERO_POINT))
    if any(_shared_elsewhere(out, name) for name in converted):
        raise ValueError("an int8 weight is read by a node other than an int8 product")
    return out, changed


def _is_u8_128(tensor: onnx.TensorProto) -> bool:
    if tensor.data_type != onnx.TensorProto.UINT8:
        return False
    values = numpy_helper.to_array(tensor)
    return values.size == 1 and int(values.reshape(-1)[0]) == ZERO_POINT_U8


def _shared_elsewhere(model: onnx.ModelProto, name: str) -> bool:
    """Whether ``name`` feeds anything but the weight input of an int8 product."""
    return any(value == name and not (node.op_type in INT8_PRODUCTS and position == 1)
               for node in model.graph.node for position, value in enumerate(node.input))


Run = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


def known_answer(shipped: Run, converted: Run, feed: Mapping[str, np.ndarray]) -> str | None:
    """None when both forms give bit-identical outputs on ``feed``, else what differed."""
    for i, (a, b) in enumerate(zip(shipped(feed), converted(feed))):
        if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b):
            diff = (float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
                    if a.shape == b.shape else float("nan"))
            return f"output {i} differs (max |diff| {diff:.3g})"
    return None


def step_feed(*, rows: int, src_len: int, state_size: int, ctx_size: int, key_size: int,
              vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A fixed decoder-step batch in the ranges the model produces: states and annotations in
    [-1, 1] (GRU outputs), keys of a few units, every row with masked padding columns."""
    rng = np.random.default_rng(seed)
    mask = np.arange(src_len)[None, :] < rng.integers(1, src_len, size=rows)[:, None]  # (rows, src_len)
    return {"prev_tokens": rng.integers(0, vocab_size, size=rows).astype(np.int64),
            "state": rng.uniform(-1, 1, (rows, state_size)).astype(np.float32),
            "annotations": rng.uniform(-1, 1, (rows, src_len, ctx_size)).astype(np.float32),
            "keys": rng.normal(0, 2, (rows, src_len, key_size)).astype(np.float32),
            "src_mask": mask, "k": np.array(min(10, vocab_size), dtype=np.int64)}


def source_vocabulary(encoder: onnx.ModelProto) -> int:
    """Rows of the encoder's embedding table: the first ``Gather`` of ``src_ids`` from a constant."""
    inits = {t.name: t for t in encoder.graph.initializer}
    for node in encoder.graph.node:
        if node.op_type == "Gather" and node.input[0] in inits and node.input[1] == "src_ids":
            return int(inits[node.input[0]].dims[0])
    raise ValueError("the encoder has no Gather of src_ids from a constant table")


def encoder_feed(*, batch: int, src_len: int, vocab_size: int, eos: int, seed: int = 0
                 ) -> dict[str, np.ndarray]:
    """A fixed encoder batch: random pieces, EOS last, rows of different lengths, padded with 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, src_len + 1, size=batch)
    lengths[0] = src_len
    src = np.zeros((batch, src_len), dtype=np.int64)
    for row, n in enumerate(lengths):
        src[row, :n] = rng.integers(eos + 1, vocab_size, size=n)
        src[row, n - 1] = eos
    return {"src_ids": src, "src_lengths": lengths.astype(np.int64)}
