"""Export a checkpoint to a model repository: ONNX graphs, tokenizers, manifest.

``nmt export CHECKPOINT --output models/<name>/<version> [--quantize int8]``
writes the encoder and decoder-step graphs (``export.graphs.onnx_export``),
optionally their int8 variants, both SentencePiece models and
``manifest.json`` (the model config is ``service.models.config.ModelConfig``'s
``to_dict``). Everything is written to a temporary directory beside the output
and verified there (``export.graphs.verify``) before it is moved into place; an
existing output is kept unless ``--force``. ``nmt prune`` keeps one precision's
graphs of a verified repository.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from export.graphs.onnx_export import GRAPHS, OPSET, export_graphs
from export.graphs.quantize import SCHEME as INT8_SCHEME
from export.graphs.verify import VerificationError, verify_repository
from export.train.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from service.models.manifest import (DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS,
                                     FORMAT, checksums, load_manifest, sha256_file, write_manifest)
from service.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

TOKENIZERS = {"source": "source.model", "target": "target.model"}
PRODUCERS = ("torch", "onnx", "onnxruntime", "onnxscript", "nmt-serve")


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
        # recorded by training from the corpus manifest; en-fr/3's checkpoint predates that: en-fr
        "languages": dict(ckpt.extra.get("languages") or {"source": "en", "target": "fr"}),
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
