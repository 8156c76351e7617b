"""Verification of a model repository against the PyTorch checkpoint it came from.

``nmt verify models/<name>/<version>`` checks, per precision: ``onnx.checker``
on both graphs; the sha256 of every file against the manifest; that the batch,
rows and source-length axes are really dynamic (declared symbolic, and run at
batch 1, 2, 7, 32 x source length 1, 5, 40 with mixed lengths in a batch);
per-step parity with PyTorch on those random padded batches; padding
invariance (a sentence alone vs inside a batch padded to a longer source); and
end-to-end greedy parity (the serving engine, `service.decoding.engine`, vs
``export.train.search.greedy``) on the test split, or on random sources without one.

int8 parity with PyTorch is looser and documented in ``TOLERANCES``: weights
and activations are rounded to 8 bits. Its padding invariance is as strict as
fp32's, since activations are quantized with one scale per row
(``export.graphs.quantize``): a row's output does not depend on the other rows of
its batch. Its greedy agreement is reported, not enforced: int8 is accepted
on BLEU (evaluation).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from export.graphs.parity import (DYNAMIC_AXES, FIRST_ID, GRID_BATCHES, GRID_SRC_LENS,  # noqa: F401
                                  Check, Tolerances, check_greedy, check_grid, check_padding,
                                  greedy_sources, random_batch)
from export.train.checkpoint import CheckpointError, load_checkpoint
from export.train.model import RNNSearch
from service.decoding.engine import Engine
from service.decoding.runtime import Runtime
from service.errors import ModelRepositoryError
from service.models.manifest import (MANIFEST, Manifest, load_manifest, sha256_file)

TOLERANCES = {
    "fp32": Tolerances(encoder=1e-4, step=1e-4, padding=0.0, greedy=0.995),
    # int8 weights and activations are rounded to 8 bits: looser bounds against PyTorch
    # (the figures behind them: ``loadtest/results/notes.md``); int8 is accepted on BLEU
    # (evaluation). Rows are independent, so padding and batching change nothing: exactly 0.
    "int8": Tolerances(encoder=0.1, step=0.25, padding=0.0, greedy=None),
}


class VerificationError(ValueError):
    """Export produced graphs that fail verification (one line, naming the checks)."""


@dataclass(frozen=True)
class Report:
    repo: Path
    precision: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        return [f"{c.name} ({self.precision}): {c.figure}, needs {c.threshold}" for c in self.checks if not c.ok]

    def parity(self) -> dict:
        """The figures recorded in the manifest's ``parity`` field."""
        figures = {c.key: c.value for c in self.checks if c.key is not None}
        for c in self.checks:
            figures.update(c.extra)
        return figures

    def table(self) -> str:
        rows = [("check", "figure", "threshold", "ok")]
        rows += [(c.name, c.figure, c.threshold, "ok" if c.ok else "FAIL") for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)


def check_onnx(manifest: Manifest, precision: str) -> Check:
    files = manifest.graphs[precision]
    for file in (files.encoder, files.decoder_step):
        try:
            onnx.checker.check_model(str(manifest.path(file)), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            return Check("onnx.checker", f"{file}: {str(e).splitlines()[0][:80]}", "valid", False)
    return Check("onnx.checker", "2 graphs valid", "valid", True)


def load_reference(manifest: Manifest, checkpoint: Path | None) -> tuple[RNNSearch, Check]:
    """The checkpoint's model; it must have the manifest's config (and sha256 if defaulted)."""
    recorded = manifest.raw.get("checkpoint") or {}
    if checkpoint is None:
        if "file" not in recorded:
            raise ModelRepositoryError(f"{manifest.root / MANIFEST}: no checkpoint recorded; give --checkpoint")
        checkpoint = manifest.root.parent / recorded["file"]
        if not checkpoint.is_file():
            raise ModelRepositoryError(f"{checkpoint}: the checkpoint {manifest.root / MANIFEST} records is not "
                                       "here (a repository shipped without it); give --checkpoint")
    ckpt = load_checkpoint(checkpoint)
    if ckpt.config != manifest.model_config:
        config, recorded_config = ckpt.config.to_dict(), manifest.model_config.to_dict()
        differ = sorted(k for k in config if recorded_config[k] != config[k])
        raise CheckpointError(f"{checkpoint}: model config differs from {manifest.root / MANIFEST} ({', '.join(differ)})")
    same = sha256_file(checkpoint) == recorded.get("sha256")
    return ckpt.model(), Check("checkpoint", f"{checkpoint.name}: sha256 {'matches' if same else 'differs'}",
                               "config = manifest", True)


def verify_repository(repo: Path, *, checkpoint: Path | None = None, test_split: Path | None = None,
                      precision: str = "fp32", seed: int = 0, max_sentences: int | None = None) -> Report:
    """Run every check on one precision's graphs; raises on an unusable repository."""
    manifest = load_manifest(Path(repo), verify=True)  # names any missing or altered file
    if precision not in manifest.graphs:
        raise ModelRepositoryError(f"{manifest.root / MANIFEST}: no {precision} graphs "
                                   f"(has {', '.join(manifest.graphs)})")
    tol = TOLERANCES[precision]
    model, reference = load_reference(manifest, checkpoint)
    report = Report(Path(repo), precision, [
        Check("sha256", f"{len(manifest.files)} files match", "= manifest", True), reference,
        check_onnx(manifest, precision)])
    if not report.ok:
        return report
    runtime = Runtime(manifest, precision=precision, provider="cpu", intra_op_threads=1,
                      decoder_spinning=False)
    rng = np.random.default_rng(seed)
    cfg = model.config
    report.checks.extend(check_grid(runtime, model, manifest, precision, tol, rng))
    report.checks.append(check_padding(runtime, (cfg.src_vocab_size, cfg.tgt_vocab_size), tol, rng))
    sources, label = greedy_sources(manifest, test_split, max_sentences, cfg.src_vocab_size, rng)
    engine = Engine(manifest, precision=precision, intra_op_threads=1)
    report.checks.append(check_greedy(engine, model, sources, label, tol))
    return report


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nmt verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo", type=Path, help="model repository, e.g. models/en-fr/1")
    p.add_argument("--checkpoint", type=Path, help="default: the one recorded in the manifest")
    p.add_argument("--test-split", type=Path, help="test.jsonl for greedy parity (default: random sources)")
    p.add_argument("--precision", choices=("fp32", "int8"), action="append",
                   help="default: every precision in the manifest")
    p.add_argument("--max-sentences", type=int, help="cap on test-split sentences (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    precisions = args.precision or list(load_manifest(args.repo, verify=False).graphs)
    ok = True
    for precision in precisions:
        report = verify_repository(args.repo, checkpoint=args.checkpoint, test_split=args.test_split,
                                   precision=precision, seed=args.seed, max_sentences=args.max_sentences)
        print(f"{args.repo} ({precision})\n{report.table()}\n")
        ok = ok and report.ok
    print("verify: ok" if ok else "verify: FAILED")
    return 0 if ok else 1
