"""The server's life: configuration (flags, environment, defaults), start-up and the
warm-up that gates health, connection recycling, draining, and ``nmt serve`` as a
process (SIGTERM drains calls in flight and exits 0; no torch on the serving path).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import (LONG_DIGITS, NOT_SERVING, ROOT, SERVING, ServerProcess, ServerThread, config_for,
                     wait_until)
from service.api.grpc_server import SERVICE_NAME
from service.api.main import main
from service.config import ConfigError, parse
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc

# ---- configuration ---------------------------------------------------------------------------


def test_flags_win_over_environment_over_defaults() -> None:
    assert parse(["--port", "7"], env={"NMT_PORT": "8"}).port == 7
    config = parse([], env={"NMT_PORT": "8", "NMT_BATCHING": "request", "NMT_MAX_WAIT_MS": "3"})
    assert (config.port, config.scheduler.step_level, config.scheduler.max_wait) == (8, False, 0.003)
    assert parse([], env={}).port == 50051 and parse([], env={}).metrics_port == 9464
    with pytest.raises(ConfigError, match=r"NMT_MAX_ROWS: must be >= 1, got 0"):
        parse([], env={"NMT_MAX_ROWS": "0"})


def test_an_unknown_nmt_variable_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^NMT_PROT: not a setting of nmt serve \(did you mean NMT_PORT\?"):
        parse([], env={"NMT_PROT": "8"})
    with pytest.raises(ConfigError, match=r"^NMT_COLOUR: not a setting of nmt serve \(see nmt serve --help\)$"):
        parse([], env={"NMT_COLOUR": "blue"})
    other_tools = {"NMT_SERVER": "localhost:1", "NMT_LOCUST_WAIT": "0,0", "NMT_SMOKE_IMAGE": "x", "HOME": "/"}
    assert parse([], env=other_tools).port == 50051


def test_bad_environment_or_repository_exits_at_once(monkeypatch, capsys, tmp_path: Path) -> None:
    import service.api.main

    # main() in this process: its threads keep their policy (nmt serve's own: the next test)
    monkeypatch.setattr(service.api.main, "sched_batch", lambda on: "")
    monkeypatch.setenv("NMT_PORT", "http")
    assert main([]) == 2
    assert capsys.readouterr().err == "nmt serve: NMT_PORT: must be an integer, got 'http'\n"
    monkeypatch.delenv("NMT_PORT")
    assert main(["--model-repository", str(tmp_path), "--port", "0", "--metrics-port", "0"]) == 1
    assert f"{tmp_path}: no manifest.json" in capsys.readouterr().err


def test_a_start_up_failure_is_one_line_with_the_default_policy(tmp_path: Path) -> None:
    """``nmt serve`` sets its threads' policy before any starts, and logs it only once the models loaded."""
    absent = tmp_path / "absent"
    done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model-repository", str(absent),
                           "--port", "0", "--metrics-port", "0", "--http-port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout + done.stderr == f"nmt serve: {absent}: model repository directory does not exist\n"


# ---- start-up, connections, draining (in-process) --------------------------------------------

def test_health_not_serving_until_warm_up_translated(slow_server: ServerThread) -> None:
    assert slow_server.startup_health[0] == NOT_SERVING and slow_server.startup_health[-1] == SERVING


def test_connections_are_recycled_after_max_connection_age(reversal_repository: Path) -> None:
    """GOAWAY after --max-connection-age: the channel goes idle, and the next call reconnects."""
    with ServerThread(config_for(reversal_repository, "--max-connection-age", "0.3", "--grace-period", "1")) as s:
        states: list[grpc.ChannelConnectivity] = []
        s.channel.subscribe(states.append)
        assert s.api.ListModels(pb.ListModelsRequest(), timeout=10).models

        def closed_after_ready() -> bool:  # callbacks arrive on another thread, in order
            seen = list(states)
            ready = grpc.ChannelConnectivity.READY
            return ready in seen and grpc.ChannelConnectivity.IDLE in seen[seen.index(ready):]
        wait_until(closed_after_ready, timeout=10,
                   what="the channel going READY then IDLE (the server closed the connection)")
        assert s.api.ListModels(pb.ListModelsRequest(), timeout=10).models  # a new one


def test_draining_reports_not_serving(reversal_repository: Path) -> None:
    s = ServerThread(config_for(reversal_repository))
    with grpc.insecure_channel(s.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert next(watch).status == SERVING
        s.stop(grace=1.0, wait=False)
        assert next(watch).status == NOT_SERVING
        watch.cancel()
    s.thread.join(30)


# ---- nmt serve as a process -------------------------------------------------------------------

def test_sigterm_drains_calls_in_flight_then_exits_0(reversal_repository: Path, tmp_path: Path) -> None:
    # 4 rows per step: 4 calls x 32 texts x beam 4 take thousands of steps to drain
    with ServerProcess(reversal_repository, tmp_path / "serve.log", "--grace-period", "120",
                       "--max-rows", "4") as server, grpc.insecure_channel(server.address) as channel:
        api = pb_grpc.TranslatorStub(channel)  # not the server's own channel: used after it stopped
        request = pb.TranslateRequest(texts=[LONG_DIGITS] * 32, options=pb.DecodingOptions(beam_size=4))
        submitted = server.metric("nmt_source_tokens_count")  # texts handed to the scheduler
        calls = [api.Translate.future(request, timeout=300) for _ in range(4)]
        answered: list[float] = []
        for call in calls:
            call.add_done_callback(lambda _: answered.append(time.monotonic()))
        wait_until(lambda: server.metric("nmt_source_tokens_count") == submitted + 4 * 32, timeout=60,
                   what="all 128 texts handed to the scheduler", process=server)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        replies = [c.result() for c in calls]
        assert all(len(r.translations) == 32 for r in replies)
        assert len({t.hypotheses[0].text for r in replies for t in r.translations}) == 1
        assert max(answered) > signalled  # answered after SIGTERM: drained, not cut off
        assert server.stop() == 0
        assert "draining" in server.log_text()
        with pytest.raises(grpc.RpcError) as e:
            api.Translate(pb.TranslateRequest(texts=["1 2"]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


NO_TORCH = """
import asyncio, sys
import grpc
from service.config import parse
from service.api.server import build
from service.proto.nmt.v1 import translation_pb2 as pb, translation_pb2_grpc as pb_grpc

async def main():
    app = build(parse(["--model-repository", sys.argv[1], "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--http-port", "0"], env={}))
    await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        reply = await pb_grpc.TranslatorStub(channel).Translate(pb.TranslateRequest(texts=["1 2 3"]))
    await app.stop(0)
    return reply.translations[0].hypotheses[0].text

text = asyncio.run(main())
# onnx (the ONNX protobuf library) is allowed: service.decoding rewrites the int8 graphs in memory
# (int8_form: the CPU's product form; shortlist: the output layer); the offline stack is not
print(text, sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "export", "onnxscript", "sacrebleu")))
"""


def test_the_server_never_imports_torch(reversal_repository: Path) -> None:
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(reversal_repository)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]"), out.stdout
