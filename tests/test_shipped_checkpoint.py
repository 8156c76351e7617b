"""What ships can be exported again and trained on (issue 28's lighter tree).

The served en-fr version's fp16 checkpoint lies beside its repository
(``models/en-fr/checkpoint-<V>.pt``), recorded by name and sha256 in the manifest. ``nmt export``
of it writes the shipped int8 graphs again, byte for byte, and ``nmt train --resume`` continues
it (its weights, its update count) on a corpus of a few pairs made here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_corpus

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "en-fr"
PAIRS = [("Could not open the file %s.", "Impossible d'ouvrir le fichier %s."),
         ("Delete the selected files?", "Supprimer les fichiers sélectionnés ?"),
         ("Save changes to {name}?", "Enregistrer les modifications de {name} ?"),
         ("<b>Warning:</b> the disk is full.", "<b>Attention :</b> le disque est plein."),
         ("Print the document", "Imprimer le document"),
         ("Cancel", "Annuler")]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def shipped() -> tuple[Path, dict, Path]:
    """(the served version's repository, its manifest, its checkpoint)."""
    versions = [p for p in MODEL.iterdir() if p.is_dir() and (p / "manifest.json").exists()]
    assert len(versions) == 1, f"one tracked version of en-fr, found {sorted(p.name for p in versions)}"
    manifest = json.loads((versions[0] / "manifest.json").read_text())
    checkpoint = MODEL / manifest["checkpoint"]["file"]
    assert checkpoint.exists(), f"{checkpoint.relative_to(ROOT)}: the served version ships its checkpoint"
    return versions[0], manifest, checkpoint


def test_the_checkpoint_is_the_one_the_manifest_records(shipped: tuple[Path, dict, Path]) -> None:
    _, manifest, checkpoint = shipped
    assert sha256(checkpoint) == manifest["checkpoint"]["sha256"]
    assert sorted(p.name for p in MODEL.glob("*.pt")) == [checkpoint.name]  # no other version's


def test_export_of_the_checkpoint_writes_the_shipped_graphs(shipped: tuple[Path, dict, Path],
                                                            tmp_path: Path) -> None:
    from export.cli import export_main

    repo, manifest, checkpoint = shipped
    out = tmp_path / repo.name
    assert export_main([str(checkpoint), "--output", str(out), "--name", manifest["name"],
                            "--version", str(manifest["version"]), "--quantize", "int8"]) == 0
    exported = json.loads((out / "manifest.json").read_text())
    assert exported["model_config"] == manifest["model_config"]
    for name in ("encoder.int8.onnx", "decoder_step.int8.onnx", "source.model", "target.model"):
        assert sha256(out / name) == manifest["files"][name] == sha256(repo / name), name


def test_training_resumes_from_the_checkpoint(shipped: tuple[Path, dict, Path], tmp_path: Path) -> None:
    from export.cli import train_main
    from export.train.checkpoint import load_checkpoint

    repo, _, checkpoint = shipped
    corpus = make_corpus(tmp_path / "corpus", PAIRS * 4, PAIRS[:3])
    tokenizers = tmp_path / "tokenizers"
    tokenizers.mkdir()
    for name in ("source.model", "target.model"):
        shutil.copy(repo / name, tokenizers / name)
    before = load_checkpoint(checkpoint)
    step = before.extra["train_state"]["step"]
    out = tmp_path / "run"
    assert train_main([str(corpus), "--tokenizers", str(tokenizers), "--output", str(out),
                "--resume", str(checkpoint), "--max-steps", str(step + 2), "--validate-steps", "2",
                "--batch-tokens", "200", "--threads", "1", "--minutes", "100000"]) == 0
    after = load_checkpoint(out / "last.pt")
    assert after.extra["train_state"]["step"] == step + 2
    assert after.config == before.config
    moved = [k for k, v in before.weights.items() if not torch.equal(v.float(), after.weights[k].float())]
    assert moved, "two updates changed no weight"
