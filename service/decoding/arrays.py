"""What the runtime's encoder and decoder step give back, and the context a step reads
(``service.decoding.runtime``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SLOTS = "slots"
"""The step feed's entry (not a graph input) giving, with a slotted context, where each row's keys and
annotations lie (``Context.slots``; read by the fused attention, ``service.decoding.fused``)."""


@dataclass(frozen=True)
class EncoderOutput:
    annotations: np.ndarray  # (batch, src_len, ctx_size)
    keys: np.ndarray  # (batch, src_len, key_size)
    init_state: np.ndarray  # (batch, state_size)


@dataclass(frozen=True)
class StepOutput:
    topk_log_probs: np.ndarray  # (rows, k), descending
    topk_ids: np.ndarray  # (rows, k) int64
    attention: np.ndarray  # (rows, src_len)
    next_state: Any  # (rows, state_size): numpy on CPU, an OrtValue on CUDA


@dataclass(frozen=True)
class Context:
    """The per-row encoder outputs a decoder step reads, where the provider wants them."""

    annotations: Any  # (rows, src_len, ctx_size)
    keys: Any  # (rows, src_len, key_size)
    src_mask: Any  # (rows, src_len) bool
    packed: dict[str, np.ndarray] | None = None  # the packed attention's indices (``service.decoding.packed``)
    slots: np.ndarray | None = None  # (rows,) each row's place in annotations and keys (None: row r at r)
