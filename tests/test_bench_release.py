"""``loadtest/bench_release.py``: two servers side by side, each with its own flags, and the
cores each server's processes used (an engine process included)."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtest"))

import bench_release  # noqa: E402


def _burn(seconds: float) -> None:
    stop = time.process_time() + seconds
    while time.process_time() < stop:
        pass


def test_tree_cpu_seconds_counts_the_children() -> None:
    child = multiprocessing.get_context("spawn").Process(target=_burn, args=(1.0,))
    child.start()
    while child.is_alive() and bench_release.cpu_seconds(child.pid) < 0.5:
        time.sleep(0.05)
    during = bench_release.tree_cpu_seconds(os.getpid())
    mine = bench_release.cpu_seconds(os.getpid())
    child.join(10)
    assert during - mine >= 0.4  # the child's CPU, counted with this process's


def test_two_servers_with_their_own_flags(reversal_repository: Path, reversal_corpus: Path,
                                          tmp_path: Path) -> None:
    out = tmp_path / "release"
    assert bench_release.main(["--previous", str(ROOT), "--previous-flags", "--engine-process off",
                               "--this-flags", "--engine-process on", "--model",
                               str(reversal_repository), "--texts", str(reversal_corpus / "test.jsonl"),
                               "--rounds", "1", "--duration", "1", "--clients", "4", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    for name in ("previous", "this"):
        for shape in result["rounds"][name].values():
            (r,) = shape
            assert r["texts"] > 0 and r["errors"] == 0 and 0 < r["cores"] < os.cpu_count() + 0.5
    text = out.with_suffix(".md").read_text()
    assert "--this-flags '--engine-process on'" in text and f"--out {out}" in text
    log = (tmp_path / "bench_release_this_server.log").read_text()
    assert "batches decode in process" in log
    assert "batches decode in process" not in (tmp_path / "bench_release_previous_server.log").read_text()
