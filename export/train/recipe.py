"""The recipe's levers beyond Adam and clipping (issue 30), each off by default.

- ``lr_at``: linear warm-up over ``warmup_steps``, then either the plateau rule (halve the rate
  when the validation BLEU stalls, the trainer's default) or an inverse square-root decay
  (``rsqrt``), which needs no validation and no budget, so a resumed run decays as one run would.
- ``WeightAverage``: an exponential moving average of the weights (Marian's
  ``--exponential-smoothing``), updated after every optimizer step, written as ``ema.pt``.
- ``bleu_pairs``: the validation pairs decoded for BLEU, the first ``bleu_slice`` (short
  messages, mostly) plus the ``valid_long`` longest of the rest, so that ``best.pt`` is not chosen
  on short messages alone.
- ``average_weights``: the mean of several checkpoints' weights (OpenNMT-py's
  ``average_models``), for averaging the checkpoints a run keeps (``keep_checkpoints``).
- ``bf16_autocast``: whether the forward pass runs under bf16 autocast: ``auto`` where the CPU
  has bf16 instructions (AMX or AVX-512 BF16), where it is a throughput lever; elsewhere bf16 is
  emulated and slower.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

SCHEDULES = ("plateau", "rsqrt")
BF16_SETTINGS = ("off", "auto", "on")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def bf16_autocast(setting: str, flags) -> tuple[bool, str]:
    """(autocast on?, why), from ``--bf16`` and the CPU's flags."""
    if setting not in BF16_SETTINGS:
        raise ValueError(f"bf16: {setting!r} is not one of {', '.join(BF16_SETTINGS)}")
    found = sorted(set(flags) & set(BF16_FLAGS))
    if setting == "off":
        return False, "off (--bf16 off)"
    if setting == "on":
        return True, "on (asked)" + ("" if found else "; this CPU has no bf16 instructions: emulated, slower")
    if found:
        return True, f"on (auto: the CPU has {', '.join(found)})"
    return False, "off (auto: no AMX or AVX-512 BF16 on this CPU)"


def lr_at(step: int, base: float, warmup_steps: int, schedule: str) -> float | None:
    """The learning rate for update ``step`` (1-based), or None where the plateau rule owns it.

    Warm-up: ``base * step / warmup_steps`` up to ``warmup_steps``. After it, ``rsqrt`` gives
    ``base * sqrt(warmup_steps / step)``; the plateau rule leaves the rate as its scheduler set it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule == "rsqrt" and warmup_steps <= 0:
        raise ValueError(f"warmup_steps: the rsqrt schedule decays from the end of a warm-up; got {warmup_steps}")
    if warmup_steps > 0 and step <= warmup_steps:
        return base * step / warmup_steps
    if schedule == "rsqrt":
        return base * math.sqrt(warmup_steps / step)
    return None


class WeightAverage:
    """An exponential moving average of a model's floating-point parameters and buffers."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay: {decay} is not between 0 and 1 (exclusive)")
        self.decay = decay
        state = model.state_dict()
        self.shadow = {k: v.detach().clone() for k, v in state.items() if v.is_floating_point()}
        # the model's own tensors, updated in place by the optimizer and by load_state_dict
        self._live = [state[k] for k in self.shadow]

    def update(self) -> None:
        """shadow += (1 - decay) * (weights - shadow), in one fused pass over every tensor."""
        with torch.no_grad():
            torch._foreach_lerp_(list(self.shadow.values()), self._live, 1.0 - self.decay)

    @contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` holding the averaged weights inside the block, its own weights again after."""
        own = {k: v.detach().clone() for k, v in model.state_dict().items() if k in self.shadow}
        model.load_state_dict(self.shadow, strict=False)
        try:
            yield model
        finally:
            model.load_state_dict(own, strict=False)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("ema: the saved average has other tensors than the model")
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


def bleu_pairs(pairs: list, bleu_slice: int, valid_long: int) -> list:
    """The first ``bleu_slice`` pairs plus the ``valid_long`` longest (in source words) of the rest."""
    head, rest = pairs[:bleu_slice], pairs[bleu_slice:]
    longest = sorted(range(len(rest)), key=lambda i: (-len(rest[i].src_raw.split()), i))[:max(valid_long, 0)]
    return head + [rest[i] for i in sorted(longest)]


def average_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the checkpoints' weights, in fp32."""
    from export.train.checkpoint import CheckpointError, load_checkpoint

    if not paths:
        raise CheckpointError("average: no checkpoints given")
    first = load_checkpoint(paths[0])
    total = {k: v.float().clone() for k, v in first.weights.items()}
    for path in paths[1:]:
        ckpt = load_checkpoint(path)
        if ckpt.config != first.config:
            raise CheckpointError(f"{path}: another model config than {paths[0]}; only one run's checkpoints average")
        for k, v in ckpt.weights.items():
            total[k] += v.float()
    return {k: v / len(paths) for k, v in total.items()}
