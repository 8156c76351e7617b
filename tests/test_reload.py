"""Model versions change without a restart: load, warm up, switch, drain; no request fails."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from harness import ServerProcess, ServerThread, config_for, wait_until
from service.models.manifest import MANIFEST
from service.proto.nmt.v1 import translation_pb2 as pb

REQUEST = pb.TranslateRequest(texts=["1 2 3 4"])


def add_version(source: Path, root: Path, version: str, *, name: str = "reversal", edit=None) -> Path:
    """Copy ``source`` to ``root/<name>/<version>/`` (its manifest saying so), atomically: the
    copy is made beside and renamed, as a deployment tool would."""
    tmp = root / name / f".{version}.tmp"
    shutil.copytree(source, tmp)
    raw = json.loads((tmp / MANIFEST).read_text())
    raw["name"], raw["version"] = name, version
    if edit:
        edit(tmp, raw)
    (tmp / MANIFEST).write_text(json.dumps(raw))
    return tmp.rename(root / name / version)


def copy_slowly(source: Path, root: Path, version: str, *, pause: float, corrupt: str = "") -> None:
    """Copy ``source`` to ``root/reversal/<version>/`` in place, file by file: the manifest
    first, then the others with ``pause`` s between them (``corrupt``: that file one byte longer),
    as a plain ``cp`` or ``rsync`` into the repository would."""
    target = root / "reversal" / version
    target.mkdir(parents=True)
    raw = json.loads((source / MANIFEST).read_text())
    (target / MANIFEST).write_text(json.dumps({**raw, "name": "reversal", "version": version}))
    for path in sorted(p for p in source.rglob("*") if p.is_file() and p.name != MANIFEST):
        time.sleep(pause)
        (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes() + (b"\0" if path.name == corrupt else b"")
        (target / path.relative_to(source)).write_bytes(data)


def rescan(server: ServerThread) -> None:
    """What SIGHUP does, awaited."""
    import asyncio

    asyncio.run_coroutine_threadsafe(server.app.models.rescan(), server.loop).result(120)


class Load:
    """Client threads sending requests until stopped; every answer's (model, version) kept."""

    def __init__(self, server: ServerThread, clients: int = 3) -> None:
        self.answers: list[tuple[str, str]] = []
        self.by_client: list[list[str]] = [[] for _ in range(clients)]  # versions, in order
        self.errors: list[grpc.RpcError] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(server, self.by_client[k]))
                         for k in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, server: ServerThread, versions: list[str]) -> None:
        with grpc.insecure_channel(server.address) as channel:
            from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

            stub = pb_grpc.TranslatorStub(channel)
            while not self._stop.is_set():
                try:
                    reply = stub.Translate(REQUEST, timeout=60)
                    self.answers.append((reply.model, reply.model_version))
                    versions.append(reply.model_version)
                except grpc.RpcError as e:
                    self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.fixture
