"""Export a checkpoint to a model repository: ONNX graphs, tokenizers, manifest.

``nmt export CHECKPOINT --output models/<name>/<version> [--quantize int8]``
writes the encoder and decoder-step graphs (names and axes as in
``service/manifest.py``), optionally their int8 variants (batch-invariant,
see ``export.quantize``), both
SentencePiece models and ``manifest.json``. Everything is written to a
temporary directory beside the output and verified there (``export.verify``)
before it is moved into place; an existing output is kept unless ``--force``.

Both graphs use the TorchScript exporter (``dynamo=False``): it turns
``pack_padded_sequence`` into an ONNX GRU with ``sequence_lens``, so padding
never reaches the backward direction; the dynamo exporter drops it. The
example batch has several rows of different lengths, since a batch of one
can freeze the batch axis; the verifier proves the axes stay dynamic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import onnx
import torch
from torch import nn

from export.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from export.int8_encoder import write_int8_encoder
from export.int8_step import write_int8_step
from export.model import RNNSearch
from export.quantize import SCHEME as INT8_SCHEME
from export.quantize import quantize_graph
from export.verify import DYNAMIC_AXES, VerificationError, verify_repository
from service.models.manifest import (DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS,
                                     FORMAT, SIZES, checksums, load_manifest, sha256_file, write_manifest)
from service.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

OPSET = 17
GRAPHS = {"fp32": {"encoder": "encoder.onnx", "decoder_step": "decoder_step.onnx"},
          "int8": {"encoder": "encoder.int8.onnx", "decoder_step": "decoder_step.int8.onnx"}}
TOKENIZERS = {"source": "source.model", "target": "target.model"}
EXAMPLE_LENGTHS = (4, 6, 2)  # batch >= 2, lengths differ: no axis specializes on the example
EXAMPLE_K = 3
PRODUCERS = ("torch", "onnx", "onnxruntime", "onnxscript", "nmt-serve")


class EncoderGraph(nn.Module):
    """(src_ids, src_lengths) -> (annotations, keys, init_state)."""

    def __init__(self, model: RNNSearch) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, src_ids: torch.Tensor, src_lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.encoder(src_ids, src_lengths)


class DecoderStepGraph(nn.Module):
    """One decoder step plus the top-k of its log-probabilities (k is an input)."""

    def __init__(self, model: RNNSearch) -> None:
        super().__init__()
        self.model = model

    def forward(self, prev_tokens: torch.Tensor, state: torch.Tensor, annotations: torch.Tensor,
                keys: torch.Tensor, src_mask: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        log_probs, next_state, attention = self.model.step_log_probs(
            prev_tokens, state, annotations, keys, src_mask)  # (rows, vocab_size)
        # a tensor k is traced as a graph input, not baked in as a constant
        topk_log_probs, topk_ids = torch.topk(log_probs, k, dim=1)  # (rows, k)
        return log_probs, topk_log_probs, topk_ids, next_state, attention


def dynamic_axes(*contracts: dict[str, list[str]]) -> dict[str, dict[int, str]]:
    """The contract's symbolic axes, in the exporter's ``dynamic_axes`` form."""
    return {name: {i: axis for i, axis in enumerate(axes) if axis in DYNAMIC_AXES}
            for contract in contracts for name, axes in contract.items()
            if any(axis in DYNAMIC_AXES for axis in axes)}


def example_inputs(model: RNNSearch) -> tuple[tuple, tuple]:
    """Example arguments for tracing both graphs."""
    cfg = model.config
    lengths = torch.tensor(EXAMPLE_LENGTHS)  # (batch,)
    src = torch.full((len(lengths), max(EXAMPLE_LENGTHS)), PAD_ID, dtype=torch.long)  # (batch, src_len)
    for row, n in enumerate(EXAMPLE_LENGTHS):
        src[row, : n - 1] = EOS_ID + 1 + torch.arange(n - 1) % max(cfg.src_vocab_size - EOS_ID - 1, 1)
        src[row, n - 1] = EOS_ID
    with torch.inference_mode():
        annotations, keys, state = model.encoder(src, lengths)
    prev = torch.full((len(lengths),), BOS_ID, dtype=torch.long)  # (rows,)
    k = torch.tensor(min(EXAMPLE_K, cfg.tgt_vocab_size))
    return (src, lengths), (prev, state.clone(), annotations.clone(), keys.clone(), src != PAD_ID, k)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence exporter and quantizer chatter: Python warnings, root-logger advice
    and C++ shape-inference warnings on fd 2 (replayed if the export fails)."""
    root, level = logging.getLogger(), logging.getLogger().level
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root.setLevel(logging.ERROR)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            sys.stderr.write(sink.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            root.setLevel(level)


def export_graphs(model: RNNSearch, root: Path, *, quantize: bool, int8_encoder: str = "quantized") -> None:
    """Write the fp32 graphs (and their int8 variants) into ``root``."""
    encoder_args, decoder_args = example_inputs(model)
    jobs = ((EncoderGraph(model), encoder_args, GRAPHS["fp32"]["encoder"], ENCODER_INPUTS, ENCODER_OUTPUTS),
            (DecoderStepGraph(model), decoder_args, GRAPHS["fp32"]["decoder_step"], DECODER_INPUTS,
             DECODER_OUTPUTS))
    with quiet(), torch.inference_mode():
        for module, args, file, inputs, outputs in jobs:
            torch.onnx.export(module.eval(), args, str(root / file), input_names=list(inputs),
                              output_names=list(outputs), dynamic_axes=dynamic_axes(inputs, outputs),
                              opset_version=OPSET, dynamo=False)
            declare_inputs(root / file, inputs, model.config.to_dict())
        if quantize:
            # the step is built from the weights, with few passes around its products
            # (``export.int8_step``); the encoder is the fp32 graph with its products in int8 and
            # its GRU op left fp32: the all-int8 encoder (``export.int8_encoder``, the GRU as int8
            # cell steps in a Scan) was slower at 2 threads for every join size the server sees
            # (``loadtest/results/notes.md``), so it is built only with ``int8_encoder="scan"``
            # (both built from the weights are RNNsearch's; the other kinds' step is the generic
            # rewrite of its fp32 graph, batch-invariant the same way)
            bahdanau = model.config.attention == "bahdanau"
            if int8_encoder == "scan" and bahdanau:
                write_int8_encoder(model, root / GRAPHS["int8"]["encoder"])
            else:
                quantize_graph(root / GRAPHS["fp32"]["encoder"], root / GRAPHS["int8"]["encoder"])
            if bahdanau:
                write_int8_step(model, root / GRAPHS["int8"]["decoder_step"])
            else:
                quantize_graph(root / GRAPHS["fp32"]["decoder_step"], root / GRAPHS["int8"]["decoder_step"])


ONNX_TYPES = {"prev_tokens": onnx.TensorProto.INT64, "src_ids": onnx.TensorProto.INT64,
              "src_lengths": onnx.TensorProto.INT64, "k": onnx.TensorProto.INT64,
              "src_mask": onnx.TensorProto.BOOL}  # the others are float32


def declare_inputs(path: Path, contract: dict[str, list[str]], config: dict) -> None:
    """Give the graph back the contract's inputs the exporter pruned because this kind does not
    read them (``none``: annotations, keys; ``luong-dot``: keys): every kind's graph takes the
    same feed. ONNX Runtime accepts an input that no node consumes."""
    graph = onnx.load(str(path))
    have = {i.name for i in graph.graph.input}
    missing = [name for name in contract if name not in have]
    if not missing:
        return
    for name in missing:
        dims = [SIZES[a](config) if a in SIZES else a for a in contract[name]]
        graph.graph.input.append(onnx.helper.make_tensor_value_info(
            name, ONNX_TYPES.get(name, onnx.TensorProto.FLOAT), dims))
    order = list(contract)  # the contract's order, as the exporter writes the others
    inputs = sorted(graph.graph.input, key=lambda i: order.index(i.name))
    del graph.graph.input[:]
    graph.graph.input.extend(inputs)
    onnx.checker.check_model(graph)
    onnx.save(graph, str(path))


def producer_versions() -> dict[str, str]:
    versions = {}
    for package in PRODUCERS:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "absent"
    return versions


def build_manifest(ckpt: Checkpoint, *, checkpoint: Path, output: Path, root: Path, name: str,
                   version: str, precisions: list[str], max_source_tokens: int) -> dict:
    """Every manifest field; ``parity`` is filled after verification, ``quality`` by evaluation."""
    parent = output.resolve().parent
    ckpt_path = checkpoint.resolve()
    files = [*TOKENIZERS.values(), *(f for p in precisions for f in GRAPHS[p].values())]
    graphs = {p: dict(GRAPHS[p]) for p in precisions}
    if "int8" in graphs:
        graphs["int8"]["scheme"] = INT8_SCHEME  # how it was quantized: repositories may differ
    return {
        "format": FORMAT, "name": name, "version": version,
        "languages": {"source": "en", "target": "fr"},
        "model_config": ckpt.config.to_dict(),
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "tokenizers": dict(TOKENIZERS),
        "graphs": graphs,
        "io": {"encoder": {"inputs": ENCODER_INPUTS, "outputs": ENCODER_OUTPUTS},
               "decoder_step": {"inputs": DECODER_INPUTS, "outputs": DECODER_OUTPUTS}},
        "opset": OPSET,
        "producer": producer_versions(),
        # relative to the repository's parent when kept there (models/<name>/), so it moves with it
        "checkpoint": {"file": str(ckpt_path.relative_to(parent)) if ckpt_path.is_relative_to(parent)
                       else str(ckpt_path), "sha256": sha256_file(checkpoint)},
        "limits": {"max_source_tokens": max_source_tokens},
        "parity": {}, "quality": {},
        "files": checksums(root, files),
    }


def write_tokenizers(ckpt: Checkpoint, checkpoint: Path, root: Path) -> None:
    for file in TOKENIZERS.values():
        if not ckpt.tokenizers.get(file):
            raise CheckpointError(f"{checkpoint}: no embedded tokenizer {file!r}")
        (root / file).write_bytes(ckpt.tokenizers[file])


def export_repository(checkpoint: Path, output: Path, *, name: str = "en-fr", version: str = "1",
                      quantize: bool = False, force: bool = False, test_split: Path | None = None,
                      max_source_tokens: int = 200, quality: Path | None = None) -> Path:
    """Export, verify in a temporary directory beside ``output``, then move it into place."""
    checkpoint, output = Path(checkpoint), Path(output)
    if output.exists() and not force:
        raise FileExistsError(f"{output}: already exists (use --force to replace it)")
    ckpt = load_checkpoint(checkpoint)
    model = ckpt.model()
    output.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        write_tokenizers(ckpt, checkpoint, root)
        export_graphs(model, root, quantize=quantize)
        precisions = ["fp32", "int8"] if quantize else ["fp32"]
        manifest = build_manifest(ckpt, checkpoint=checkpoint, output=output, root=root, name=name,
                                  version=version, precisions=precisions,
                                  max_source_tokens=max_source_tokens)
        write_manifest(root, manifest)
        reports = [verify_repository(root, checkpoint=checkpoint, test_split=test_split, precision=p)
                   for p in precisions]
        failures = [f for r in reports for f in r.failures()]
        if failures:
            raise VerificationError(f"{output}: export failed verification: {'; '.join(failures)}")
        manifest["parity"] = {r.precision: r.parity() for r in reports}
        if quality is not None:
            manifest["quality"] = read_quality(quality)
        write_manifest(root, manifest)  # manifest.json itself is not checksummed
        replace(root, output)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return output


def prune_repository(root: Path, keep: list[str]) -> list[str]:
    """Keep only the ``keep`` precisions' graphs in a verified model repository: its shipped form
    where the repository's size counts. The others' graph files are deleted and leave ``graphs``
    and ``files``; what export and ``loadtest/quality_engine.py`` measured on them (``parity``,
    ``quality.engine``) stays, and ``pruned`` keeps each deleted file's sha256, so that a
    re-export from the same checkpoint can be compared with it. Returns the deleted files."""
    root = Path(root)
    manifest = load_manifest(root)  # every checksum first: prune only what export verified
    unknown = [p for p in keep if p not in manifest.graphs]
    if unknown:
        raise ValueError(f"{root}: --keep {unknown[0]!r} is not a precision of the repository "
                         f"(choices: {', '.join(sorted(manifest.graphs))})")
    raw = manifest.raw  # edited in place: the parsed manifest is not used again
    kept = {f for p in keep for f in (manifest.graphs[p].encoder, manifest.graphs[p].decoder_step)}
    deleted = []
    for precision, graph in manifest.graphs.items():
        if precision in keep:
            continue
        raw["graphs"].pop(precision)
        files = [f for f in (graph.encoder, graph.decoder_step) if f not in kept]
        raw.setdefault("pruned", {})[precision] = {f: raw["files"].pop(f) for f in files}
        deleted += files
    write_manifest(root, raw)  # first: the manifest never lists a deleted file
    for f in deleted:
        (root / f).unlink()
    return deleted


def read_quality(results: Path) -> dict:
    """The test-split scores of ``nmt evaluate`` (its results.json) for the manifest."""
    try:
        raw = json.loads(Path(results).read_text())
        decoders = raw["decoders"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{results}: not an nmt evaluate results.json ({e})") from None
    keep = ("bleu", "chrf", "bleu_without_placeholders", "bleu_unseen", "placeholders_kept")
    return {"split": raw.get("split"), "sentences": raw.get("sentences"), "metric": "sacreBLEU/chrF, "
            "detokenized, placeholders restored", "reference_decoder": "pytorch",
            "decoders": {name: {k: d.get(k) for k in keep} for name, d in decoders.items()}}


def replace(new: Path, output: Path) -> None:
    """Move ``new`` to ``output``, replacing an existing one (only with --force)."""
    os.chmod(new, 0o755)  # mkdtemp made it 0700: a server running as another user must read it
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
        os.replace(output, old / output.name)
        os.replace(new, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, output)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nmt export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a checkpoint from nmt train (best.pt)")
    p.add_argument("--output", "-o", type=Path, required=True, help="models/<name>/<version>")
    p.add_argument("--name", default="en-fr")
    p.add_argument("--version", default="1")
    p.add_argument("--quantize", choices=("int8",), help="also write int8 graphs (per-row activation scales)")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument("--test-split", type=Path, help="test.jsonl for greedy parity (default: random sources)")
    p.add_argument("--max-source-tokens", type=int, default=200)
    p.add_argument("--quality", type=Path, help="results.json of nmt evaluate, recorded in the manifest")
    args = p.parse_args(argv)
    out = export_repository(args.checkpoint, args.output, name=args.name, version=args.version,
                            quantize=args.quantize == "int8", force=args.force,
                            test_split=args.test_split, max_source_tokens=args.max_source_tokens,
                            quality=args.quality)
    print(f"exported {out} (opset {OPSET})")
    for precision, figures in load_manifest(out, verify=False).raw["parity"].items():
        print(f"  {precision}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in sorted(figures.items())))
    return 0
