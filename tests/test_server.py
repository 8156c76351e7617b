"""The gRPC service end to end: real servers in-process on port 0, and ``nmt serve`` as a process.

Servers run in a background thread with their own event loop; tests talk to
them with ordinary (blocking) gRPC clients, as users do.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Hashable, Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)
from prometheus_client.parser import text_string_to_metric_families

from service.clients import translate as client
from service.config import ConfigError, parse
from service.decoding.engine import Engine
from service.interface import Prepared, Translation
from service.models.manifest import sha256_file
from service.options import DecodingOptions
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc
from service.api.grpc_server import SERVICE_NAME, App, build, main

ROOT = Path(__file__).resolve().parents[1]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LONG_DIGITS = " ".join("1234567890" * 3)  # 30 digits: about 30 decoder steps


def config_for(repository: Path, *extra: str):
    return parse(["--model-repository", str(repository), "--host", "127.0.0.1", "--port", "0",
                  "--metrics-port", "0", "--max-texts", "8", "--max-beam", "4",
                  "--max-message-bytes", "65536", "--max-wait-ms", "5", *extra], env={})


class ServerThread:
    """An App on its own event loop in a background thread."""

    def __init__(self, config, engines: Sequence | None = None, *, wait: bool = True) -> None:
        self.config, self.engines = config, engines
        self.started, self.app, self.error = threading.Event(), None, None
        self.listening = threading.Event()  # the port is known (start-up may still run)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        self.started.wait(300)
        if self.error:
            raise self.error

    async def _main(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            self.app: App = build(self.config, self.engines)
            self.listening.set()
            await self.app.start()
        except Exception as e:
            self.error = e
            self.started.set()
            return
        self.started.set()
        await self._stop.wait()
        await self.app.stop(self.grace)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    def stop(self, grace: float = 0.0, *, wait: bool = True) -> None:
        self.grace = grace
        self.loop.call_soon_threadsafe(self._stop.set)
        if wait:
            self.thread.join(30)

    def metric(self, sample: str, /, **labels: str) -> float:
        """A sample from the live /metrics endpoint (0 if absent)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.app.metrics_port}/metrics").read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


class SlowBatch:
    """The real batch, with a pause before each decoder step (to catch a call mid-decode)."""

    def __init__(self, batch, owner: SlowEngine) -> None:
        self.batch, self.owner = batch, owner

    def add(self, items: Sequence[tuple[Hashable, Prepared]]) -> None:
        self.batch.add(items)

    def step(self) -> list[tuple[Hashable, Translation]]:
        time.sleep(self.owner.step_seconds)
        self.owner.steps += 1
        return self.batch.step()

    def remove(self, keys: Sequence[Hashable]) -> None:
        self.owner.removed += len(keys)
        self.batch.remove(keys)

    def prefix(self, key: Hashable) -> str:
        return self.batch.prefix(key)

    @property
    def live_rows(self) -> int:
        return self.batch.live_rows

    @property
    def padded_tokens(self) -> tuple[int, int]:
        return self.batch.padded_tokens


class SlowEngine:
    def __init__(self, engine: Engine, step_seconds: float) -> None:
        self.engine, self.manifest, self.step_seconds = engine, engine.manifest, step_seconds
        self.steps = self.removed = 0

    def prepare(self, text: str, options, index: int) -> Prepared:
        return self.engine.prepare(text, options, index)

    def new_batch(self) -> SlowBatch:
        return SlowBatch(self.engine.new_batch(), self)


def stub(server: ServerThread) -> pb_grpc.TranslatorStub:
    return pb_grpc.TranslatorStub(grpc.insecure_channel(server.address))


@pytest.fixture(scope="module")
def reversal_engine(reversal_repository: Path) -> Engine:
    return Engine(reversal_repository)