def repo(reversal_repository: Path, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    add_version(reversal_repository, root, "1")
    return root


def test_a_new_version_takes_over_under_load_and_the_old_one_is_unloaded(repo: Path,
                                                                         reversal_repository: Path) -> None:
    with ServerThread(config_for(repo)) as server:
        load = Load(server)
        try:
            wait_until(lambda: len(load.answers) >= 5, timeout=60, what="answers from version 1")
            add_version(reversal_repository, repo, "2")
            rescan(server)
            wait_until(lambda: all("2" in v for v in load.by_client), timeout=60, what="answers after the switch")
            shutil.rmtree(repo / "reversal" / "1")  # gone from disk: nothing changes, it is not served
            rescan(server)
            after = len(load.answers)
            wait_until(lambda: len(load.answers) >= after + 5, timeout=60, what="answers after the removal")
        finally:
            load.stop()
        assert load.errors == []
        assert set(load.answers[:5]) == {("reversal", "1")}
        # each client: version 1, then from some answer on version 2 only, never back
        for versions in load.by_client:
            first_new = versions.index("2")
            assert set(versions[:first_new]) == {"1"} and set(versions[first_new:]) == {"2"}
        assert {m for m, _ in load.answers} == {"reversal"}
        models = server.api.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert [(m.name, m.version) for m in models] == [("reversal", "2")]
        assert server.metric("nmt_model_info", name="reversal", version="2") == 1
        assert "version=\"1\"" not in "".join(line for line in server.scrape().splitlines()
                                              if line.startswith("nmt_model_info"))
        health = server.app.grpc.health
        assert health is not None  # health stayed SERVING: the load saw no error at any point


def test_a_broken_version_is_refused_while_the_old_one_serves(repo: Path, reversal_repository: Path) -> None:
    def corrupt(root: Path, raw: dict) -> None:
        with (root / "decoder_step.onnx").open("ab") as f:
            f.write(b"\0")

    with ServerThread(config_for(repo)) as server:
        add_version(reversal_repository, repo, "2", edit=corrupt)
        add_version(reversal_repository, repo, "3", edit=lambda root, raw: (root / "encoder.onnx").write_bytes(b"x"))
        add_version(reversal_repository, repo, "4")
        (repo / "reversal" / "4" / MANIFEST).write_text("{not json")
        rescan(server)
        reply = server.api.Translate(REQUEST, timeout=30)
        assert (reply.model, reply.model_version) == ("reversal", "1")
        assert server.metric("nmt_model_load_failures_total", name="reversal") == 3
        rescan(server)  # unchanged directories are not tried (nor logged) again
        assert server.metric("nmt_model_load_failures_total", name="reversal") == 3


def test_half_copied_and_misnamed_versions_are_left_until_complete(repo: Path, reversal_repository: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with ServerThread(config_for(repo)) as server:
        partial = repo / "reversal" / "2"
        partial.mkdir()
        shutil.copy(reversal_repository / "encoder.onnx", partial)  # no manifest yet
        (repo / "reversal" / "latest").mkdir()
        rescan(server)
        rescan(server)
        lines = [r.getMessage() for r in caplog.records if r.name == "nmt.app"]
        assert sum("reversal/2: no manifest.json yet (incomplete)" in line for line in lines) == 1
        assert sum("must be a number, got 'latest'" in line for line in lines) == 1
        assert server.api.Translate(REQUEST, timeout=30).model_version == "1"
        shutil.rmtree(partial)
        add_version(reversal_repository, repo, "2")
        rescan(server)
        assert server.api.Translate(REQUEST, timeout=30).model_version == "2"


def test_of_two_new_versions_the_newest_is_taken(repo: Path, reversal_repository: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with ServerThread(config_for(repo)) as server:
        add_version(reversal_repository, repo, "3")
        add_version(reversal_repository, repo, "2")
        rescan(server)
        assert server.api.Translate(REQUEST, timeout=30).model_version == "3"
        assert [(m.name, m.version) for m in server.api.ListModels(pb.ListModelsRequest(), timeout=10).models] == [
            ("reversal", "3")]
        assert not any("serving reversal/2" in r.getMessage() for r in caplog.records)


def test_all_versions_can_be_pinned(repo: Path, reversal_repository: Path) -> None:
    add_version(reversal_repository, repo, "2")
    with ServerThread(config_for(repo, "--model-versions", "all")) as server:
        api = server.api
        assert api.Translate(REQUEST, timeout=30).model_version == "2"  # newest for the bare name
        pinned = pb.TranslateRequest(texts=["1 2"], model="reversal/1")
        assert api.Translate(pinned, timeout=30).model_version == "1"
        shutil.rmtree(repo / "reversal" / "1")
        rescan(server)
        with pytest.raises(grpc.RpcError) as e:
            api.Translate(pinned, timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "got 'reversal/1'" in e.value.details()


def test_poll_and_sighup_rescan(repo: Path, reversal_repository: Path, tmp_path: Path) -> None:
    server = ServerProcess(repo, tmp_path / "server.log", "--model-control", "none", "--max-wait-ms", "5")
    try:
        add_version(reversal_repository, repo, "2")
        server.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: server.api.Translate(REQUEST, timeout=30).model_version == "2", timeout=120,
                   what="version 2 after SIGHUP", process=server)
        assert server.stop() == 0
        log = server.log_text()
        assert "serving reversal/2" in log and "unloaded reversal/1" in log
    finally:
        server.kill()
    poller = ServerProcess(repo, tmp_path / "poll.log", "--model-control", "poll", "--poll-seconds", "0.5")
    try:
        add_version(reversal_repository, repo, "3")
        wait_until(lambda: poller.api.Translate(REQUEST, timeout=30).model_version == "3", timeout=120,
                   what="version 3 by polling", process=poller)
    finally:
        poller.stop()


def test_a_model_added_later_takes_its_share_of_the_cores(repo: Path, reversal_repository: Path,
                                                         monkeypatch) -> None:
    from service import process

    monkeypatch.setattr(process, "cores", lambda: (8, False))

    def threads(server: ServerThread) -> dict[str, int]:
        return {m.ref: m.engine.runtime.decoder.get_session_options().intra_op_num_threads
                for m in server.app.models.all}

    with ServerThread(config_for(repo, "--engine-process", "off")) as server:  # the in-process rule
        assert threads(server) == {"reversal/1": 0}  # alone: ONNX Runtime's default, one per core
        add_version(reversal_repository, repo, "1", name="other")
        rescan(server)
        assert threads(server) == {"reversal/1": 0, "other/1": 4}  # the newcomer: 8 cores / 2 models
        add_version(reversal_repository, repo, "2")  # replaces reversal/1 (latest): still 2 models
        rescan(server)
        assert threads(server) == {"reversal/2": 4, "other/1": 4}


def test_a_version_copied_file_by_file_loads_and_only_what_stays_broken_is_refused(
        repo: Path, reversal_repository: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Polling every 0.1 s, a version is tried only once its files have not changed for 1 s (and
    two polls): a slow copy is not refused for the files it has not copied yet (issue 31, row 13)."""
    caplog.set_level(logging.INFO, logger="nmt.app")
    with ServerThread(config_for(repo, "--model-control", "poll", "--poll-seconds", "0.1")) as server:
        copy_slowly(reversal_repository, repo, "2", pause=0.3)
        wait_until(lambda: server.api.Translate(REQUEST, timeout=30).model_version == "2", timeout=60,
                   what="version 2, copied file by file")
        assert server.metric("nmt_model_load_failures_total", name="reversal") == 0
        copy_slowly(reversal_repository, repo, "3", pause=0.3, corrupt="decoder_step.onnx")
        wait_until(lambda: server.metric("nmt_model_load_failures_total", name="reversal") == 1, timeout=60,
                   what="version 3 refused once it settled")
        time.sleep(1.5)  # 15 more polls: an unchanged broken version is not tried again
        assert server.metric("nmt_model_load_failures_total", name="reversal") == 1
        assert server.api.Translate(REQUEST, timeout=30).model_version == "2"
    refused = [r.getMessage() for r in caplog.records if r.name == "nmt.app" and r.getMessage().startswith("refused")]
    assert len(refused) == 1 and refused[0].startswith("refused reversal/3: ") and "decoder_step.onnx" in refused[0]


def test_what_a_freeze_kept_is_collected_when_a_model_unloads() -> None:
    """``freeze_heap`` (once the server is ready) hides start-up's objects from the cyclic collector;
    ``release_memory`` (a model version unloads) makes them collectable first: a reference cycle of the
    start-up heap that became garbage is freed then, and what stays alive is frozen again."""
    import gc
    import weakref

    from service.process import GEN0_THRESHOLD, freeze_heap, release_memory

    class Node:
        pass

    before = gc.get_threshold()
    try:
        node = Node()
        node.cycle = node
        gone = weakref.ref(node)
        freeze_heap()
        del node
        gc.collect()
        assert gone() is not None  # frozen: unseen by the collector
        release_memory()
        assert gone() is None and gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == GEN0_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
