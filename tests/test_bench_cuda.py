"""``loadtest/bench_cuda.py`` on the CPU: the script that ran the CUDA provider on an H200 (its
results: ``loadtest/results/bench_cuda.md``) runs here with ``--provider cpu``, where both
sides are the same CPU sessions and must agree exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtest"))

import bench_cuda  # noqa: E402  (loadtest/ on sys.path first, as the script runs)


def test_the_cuda_check_runs_on_the_cpu_and_both_sides_agree(tiny_repository: Path, tiny_corpus: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "bench_cuda"
    assert bench_cuda.main(["--repository", str(tiny_repository), "--texts", str(tiny_corpus / "test.jsonl"),
                            "--provider", "cpu", "--parts", "graphs,engine,steps", "--parity-texts", "4",
                            "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    graphs = result["graphs"]
    assert graphs["rows"] > 1 and graphs["encoder_max_abs_diff"] == 0.0
    assert set(graphs["step_max_abs_diff"].values()) == {0.0} and graphs["top1_agreement"] == 1.0
    for search in ("beam1", "beam5"):
        assert result["engine"][search]["identical_share"] == 1.0 and result["engine"][search]["texts"] == 4
    steps = result["steps"]["ms_per_step"]
    assert set(steps["cpu"]) == set(steps["other"]) == {"8", "32", "128", "512"}
    assert all(ms > 0 for side in steps.values() for ms in side.values())
    report = out.with_suffix(".md").read_text()
    assert "## Graphs" in report and "## Engine" in report and "## One decoder step" in report
    assert "failed" not in report and "service" not in result


def test_a_part_that_fails_is_recorded_and_the_next_one_runs(tiny_repository: Path, tiny_corpus: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "bench_cuda"
    missing = tmp_path / "no-such-repository"
    assert bench_cuda.main(["--repository", str(missing), "--texts", str(tiny_corpus / "test.jsonl"),
                            "--provider", "cpu", "--parts", "graphs,engine", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert "no-such-repository" in result["graphs"]["error"] and "no-such-repository" in result["engine"]["error"]
    assert "## graphs: failed" in out.with_suffix(".md").read_text()
