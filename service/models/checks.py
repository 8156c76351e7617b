"""A loaded engine's graphs and tokenizers against its manifest's ``model_config``: checksums
prove the files are the ones listed, not that they belong together (``service.app.check_engine``)."""

from __future__ import annotations

from typing import Any

from service.errors import ModelRepositoryError
from service.models.manifest import (DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS,
                                     MANIFEST, SIZES, Manifest)


def check_graphs(manifest: Manifest, precision: str, shapes: dict[str, dict[str, list[Any]]]) -> None:
    """The graphs' fixed dimensions must be ``model_config``'s. ``shapes``: graph ("encoder",
    "decoder_step") -> input or output name -> its shape as ONNX Runtime reports it."""
    contract = {"encoder": {**ENCODER_INPUTS, **ENCODER_OUTPUTS},
                "decoder_step": {**DECODER_INPUTS, **DECODER_OUTPUTS}}
    files = manifest.graphs[precision]
    for graph, names in contract.items():
        file = files.encoder if graph == "encoder" else files.decoder_step
        for name, dims in names.items():
            have = shapes.get(graph, {}).get(name, [])
            for axis, (symbol, size) in enumerate(zip(dims, have)):
                want = SIZES[symbol](manifest.model_config) if symbol in SIZES else None
                if want is not None and isinstance(size, int) and size != want:
                    raise ModelRepositoryError(
                        f"{manifest.path(file)}: {name} axis {axis} ({symbol}) is {size}, but "
                        f"{manifest.root / MANIFEST} model_config gives {want}")


def check_vocabularies(manifest: Manifest, *, source: int, target: int) -> None:
    """The tokenizers' piece counts must be model_config's vocabulary sizes, and the target
    tokenizer must not be the source one (a swapped tokenizer serves garbage)."""
    config, mpath = manifest.model_config, manifest.root / MANIFEST
    for side, file, size in (("src", manifest.source_tokenizer, source),
                             ("tgt", manifest.target_tokenizer, target)):
        expected = getattr(config, f"{side}_vocab_size")
        if size != expected:
            raise ModelRepositoryError(f"{manifest.path(file)}: {size} pieces, but {mpath} "
                                       f"model_config.{side}_vocab_size is {expected}")
    files = manifest.files
    if files[manifest.source_tokenizer] == files[manifest.target_tokenizer]:  # same sha256
        raise ModelRepositoryError(f"{manifest.path(manifest.target_tokenizer)}: the target "
                                   f"tokenizer is the source one ({manifest.source_tokenizer})")
