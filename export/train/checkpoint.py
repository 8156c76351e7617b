"""Self-contained checkpoints: model config, weights, both SentencePiece models."""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from export.train.model import RNNSearch
from service.models.attention import KINDS
from service.models.config import ModelConfig

KIND = "nmt-serve/rnnsearch/v1"


class CheckpointError(Exception):
    """A one-line problem with a checkpoint file, naming the path."""


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizers: dict[str, bytes]  # "source.model", "target.model": SentencePiece protos
    extra: dict  # training state, optimizer (absent from shipped checkpoints)

    def model(self) -> RNNSearch:
        model = RNNSearch(self.config)
        try:
            model.load_state_dict({k: v.float() for k, v in self.weights.items()})
        except RuntimeError as e:
            kind = weights_kind(self.weights, self.config)
            if kind is not None and kind != self.config.attention:
                raise CheckpointError(f"the weights are an attention {kind!r} model's, but the config says "
                                      f"attention {self.config.attention!r} (one of {', '.join(KINDS)})") from None
            raise CheckpointError(f"weights do not fit the config: {str(e).splitlines()[0]}") from None
        return model.eval()


def weights_kind(weights: dict[str, torch.Tensor], config: ModelConfig) -> str | None:
    """The attention kind whose parameter names and shapes ``weights`` has, if exactly one."""
    fits = []
    for kind in KINDS:
        try:
            other = RNNSearch(replace(config, attention=kind))
        except ValueError:
            continue
        shapes = {k: tuple(v.shape) for k, v in other.state_dict().items()}
        if shapes == {k: tuple(v.shape) for k, v in weights.items()}:
            fits.append(kind)
    return fits[0] if len(fits) == 1 else None


def save_checkpoint(path: Path, model: RNNSearch, tokenizers: dict[str, bytes], *,
                    extra: dict | None = None, half: bool = False) -> None:
    """Write atomically (the directory made if needed); ``half`` stores fp16 weights (the shipped,
    smaller file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: (v.half() if half and v.is_floating_point() else v).clone()
               for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    torch.save({"kind": KIND, "config": model.config.to_dict(), "model": weights,
                "tokenizers": tokenizers, "extra": extra or {}}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and check a checkpoint; every problem is a one-line CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint does not exist")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError, io.UnsupportedOperation) as e:
        raise CheckpointError(f"{path}: not a PyTorch checkpoint ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise CheckpointError(f"{path}: not an nmt-serve RNNsearch checkpoint (kind {raw.get('kind') if isinstance(raw, dict) else type(raw).__name__!r})")
    try:  # the manifest's form, checked the same way: a field named, not a TypeError
        config = ModelConfig.from_dict(raw.get("config"), where="config")
    except ValueError as e:
        raise CheckpointError(f"{path}: bad model config ({e})") from None
    ckpt = Checkpoint(config=config, weights=raw["model"], tokenizers=raw.get("tokenizers", {}),
                      extra=raw.get("extra", {}))
    try:
        ckpt.model()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return ckpt


def release(checkpoint: Path, output: Path, *, average: list[Path] = ()) -> None:
    """The shipped form of a checkpoint: fp16 weights, training state kept, optimizer dropped.

    With ``average``, the weights are the mean of ``checkpoint``'s and theirs (checkpoints of one
    run, as OpenNMT-py's ``average_models``); the training state is ``checkpoint``'s."""
    ckpt = load_checkpoint(checkpoint)
    extra = {k: v for k, v in ckpt.extra.items() if k not in ("optimizer", "scheduler", "ema")}
    model = ckpt.model()
    if average:
        from export.train.recipe import average_weights

        model.load_state_dict(average_weights([checkpoint, *average]))
        extra["averaged"] = [str(p) for p in (checkpoint, *average)]
    save_checkpoint(output, model, ckpt.tokenizers, extra=extra, half=True)
