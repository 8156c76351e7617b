"""``make loadtest``'s script (``loadtest/run_locust.py``) end to end in a short run: it starts
``nmt serve``, runs Locust with every user kind, stops the server and writes the reports.
Skips without the ``loadtest`` extra (locust)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT


def test_short_locust_run_has_no_failures(tiny_repository: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    """``make loadtest``'s script end to end: it starts a server, runs Locust, stops the server."""
    if importlib.util.find_spec("locust") is None:  # not imported: locust monkey-patches on import
        pytest.skip("locust not installed (pip install -e '.[loadtest]')")
    out = tmp_path / "results"
    env = {**os.environ, "NMT_LOCUST_BEAM": "2", "NMT_LOCUST_NBEST": "2", "NMT_LOCUST_BATCH_TEXTS": "3"}
    run = subprocess.run(
        [sys.executable, "loadtest/run_locust.py", "--model-repository", str(tiny_repository),
         "--texts", str(tiny_corpus / "test.jsonl"), "--users", "3", "--time", "15", "--wait", "0,0.1",
         "--weights", "short=1,long=1,beam=1,nbest=1,batch=1,stream=1", "--output", str(out),
         "--prefix", "short"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stats = json.loads((out / "short.json").read_text())
    assert sum(e["num_requests"] for e in stats) >= 5
    assert sum(e["num_failures"] for e in stats) == 0
    assert {e["name"] for e in stats} == {"Translate short", "Translate long", "Translate beam",  # the weights
                                          "Translate nbest", "Translate batch", "TranslateStream long"}
    assert len((out / "short_stats.csv").read_text().splitlines()) >= 2
    assert "<html" in (out / "short.html").read_text().lower()
    assert (out / "short_exceptions.csv").read_text().count("\n") == 1  # the header only
    summary = json.loads((out / "short_summary.json").read_text())
    assert summary[0]["users"] == 3 and summary[0]["failures"] == 0 and summary[0]["tokens_per_s"] > 0
    assert "stopped" in (out / "short_server.log").read_text()
