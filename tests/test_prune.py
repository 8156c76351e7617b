"""``nmt prune``: a model repository shipped with one precision's graphs (en-fr/3 ships int8 only).

The pruned repository still verifies its checksums, serves its one precision under
``--precision auto``, refuses the deleted one in one line naming the choices, keeps what export
measured on the deleted graphs, and a re-export from the same checkpoint reproduces them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.app import load_engines
from service.config import parse
from service.errors import ModelRepositoryError
from service.models.manifest import MANIFEST, load_manifest, sha256_file


@pytest.fixture
def pruned(tiny_repository: Path, tmp_path: Path) -> Path:
    repo = Path(shutil.copytree(tiny_repository, tmp_path / "en-fr" / "1"))
    from export.graphs.repository import prune_repository

    assert prune_repository(repo, ["int8"]) == ["encoder.onnx", "decoder_step.onnx"]
    return repo


def test_pruning_deletes_the_other_graphs_and_keeps_their_records(tiny_repository: Path, pruned: Path) -> None:
    before, after = (json.loads((r / MANIFEST).read_text()) for r in (tiny_repository, pruned))
    assert sorted(p.name for p in pruned.iterdir()) == sorted(
        ["decoder_step.int8.onnx", "encoder.int8.onnx", MANIFEST, "source.model", "target.model"])
    assert list(after["graphs"]) == ["int8"] and after["graphs"]["int8"] == before["graphs"]["int8"]
    assert set(after["files"]) == set(before["files"]) - {"encoder.onnx", "decoder_step.onnx"}
    assert after["pruned"] == {"fp32": {f: before["files"][f] for f in ("encoder.onnx", "decoder_step.onnx")}}
    assert after["parity"] == before["parity"]  # measured at export on the deleted graphs too
    load_manifest(pruned)  # every remaining checksum holds


def test_a_pruned_repository_serves_its_one_precision(pruned: Path) -> None:
    assert load_manifest(pruned).default_precision() == ("int8", "the repository has only int8 graphs")
    engines = load_engines(parse(["--model-repository", str(pruned), "--threads", "1"], env={}))
    assert [e.precision for e in engines] == ["int8"]
    assert engines[0].translate(["12 34"])  # it decodes
    with pytest.raises(ModelRepositoryError, match=r"no 'fp32' graphs \(the manifest has \['int8'\]\)"):
        load_engines(parse(["--model-repository", str(pruned), "--precision", "fp32"], env={}))


def test_a_re_export_reproduces_the_pruned_graphs(tiny_checkpoint: Path, pruned: Path, tmp_path: Path) -> None:
    from export.graphs.repository import export_repository

    again = export_repository(tiny_checkpoint, tmp_path / "again", quantize=True)
    recorded = json.loads((pruned / MANIFEST).read_text())["pruned"]["fp32"]
    assert {f: sha256_file(again / f) for f in recorded} == recorded


def test_prune_names_an_unknown_precision_and_the_choices(pruned: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "service.cli", "prune", str(pruned), "--keep", "fp32"],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"nmt prune: error: {pruned}: --keep 'fp32' is not a precision of the repository (choices: int8)"]
    assert (pruned / "encoder.int8.onnx").is_file()


def test_verify_checks_the_kept_precision_and_asks_for_a_missing_checkpoint(pruned: Path,
                                                                            tiny_checkpoint: Path) -> None:
    from export.graphs import verify

    run = subprocess.run([sys.executable, "-m", "service.cli", "verify", str(pruned)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{pruned} (int8)" in run.stdout and "(fp32)" not in run.stdout and "verify: ok" in run.stdout
    raw = json.loads((pruned / MANIFEST).read_text())
    raw["checkpoint"]["file"] = "checkpoint-3.pt"
    (pruned / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ModelRepositoryError, match=r"checkpoint-3.pt: the checkpoint .*manifest.json records "
                                                   r"is not here .*; give --checkpoint"):
        verify.verify_repository(pruned, precision="int8")
    assert verify.verify_repository(pruned, checkpoint=tiny_checkpoint, precision="int8").ok


def test_engine_quality_measures_the_precision_a_pruned_repository_has(pruned: Path, tiny_corpus: Path,
                                                                       tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "loadtest" / "quality_engine.py"), str(pruned),
                          str(tiny_corpus / "test.jsonl"), "--beam", "2", "--threads", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=root)
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "quality_engine.json").read_text())
    assert [(r["precision"], r["beam_size"], r["identical_to_fp32"]) for r in rows] == [("int8", 1, None),
                                                                                       ("int8", 2, None)]