@pytest.fixture(scope="module")
def server(reversal_repository: Path) -> ServerThread:
    s = ServerThread(config_for(reversal_repository, "--max-texts", "64"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_server(tiny_repository: Path) -> ServerThread:
    s = ServerThread(config_for(tiny_repository))
    yield s
    s.stop()


# ---- translate, stream, list models, reflection, health -----------------------------------

def best(engine: Engine, texts: list[str], **options: object) -> list[str]:
    """What the engine alone answers: the reference for every served answer."""
    return [t.hypotheses[0].text for t in engine.translate(texts, DecodingOptions(**options))]


def test_translate_answers_like_the_engine_alone_in_input_order(server: ServerThread,
                                                                reversal_engine: Engine) -> None:
    texts = ["3 1 4", "1 5 9 2 6", "2 7 1 8 2 8 1"]
    reply = stub(server).Translate(pb.TranslateRequest(texts=texts), timeout=60)
    assert reply.kind == pb.RESULT_KIND_FINAL
    assert [t.hypotheses[0].text for t in reply.translations] == [best(reversal_engine, [t])[0] for t in texts]
    first = reply.translations[0]
    assert list(first.source_tokens) == list(reversal_engine.prepare("3 1 4", DecodingOptions(), 0).source_pieces[:-1])
    assert first.hypotheses[0].score < 0 and first.hypotheses[0].tokens
    assert not first.hypotheses[0].alignments


def test_beam_nbest_and_alignments(server: ServerThread, reversal_engine: Engine) -> None:
    options = pb.DecodingOptions(beam_size=4, num_hypotheses=3, return_attention=True)
    reply = stub(server).Translate(pb.TranslateRequest(texts=["1 2 3 4"], options=options), timeout=60)
    t = reply.translations[0]
    assert len(t.hypotheses) == 3
    assert t.hypotheses[0].text == best(reversal_engine, ["1 2 3 4"], beam_size=4, num_hypotheses=3)[0]
    top = t.hypotheses[0]
    assert len(top.alignments) == len(top.tokens)
    assert all(abs(sum(a.weights) - 1) < 1e-3 for a in top.alignments)
    assert t.source_tokens[top.alignments[0].source_index] == top.alignments[0].source_token


@pytest.mark.parametrize("beam_size", [1, 3])
def test_stream_sends_agreed_prefixes_then_the_final_answer(server: ServerThread, beam_size: int) -> None:
    request = pb.TranslateRequest(texts=[LONG_DIGITS, "1 2"], options=pb.DecodingOptions(beam_size=beam_size))
    responses = list(stub(server).TranslateStream(request, timeout=60))
    partials, final = responses[:-1], responses[-1]
    assert final.kind == pb.RESULT_KIND_FINAL and partials
    assert all(p.kind == pb.RESULT_KIND_PARTIAL and len(p.translations) == 2 for p in partials)
    assert final == stub(server).Translate(request, timeout=60)
    answer = final.translations[0].hypotheses[0].text
    texts = [p.translations[0].hypotheses[0].text for p in partials]
    assert all(answer.startswith(t) for t in texts) and texts == sorted(texts, key=len)
    both = [tuple(t.hypotheses[0].text for t in p.translations) for p in partials]
    assert len(set(both)) == len(both)  # an update only when some text's agreed prefix grew
    if beam_size == 1:  # greedy: every step decides one more token
        assert len(partials) >= len(final.translations[0].hypotheses[0].tokens) - 1


def test_list_models(server: ServerThread, reversal_repository: Path) -> None:
    models = stub(server).ListModels(pb.ListModelsRequest(), timeout=10).models
    assert [(m.name, m.version, m.precision, m.provider, m.is_default) for m in models] == [
        ("reversal", "1", "fp32", "cpu", True)]
    assert models[0].sha256 == sha256_file(reversal_repository / "manifest.json")
    assert list(models[0].languages) == ["en", "fr"]


def test_reflection_lists_the_services(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(services)
        assert db.FindFileContainingSymbol(SERVICE_NAME).package == "nmt.v1"


def test_health_is_serving_for_the_server_and_the_service(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == SERVING


# ---- bad input ------------------------------------------------------------------------------

BAD = [
    (dict(texts=[]), "INVALID_ARGUMENT", r"texts must be at least one text, got 0"),
    (dict(texts=["ok", "   "]), "INVALID_ARGUMENT", r"texts\[1\] must be a non-empty"),
    (dict(texts=["x" * 3000]), "INVALID_ARGUMENT", r"texts\[0\] length must be at most 2000 characters, got 3000"),
    (dict(texts=["file " * 300]), "INVALID_ARGUMENT", r"texts\[0\] must be at most \d+ source tokens"),
    (dict(texts=["a"] * 9), "INVALID_ARGUMENT", r"texts must be at most 8 texts, got 9"),
    (dict(texts=["a"], model="de-en"), "NOT_FOUND", r"model must be one of \['en-fr'\], got 'de-en'"),
    (dict(texts=["a"], options=dict(beam_size=0)), "INVALID_ARGUMENT",
     r"options.beam_size must be between 1 and 4, got 0"),
    (dict(texts=["a"], options=dict(beam_size=5)), "INVALID_ARGUMENT",
     r"options.beam_size must be between 1 and 4, got 5"),
    (dict(texts=["a"], options=dict(beam_size=2, num_hypotheses=3)), "INVALID_ARGUMENT",
     r"options.num_hypotheses must be between 1 and beam_size \(2\), got 3"),
    (dict(texts=["a"], options=dict(max_decoding_length=100000)), "INVALID_ARGUMENT",
     r"options.max_decoding_length must be between 1 and 512, got 100000"),
    (dict(texts=["a"], options=dict(max_length_ratio=1e9)), "INVALID_ARGUMENT",
     r"options.max_length_ratio must be in \(0, 10.0\], got 1000000000.0"),
    (dict(texts=["a"], options=dict(length_penalty=-1)), "INVALID_ARGUMENT",
     r"options.length_penalty must be between 0 and 10, got -1.0"),
    (dict(texts=["x" * 70_000]), "RESOURCE_EXHAUSTED", r"larger than max \(\d+ vs. 65536\)"),
]


@pytest.mark.parametrize("fields, code, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_input_names_field_limit_and_value(tiny_server: ServerThread, fields: dict, code: str,
                                               message: str) -> None:
    request = pb.TranslateRequest(**{**fields, "options": pb.DecodingOptions(**fields.get("options", {}))})
    api = stub(tiny_server)
    for call in (api.Translate, lambda r, timeout: list(api.TranslateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=10)
        assert e.value.code().name == code
        assert re.search(message, e.value.details()), e.value.details()


def test_server_keeps_serving_after_bad_input(tiny_server: ServerThread) -> None:
    before = tiny_server.metric("nmt_requests_total", method="Translate", code="INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError):
        stub(tiny_server).Translate(pb.TranslateRequest(texts=[]), timeout=10)
    reply = stub(tiny_server).Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=30)
    assert len(reply.translations) == 1
    assert tiny_server.metric("nmt_requests_total", method="Translate", code="INVALID_ARGUMENT") == before + 1


# ---- deadlines, cancellation, overload (a server whose steps take 50 ms) ---------------------

STEP_SECONDS = 0.05


def wait_for(condition, timeout: float = 30.0) -> None:
    stop_at = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < stop_at, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def slow_server(reversal_repository: Path, reversal_engine: Engine) -> ServerThread:
    """Admits one LONG_DIGITS text at a time (queued work); records health during start-up."""
    work = reversal_engine.prepare(LONG_DIGITS, DecodingOptions(), 0).work
    engine = SlowEngine(Engine(reversal_repository), STEP_SECONDS)
    s = ServerThread(config_for(reversal_repository, "--max-queued-work", str(work * 3 // 2)), [engine],
                     wait=False)
    s.listening.wait(60)
    s.engine, s.startup_health = engine, []
    with grpc.insecure_channel(s.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while SERVING not in s.startup_health:
            s.startup_health.append(health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                                                 timeout=60).status)
    s.wait_started()
    yield s
    s.stop()


def test_health_not_serving_until_warm_up_translated(slow_server: ServerThread) -> None:
    assert slow_server.startup_health[0] == NOT_SERVING and slow_server.startup_health[-1] == SERVING


def test_deadline_expiring_mid_decode_stops_decoding(slow_server: ServerThread) -> None:
    engine, before = slow_server.engine, slow_server.metric("nmt_deadline_exceeded_total")
    removed = engine.removed
    with pytest.raises(grpc.RpcError) as e:
        stub(slow_server).Translate(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: engine.removed == removed + 1)  # its rows left the batch
    steps = engine.steps
    time.sleep(5 * STEP_SECONDS)
    assert engine.steps == steps and slow_server.metric("nmt_inflight_rows") == 0
    assert slow_server.metric("nmt_deadline_exceeded_total") == before + 1


def test_cancelled_call_frees_its_rows(slow_server: ServerThread) -> None:
    engine, before = slow_server.engine, slow_server.metric("nmt_cancelled_total")
    removed = engine.removed
    call = stub(slow_server).Translate.future(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    wait_for(lambda: slow_server.metric("nmt_inflight_rows") == 1)
    call.cancel()
    wait_for(lambda: engine.removed == removed + 1)
    steps = engine.steps
    time.sleep(5 * STEP_SECONDS)
    assert engine.steps == steps and slow_server.metric("nmt_inflight_rows") == 0
    assert slow_server.metric("nmt_cancelled_total") == before + 1
    assert slow_server.metric("nmt_requests_total", method="Translate", code="CANCELLED") >= 1


def test_overload_is_refused_at_once_while_accepted_calls_finish(slow_server: ServerThread,
                                                                 reversal_engine: Engine) -> None:
    api = stub(slow_server)
    accepted = api.Translate.future(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    wait_for(lambda: slow_server.metric("nmt_inflight_rows") == 1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        api.Translate(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.search(r"queued work would be \d+ .* above the limit max_queued_work=\d+", e.value.details())
    assert time.monotonic() - started < 20 * STEP_SECONDS  # not after the accepted call
    expected = reversal_engine.translate([LONG_DIGITS])[0].hypotheses[0].text
    assert accepted.result().translations[0].hypotheses[0].text == expected


# ---- load, metrics, client ---------------------------------------------------------------

def test_200_concurrent_requests_answered_correctly_in_shared_batches(server: ServerThread,
                                                                      reversal_engine: Engine) -> None:
    rng = random.Random(5)
    texts = [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 10))) for _ in range(200)]
    steps_before = server.metric("nmt_batch_rows_count")
    single_before = server.metric("nmt_batch_rows_bucket", le="1.0")
    api = stub(server)
    calls = [api.Translate.future(pb.TranslateRequest(texts=[t]), timeout=120) for t in texts]
    answers = [c.result().translations[0].hypotheses[0].text for c in calls]
    assert answers == best(reversal_engine, texts)  # batching never changes an answer
    reversed_ = [" ".join(reversed(t.split())) for t in texts]
    assert sum(a == r for a, r in zip(answers, reversed_)) >= 190  # and the model does reverse
    steps = server.metric("nmt_batch_rows_count") - steps_before
    multi_row = steps - (server.metric("nmt_batch_rows_bucket", le="1.0") - single_before)
    assert multi_row > 0 and server.metric("nmt_batch_rows_sum") / server.metric("nmt_batch_rows_count") > 1


def test_metrics_move_with_a_known_sequence_of_requests(server: ServerThread) -> None:
    names = [("nmt_requests_total", dict(method="Translate", code="OK")),
             ("nmt_requests_total", dict(method="Translate", code="INVALID_ARGUMENT")),
             ("nmt_requests_total", dict(method="TranslateStream", code="OK")),
             ("nmt_request_duration_seconds_count", dict(method="Translate")),
             ("nmt_source_tokens_count", {}), ("nmt_decoder_steps_count", {}),
             ("nmt_generated_tokens_total", {}), ("nmt_queue_wait_seconds_count", {})]
    before = [server.metric(n, **labels) for n, labels in names]
    api = stub(server)
    replies = [api.Translate(pb.TranslateRequest(texts=["1 2 3"]), timeout=30),
               api.Translate(pb.TranslateRequest(texts=["4 5", "6 7 8 9"]), timeout=30),
               list(api.TranslateStream(pb.TranslateRequest(texts=["5 6 7"]), timeout=30))[-1]]
    with pytest.raises(grpc.RpcError):
        api.Translate(pb.TranslateRequest(texts=["1"], options=pb.DecodingOptions(beam_size=99)), timeout=30)
    generated = sum(len(t.hypotheses[0].tokens) for r in replies for t in r.translations)
    after = [server.metric(n, **labels) for n, labels in names]
    assert [a - b for a, b in zip(after, before)] == [2, 1, 1, 3, 4, 3, generated, 4]
    assert server.metric("nmt_queue_depth") == 0 and server.metric("nmt_inflight_rows") == 0
    assert server.metric("nmt_model_info", name="reversal", version="1", precision="fp32") == 1
    assert server.metric("nmt_encode_duration_seconds_count") > 0
    assert server.metric("nmt_padding_ratio_count") == server.metric("nmt_batch_rows_count")


def test_client_prints_translations_nbest_and_alignment(server: ServerThread, reversal_engine: Engine,
                                                        monkeypatch, capsys) -> None:
    assert client.main(["--server", server.address, "3 1 4", "1 5 9 2"]) == 0
    assert capsys.readouterr().out.splitlines() == best(reversal_engine, ["3 1 4", "1 5 9 2"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("1 2 3\n\n7 8\n"))
    assert client.main(["--server", server.address]) == 0
    first, last = best(reversal_engine, ["1 2 3", "7 8"])
    assert capsys.readouterr().out == f"{first}\n\n{last}\n"
    assert client.main(["--server", server.address, "--beam", "3", "--nbest", "2", "--alignment", "5 6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    top = reversal_engine.translate(["5 6"], DecodingOptions(beam_size=3, num_hypotheses=2))[0].hypotheses[0]
    assert re.fullmatch(rf"0 \|\|\| {re.escape(top.text)} \|\|\| -\d+\.\d{{4}}", lines[0])
    assert lines[1].split() == ["target", "source", "weight"]
    assert [line.split()[0] for line in lines[2:2 + len(top.tokens)]] == list(top.tokens)
    assert sum(line.startswith("1 ||| ") for line in lines) == 1
    assert client.main(["--server", server.address, "--beam", "0", "x"]) == 1
    assert "INVALID_ARGUMENT: options.beam_size must be between 1 and 4, got 0" in capsys.readouterr().err


# ---- configuration, draining, the process ------------------------------------------------

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


def test_connections_are_recycled_after_max_connection_age(reversal_repository: Path) -> None:
    """GOAWAY after --max-connection-age: the channel goes idle, and the next call reconnects."""
    s = ServerThread(config_for(reversal_repository, "--max-connection-age", "0.3", "--grace-period", "1"))
    try:
        with grpc.insecure_channel(s.address) as channel:
            states: list[grpc.ChannelConnectivity] = []
            channel.subscribe(states.append)
            stub = pb_grpc.TranslatorStub(channel)
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models

            def closed_after_ready() -> bool:  # callbacks arrive on another thread, in order
                seen = list(states)
                ready = grpc.ChannelConnectivity.READY
                return ready in seen and grpc.ChannelConnectivity.IDLE in seen[seen.index(ready):]

            deadline = time.monotonic() + 10
            while not closed_after_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert closed_after_ready(), states  # the server closed the connection
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models  # a new one
    finally:
        s.stop()


def test_bad_environment_or_repository_exits_at_once(monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setenv("NMT_PORT", "http")
    assert main([]) == 2
    assert capsys.readouterr().err == "nmt serve: NMT_PORT: must be an integer, got 'http'\n"
    monkeypatch.delenv("NMT_PORT")
    assert main(["--model-repository", str(tmp_path), "--port", "0", "--metrics-port", "0"]) == 1
    assert f"{tmp_path}: no manifest.json" in capsys.readouterr().err


def test_draining_reports_not_serving(reversal_repository: Path) -> None:
    s = ServerThread(config_for(reversal_repository))
    with grpc.insecure_channel(s.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert next(watch).status == SERVING
        s.stop(grace=1.0, wait=False)
        assert next(watch).status == NOT_SERVING
        watch.cancel()
    s.thread.join(30)


def start_process(repository: Path, *extra: str) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--model-repository",
                             str(repository), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                             *extra], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stderr:
        found = re.search(r"on 127\.0\.0\.1:(\d+) \(metrics :(\d+)/metrics\)", line)
        if found:
            return proc, f"127.0.0.1:{found.group(1)}", int(found.group(2))
    raise AssertionError(f"server exited: {proc.wait()}")


def scrape(port: int, sample: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == sample)


def test_sigterm_drains_calls_in_flight_then_exits_0(reversal_repository: Path) -> None:
    # 4 rows per step: 4 calls x 32 texts x beam 4 take thousands of steps to drain
    proc, address, metrics_port = start_process(reversal_repository, "--grace-period", "120",
                                                "--max-rows", "4")
    try:
        api = pb_grpc.TranslatorStub(grpc.insecure_channel(address))
        request = pb.TranslateRequest(texts=[LONG_DIGITS] * 32, options=pb.DecodingOptions(beam_size=4))
        submitted = scrape(metrics_port, "nmt_source_tokens_count")  # texts handed to the scheduler
        calls = [api.Translate.future(request, timeout=300) for _ in range(4)]
        answered: list[float] = []
        for call in calls:
            call.add_done_callback(lambda _: answered.append(time.monotonic()))
        wait_for(lambda: scrape(metrics_port, "nmt_source_tokens_count") == submitted + 4 * 32)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        replies = [c.result() for c in calls]
        assert all(len(r.translations) == 32 for r in replies)
        assert len({t.hypotheses[0].text for r in replies for t in r.translations}) == 1
        assert max(answered) > signalled  # answered after SIGTERM: drained, not cut off
        assert proc.wait(timeout=60) == 0
        assert "draining" in proc.stderr.read()
        with pytest.raises(grpc.RpcError) as e:
            api.Translate(pb.TranslateRequest(texts=["1 2"]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.kill()


NO_TORCH = """
import asyncio, sys
import grpc
from service.config import parse
from service.api.grpc_server import build
from service.proto.nmt.v1 import translation_pb2 as pb, translation_pb2_grpc as pb_grpc

async def main():
    app = build(parse(["--model-repository", sys.argv[1], "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0"], env={}))
    await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        reply = await pb_grpc.TranslatorStub(channel).Translate(pb.TranslateRequest(texts=["1 2 3"]))
    await app.stop(0)
    return reply.translations[0].hypotheses[0].text

text = asyncio.run(main())
print(text, sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "export", "onnx")))
"""


def test_the_server_never_imports_torch(reversal_repository: Path) -> None:
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(reversal_repository)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]"), out.stdout


def test_one_debug_line_per_request(tiny_server: ServerThread, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="nmt.server")
    stub(tiny_server).Translate(pb.TranslateRequest(texts=["Open the file", "Save"]), timeout=30)
    with pytest.raises(grpc.RpcError):
        stub(tiny_server).Translate(pb.TranslateRequest(texts=[]), timeout=30)
    wait_for(lambda: len([r for r in caplog.records if r.name == "nmt.server"]) >= 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "nmt.server"]
    assert re.fullmatch(r"Translate peer=\S+ texts=2 code=OK \d+\.\d ms", lines[0])
    assert re.fullmatch(r"Translate peer=\S+ texts=0 code=INVALID_ARGUMENT \d+\.\d ms", lines[1])
