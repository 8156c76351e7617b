"""The model watcher (``--model-control poll``) never dies, and its failure is visible: a rescan
that raises is one log line and ``nmt_model_watcher_failures_total``, retried after a backoff,
and ``/readyz`` answers 503 naming it until a rescan succeeds (issue 31)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from harness import ServerThread, config_for, wait_until
from service.models import repository
from service.models.repository import Watcher
from test_reload import REQUEST, add_version


def test_a_failing_rescan_backs_off_names_its_error_and_clears_once_one_succeeds(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(repository.asyncio, "sleep", sleep)
    outcomes = [OSError("disk gone")] * 8 + [None, RuntimeError("bug"), None]
    seen: list[str] = []
    failures: list[int] = []
    watcher = Watcher()

    async def rescan() -> None:
        if not outcomes:
            raise asyncio.CancelledError  # the server stopping: the only way out
        outcome = outcomes.pop(0)
        seen.append(watcher.error)
        if outcome is not None:
            raise outcome

    log = logging.getLogger("test.watcher")
    with caplog.at_level(logging.INFO, logger="test.watcher"), pytest.raises(asyncio.CancelledError):
        asyncio.run(watcher.run(rescan, 2.0, failed=lambda: failures.append(1), describe=str, log=log))
    assert waits == [2, 4, 8, 16, 30, 30, 30, 30, 30, 2, 4, 2]  # doubled up to 30 s, back to the poll
    assert seen[1] == "disk gone" and seen[8] == "disk gone" and seen[9] == "" and seen[10] == "bug"
    assert watcher.error == "" and len(failures) == 9
    assert [r.getMessage() for r in caplog.records] == [
        "rescan failed: disk gone", "rescans succeed again (the last failure: disk gone)",
        "rescan failed: bug", "rescans succeed again (the last failure: bug)"]


def test_readyz_says_503_while_the_watcher_fails_and_200_once_it_recovers(
        reversal_repository: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "models"
    add_version(reversal_repository, root, "1")
    caplog.set_level(logging.INFO, logger="nmt.app")
    with ServerThread(config_for(root, "--model-control", "poll", "--poll-seconds", "0.1")) as server:
        assert server.http("GET", "/readyz").status == 200
        moved = root.rename(tmp_path / "elsewhere")  # the repository directory gone
        wait_until(lambda: server.http("GET", "/readyz").status == 503, timeout=30, what="/readyz 503")
        answer = server.http("GET", "/readyz").json()
        assert answer["code"] == "UNAVAILABLE"
        assert "model watcher is failing" in answer["message"], answer
        assert f"{root}: model repository directory does not exist" in answer["message"], answer
        wait_until(lambda: server.metric("nmt_model_watcher_failures_total") >= 3, timeout=30,
                   what="three failed rescans counted")
        assert server.api.Translate(REQUEST, timeout=30).model_version == "1"  # the loaded model serves
        moved.rename(root)
        wait_until(lambda: server.http("GET", "/readyz").status == 200, timeout=60, what="/readyz 200 again")
        add_version(reversal_repository, root, "2")
        wait_until(lambda: server.api.Translate(REQUEST, timeout=30).model_version == "2", timeout=60,
                   what="version 2 by polling after the recovery")
        assert server.http("GET", "/readyz").status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "nmt.app"]
    assert sum(line.startswith("rescan failed: ") for line in lines) == 1, lines
    assert sum(line.startswith("rescans succeed again") for line in lines) == 1, lines
