"""``nmt serve --engine-process on``: each model's batches decode in a child process
(``service.scheduling.remote``). The answers are the engine alone's (greedy, beam, n-best,
streaming), the child's metrics reach the server's /metrics, a killed child fails only what
it held (UNAVAILABLE) and is started again, and stopping the server leaves no child behind.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import random
import signal
import sys
import threading
import time

import grpc
import pytest

from harness import LONG_DIGITS, ROOT, ServerThread, config_for, wait_until
from service.config import parse
from service.decoding.engine import Engine
from service.options import DecodingOptions
from service.process import cores, engine_process, engine_threads, step_threads
from service.proto.nmt.v1 import translation_pb2 as pb
from service.scheduling.remote import ProcessScheduler, scheduler_for
from service.scheduling.scheduler import Scheduler

sys.path.insert(0, str(ROOT / "loadtest"))  # bench_release's descendants (the engine process's threads)


def best(engine: Engine, texts: list[str], **options: object) -> list[str]:
    return [t.hypotheses[0].text for t in engine.translate(texts, DecodingOptions(**options))]


@pytest.fixture(scope="module")
def process_server(reversal_repository):
    with ServerThread(config_for(reversal_repository, "--max-texts", "64", "--engine-process", "on")) as s:
        yield s


def child_of(server: ServerThread) -> ProcessScheduler:
    """The served model's scheduler (a ``ProcessScheduler`` with its child)."""
    (model,) = server.app.models.all
    assert isinstance(model.scheduler, ProcessScheduler)
    return model.scheduler


def test_the_flag_and_the_thread_rule() -> None:
    assert parse(["--engine-process", "on"], env={}).engine_process
    assert parse([], env={"NMT_ENGINE_PROCESS": "on"}).engine_process
    assert parse(["--engine-process", "off"], env={}).engine_process is False
    assert parse([], env={}).engine_process is None  # the default: auto
    # auto: on for one model with the CPU provider where the process may use 2 or more cores
    assert parse(["--engine-process", "auto"], env={}).engine_process is None
    assert engine_process(parse(["--engine-process", "auto"], env={})) is (cores()[0] >= 2)
    assert not engine_process(parse(["--engine-process", "auto", "--provider", "cuda"], env={}))
    assert not engine_process(parse(["--threads", "2"], env={}))  # pinned threads: in process, as asked
    config = parse(["--engine-process", "on"], env={})
    count = len(os.sched_getaffinity(0))
    assert engine_threads(config, 1) == max(1, count - 1)  # a core left to the server process
    assert engine_threads(config, 4) == max(1, (count - 1) // 4)
    assert engine_threads(parse(["--engine-process", "on", "--threads", "3"], env={}), 2) == 3


def test_the_server_process_steps_on_every_core_and_the_child_on_its_threads(process_server: ServerThread) -> None:
    """The server process's steps (idle requests) take every core, its encoder (which runs for the child
    at saturation) and the child's whole engine keep the engine's threads."""
    scheduler, (count, _) = child_of(process_server), cores()
    runtime = scheduler._engine.runtime
    assert runtime.decoder.get_session_options().intra_op_num_threads == count
    assert runtime.encoder.get_session_options().intra_op_num_threads == max(1, count - 1)


def test_the_child_builds_its_engine_with_the_engines_threads_for_steps(reversal_repository, monkeypatch) -> None:
    from types import SimpleNamespace

    import service.scheduling.remote as remote
    from service.config import SchedulerConfig
    from service.metrics import Metrics

    started: dict = {}

    class Context:  # records the child's arguments instead of starting it
        Pipe = staticmethod(multiprocessing.Pipe)

        def Process(self, **kwargs):
            started.update(kwargs)
            return SimpleNamespace(start=lambda: None, pid=0)

    monkeypatch.setattr(remote.multiprocessing, "get_context", lambda method: Context())
    engine = Engine(reversal_repository, intra_op_threads=1, step_threads=2)
    assert engine.runtime.decoder.get_session_options().intra_op_num_threads == 2
    ProcessScheduler(engine, SchedulerConfig(), metrics=Metrics())._spawn()
    assert started["args"][3] == {**engine.construction, "step_threads": None}
    assert Engine(reversal_repository, **started["args"][3]).runtime.decoder.get_session_options(
        ).intra_op_num_threads == 1


def test_only_a_loaded_onnx_engine_goes_to_a_process(reversal_repository, reversal_engine) -> None:
    from service.metrics import Metrics

    on, off = parse(["--engine-process", "on"], env={}), parse(["--engine-process", "off"], env={})
    assert type(scheduler_for(reversal_engine, on, Metrics())) is ProcessScheduler
    assert type(scheduler_for(reversal_engine, off, Metrics())) is Scheduler

    class Wrapper:  # a caller's own engine: the child could not build it
        def __getattr__(self, name):
            return getattr(reversal_engine, name)
    assert type(scheduler_for(Wrapper(), on, Metrics())) is Scheduler


def test_answers_are_the_engine_alones(process_server: ServerThread, reversal_engine: Engine) -> None:
    child = child_of(process_server).process
    assert child is not None and child.is_alive() and child.pid != os.getpid()
    rng = random.Random(11)
    texts = [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 12))) for _ in range(60)]
    bulk = process_server.api.Translate.future(pb.TranslateRequest(texts=texts[:16]), timeout=120)  # its own lane
    calls = [process_server.api.Translate.future(pb.TranslateRequest(texts=[t]), timeout=120) for t in texts]
    assert [c.result().translations[0].hypotheses[0].text for c in calls] == best(reversal_engine, texts)
    assert [t.hypotheses[0].text for t in bulk.result().translations] == best(reversal_engine, texts[:16])
    options = pb.DecodingOptions(beam_size=4, num_hypotheses=3, return_attention=True)
    reply = process_server.api.Translate(pb.TranslateRequest(texts=["1 2 3 4", "9 8"], options=options), timeout=60)
    want = reversal_engine.translate(["1 2 3 4", "9 8"], DecodingOptions(beam_size=4, num_hypotheses=3))
    assert [[h.text for h in t.hypotheses] for t in reply.translations] == \
        [[h.text for h in t.hypotheses] for t in want]
    assert all(len(h.alignments) == len(h.tokens) for t in reply.translations for h in t.hypotheses)


def test_encoded_texts_cross_a_pickle_and_join_as_if_added(reversal_engine: Engine) -> None:
    rng = random.Random(5)
    texts = [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(1, 14))) for _ in range(9)]
    items = [((0, i), reversal_engine.prepare_text(t, DecodingOptions(beam_size=1 + i % 3), i))
             for i, t in enumerate(texts)]
    encoded = pickle.loads(pickle.dumps(reversal_engine.encode(items)))
    assert len(encoded.runs) > 1  # lengths 1 to 14: more than one encoder run
    added, joined = reversal_engine.new_batch(), reversal_engine.new_batch()
    added.add(items)
    joined.join(encoded)
    results: list[dict] = [{}, {}]
    while added.live_rows or joined.live_rows:
        for batch, done in zip((added, joined), results):
            done.update(batch.step())
    assert len(results[0]) == len(texts) and results[0] == results[1]


def test_the_server_process_encodes_and_the_child_when_it_cannot(process_server: ServerThread,
                                                                  reversal_engine: Engine, monkeypatch,
                                                                  caplog) -> None:
    from service.scheduling import remote

    sched = child_of(process_server)
    assert sched._encodes  # the child took this process's int8 form ("": fp32 graphs)
    engine, calls = sched._engine, []
    encode = engine.encode
    monkeypatch.setattr(engine, "encode", lambda items: calls.append(len(items)) or encode(items))
    texts = ["4 4 1", "7 3 9 9 2", "5"] * 3  # more rows than an idle server decodes here (LOCAL_ROWS)
    reply = process_server.api.Translate(pb.TranslateRequest(texts=texts), timeout=60)
    assert [t.hypotheses[0].text for t in reply.translations] == best(reversal_engine, texts)
    assert calls == []  # the child had fewer rows than ENCODE_HERE_ROWS: it encoded them
    monkeypatch.setattr(remote, "ENCODE_HERE_ROWS", 0)  # from now on this process encodes whatever the child holds
    reply = process_server.api.Translate(pb.TranslateRequest(texts=texts), timeout=60)
    assert [t.hypotheses[0].text for t in reply.translations] == best(reversal_engine, texts)
    assert sum(calls) == len(texts)

    def broken(items):
        raise RuntimeError("no encoder here")
    monkeypatch.setattr(engine, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="nmt.engine_process"):
        reply = process_server.api.Translate(pb.TranslateRequest(texts=texts), timeout=60)
    assert [t.hypotheses[0].text for t in reply.translations] == best(reversal_engine, texts)
    assert "encoding in the server process failed" in caplog.text


def test_large_changes_and_large_ticks_do_not_wait_for_each_other(reversal_engine: Engine) -> None:
    """The driver sends changes (encoded texts) without reading ticks (attention) for a while."""
    from service.scheduling.child import Change, _decode

    server, child = multiprocessing.Pipe()
    decoding = threading.Thread(target=_decode, args=(child, reversal_engine), daemon=True)
    decoding.start()
    options = DecodingOptions(beam_size=2, return_attention=True)
    changes = []
    for n in range(80):
        items = tuple(((n, i), reversal_engine.prepare_text(LONG_DIGITS, options, i)) for i in range(4))
        changes.append(Change((), items, ("bulk",) * 4, (False,) * 4, {"bulk": 1},
                              {"bulk": reversal_engine.encode(items)}))

    def send() -> None:  # while the child steps and its ticks pile up unread
        for c in changes:
            server.send(c)
            time.sleep(0.01)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(60)
    assert not sender.is_alive(), "the child stopped reading while its ticks were unread"
    finished: dict = {}
    while len(finished) < 320:
        finished.update(server.recv().finished)
    server.send(None)
    decoding.join(10)
    assert not decoding.is_alive()
    want = reversal_engine.decode([reversal_engine.prepare_text(LONG_DIGITS, options, 0)])[0]
    assert all(d.hypotheses[0].tokens == want.hypotheses[0].tokens for d in finished.values())
    assert sum(len(d.hypotheses[0].attention) for d in finished.values()) * 4 * len(LONG_DIGITS.split()) > 1 << 19


@pytest.mark.parametrize("form, encodes", [("", True), ("u8s8", False)])
def test_the_server_encodes_only_for_a_child_of_its_int8_form(reversal_engine: Engine, form: str,
                                                              encodes: bool, caplog) -> None:
    from service.config import SchedulerConfig
    from service.metrics import Metrics

    sched = ProcessScheduler(reversal_engine, SchedulerConfig(), metrics=Metrics())
    sched._conn, child = multiprocessing.Pipe()
    child.send(("ready", form))  # what the child says once loaded: its int8 form
    with caplog.at_level(logging.WARNING, logger="nmt.engine_process"):
        assert sched._ready()
    assert sched._encodes is encodes and ("the child encodes" in caplog.text) is not encodes


def test_streaming_sends_prefixes_then_the_same_final(process_server: ServerThread) -> None:
    request = pb.TranslateRequest(texts=[LONG_DIGITS, "1 2"])
    responses = list(process_server.api.TranslateStream(request, timeout=60))
    partials, final = responses[:-1], responses[-1]
    assert partials and all(p.kind == pb.RESULT_KIND_PARTIAL for p in partials)
    assert final == process_server.api.Translate(request, timeout=60)
    answer = final.translations[0].hypotheses[0].text
    assert all(answer.startswith(p.translations[0].hypotheses[0].text) for p in partials)


def test_the_childs_metrics_reach_the_server(process_server: ServerThread) -> None:
    names = ["nmt_decoder_steps_count", "nmt_batch_rows_count", "nmt_encode_duration_seconds_count",
             "nmt_source_tokens_count", "nmt_requests_total"]
    labels = [{}, {}, {}, {}, dict(method="Translate", code="OK")]
    before = [process_server.metric(n, **kw) for n, kw in zip(names, labels)]
    process_server.api.Translate(pb.TranslateRequest(texts=["1 2 3", "4 5 6 7"] * 5), timeout=30)  # to the child
    after = [process_server.metric(n, **kw) for n, kw in zip(names, labels)]
    moved = dict(zip(names, (a - b for a, b in zip(after, before))))
    assert moved["nmt_requests_total"] == 1 and moved["nmt_source_tokens_count"] == 10
    assert moved["nmt_decoder_steps_count"] > 0 and moved["nmt_batch_rows_count"] > 0
    assert moved["nmt_encode_duration_seconds_count"] > 0
    assert process_server.metric("nmt_inflight_rows") == 0 and process_server.metric("nmt_queue_depth") == 0


def test_a_killed_child_fails_what_it_held_and_another_starts(process_server: ServerThread,
                                                              reversal_engine: Engine) -> None:
    sched = child_of(process_server)
    first = sched.process
    many = pb.TranslateRequest(texts=[LONG_DIGITS] * 64, options=pb.DecodingOptions(beam_size=4))
    calls = [process_server.api.Translate.future(many, timeout=120) for _ in range(4)]
    wait_until(lambda: process_server.metric("nmt_inflight_rows") > 0, timeout=30, what="rows decoding")
    os.kill(first.pid, signal.SIGKILL)
    codes = []
    for c in calls:
        try:
            c.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
            if e.code() is grpc.StatusCode.UNAVAILABLE:
                assert "engine process stopped" in e.details() and "retry" in e.details()
    assert grpc.StatusCode.UNAVAILABLE in codes and set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
    assert process_server.api.Translate(pb.TranslateRequest(texts=["3 1 4"]), timeout=120) \
        .translations[0].hypotheses[0].text == best(reversal_engine, ["3 1 4"])[0]
    assert sched.process is not first and sched.process.is_alive()
    # killed while idle: the next request waits for the next child instead of failing
    second = sched.process
    os.kill(second.pid, signal.SIGKILL)
    second.join(10)
    assert process_server.api.Translate(pb.TranslateRequest(texts=["2 7"]), timeout=120) \
        .translations[0].hypotheses[0].text == best(reversal_engine, ["2 7"])[0]
    assert sched.process is not second and sched.process.is_alive()


def test_stopping_the_server_stops_the_child(reversal_repository) -> None:
    server = ServerThread(config_for(reversal_repository, "--engine-process", "on"))
    try:
        assert server.api.Translate(pb.TranslateRequest(texts=["5 6"]), timeout=60).translations
        child = child_of(server).process
        assert child.is_alive()
    finally:
        server.stop()
    child.join(10)
    assert not child.is_alive() and child.exitcode == 0


def test_an_idle_server_decodes_a_small_request_itself(process_server: ServerThread, reversal_engine: Engine,
                                                        monkeypatch) -> None:
    """A cycle of at most LOCAL_ROWS rows that finds the child idle decodes in the server process
    (no hops to the child and back); a larger one, or one arriving while that decodes, goes to the child."""
    from service.scheduling import remote

    monkeypatch.setattr(remote, "LOCAL_QUIET", 0.0)  # however recently the child decoded (the next test)
    sched = child_of(process_server)
    sent = []
    send = sched._conn.send
    monkeypatch.setattr(sched._conn, "send", lambda message: sent.append(message) or send(message))
    small = ["3 1 4 1 5", "9 2"]
    reply = process_server.api.Translate(pb.TranslateRequest(texts=small), timeout=60)
    assert [t.hypotheses[0].text for t in reply.translations] == best(reversal_engine, small)
    assert not [m for m in sent if m is not None and m.add]  # nothing went to the child
    options = pb.DecodingOptions(beam_size=4, num_hypotheses=2)  # 3 texts x 4 rows: more than LOCAL_ROWS
    reply = process_server.api.Translate(pb.TranslateRequest(texts=small + ["7"], options=options), timeout=60)
    want = reversal_engine.translate(small + ["7"], DecodingOptions(beam_size=4, num_hypotheses=2))
    assert [[h.text for h in t.hypotheses] for t in reply.translations] == [[h.text for h in t.hypotheses] for t in want]
    assert sum(len(m.add) for m in sent if m is not None) == 3
    # a long text decoding here, then arrivals (to the child, if it still decodes): all answered right
    sent.clear()
    first = process_server.api.Translate.future(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    later = [process_server.api.Translate.future(pb.TranslateRequest(texts=[t]), timeout=60) for t in small]
    assert first.result().translations[0].hypotheses[0].text == best(reversal_engine, [LONG_DIGITS])[0]
    assert [c.result().translations[0].hypotheses[0].text for c in later] == best(reversal_engine, small)
    assert process_server.metric("nmt_inflight_rows") == 0


def test_a_small_request_decodes_here_only_once_the_child_was_quiet(process_server: ServerThread,
                                                                     reversal_engine: Engine, monkeypatch) -> None:
    """At saturation the child empties for a moment now and then: a text arriving then goes to the child
    unless the child has had no rows for LOCAL_QUIET seconds (decoding here takes the event loop's GIL)."""
    from service.scheduling import remote

    sched = child_of(process_server)
    sent = []
    send = sched._conn.send
    monkeypatch.setattr(sched._conn, "send", lambda message: sent.append(message) or send(message))
    monkeypatch.setattr(remote, "LOCAL_QUIET", 3600.0)
    ticks = sched._ticks

    def late(here, *, wait: bool):  # read late, the child's ticks come at once, the last with no rows (a busy CI)
        time.sleep(0.3 if wait else 0.0)
        return ticks(here, wait=wait)

    monkeypatch.setattr(sched, "_ticks", late)
    small = ["3 1 4 1 5", "9 2"]
    process_server.api.Translate(pb.TranslateRequest(texts=small * 5), timeout=60)  # 10 rows: the child's
    reply = process_server.api.Translate(pb.TranslateRequest(texts=small), timeout=60)
    assert [t.hypotheses[0].text for t in reply.translations] == best(reversal_engine, small)
    assert sum(len(m.add) for m in sent if m is not None) == 12  # the child decoded within the hour: its
    sent.clear()
    monkeypatch.setattr(remote, "LOCAL_QUIET", 0.0)
    reply = process_server.api.Translate(pb.TranslateRequest(texts=small), timeout=60)
    assert [t.hypotheses[0].text for t in reply.translations] == best(reversal_engine, small)
    assert not [m for m in sent if m is not None and m.add]  # quiet long enough: decoded here


def _policies(pid: int, *, child: bool = True) -> set[int]:
    """The scheduling policies of every thread of ``pid`` and of its descendants (an engine
    process among them if ``child``)."""
    from bench_release import descendants

    pids = [pid, *descendants(pid)]
    assert not child or len(pids) >= 2, "no engine process"
    return {os.sched_getscheduler(int(t)) for p in pids for t in os.listdir(f"/proc/{p}/task")}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_nmt_serve_runs_sched_batch_with_an_engine_process(reversal_repository, tmp_path) -> None:
    """auto: SCHED_BATCH for every thread and the engine process where there is one; in process (where
    it measured slower) and with off, the policy nmt serve was started with."""
    from harness import ServerProcess

    assert parse([], env={}).sched_batch is None  # auto
    assert parse([], env={"NMT_SCHED_BATCH": "off"}).sched_batch is False
    assert parse(["--sched-batch", "on"], env={}).sched_batch is True
    with ServerProcess(reversal_repository, tmp_path / "auto.log", "--engine-process", "on") as server:
        assert _policies(server.proc.pid) == {os.SCHED_BATCH}  # every thread, and the engine process's
        assert "scheduling: SCHED_BATCH" in server.log_text()
        assert server.api.Translate(pb.TranslateRequest(texts=["1 2 3"]), timeout=60).translations
    for flags in (("--engine-process", "on", "--sched-batch", "off"), ("--engine-process", "off")):
        with ServerProcess(reversal_repository, tmp_path / "other.log", *flags) as server:
            assert _policies(server.proc.pid, child=flags[1] == "on") == {os.sched_getscheduler(0)}


def test_split_sends_removals_where_their_texts_decode() -> None:
    from service.scheduling.admission import Cycle
    from service.scheduling.lanes import Lanes
    from service.scheduling.remote import LOCAL_ROWS, _split

    here = Lanes(lambda: None)
    here.lane_of[(1, 0)] = "small"
    class Text:  # a prepared text: only its rows are read
        def __init__(self, rows: int) -> None:
            self.rows = rows
    add = tuple(((2, i), Text(2)) for i in range(LOCAL_ROWS // 2))
    cycle = Cycle(remove=((1, 0), (3, 0)), add=add, waited=(0.0,) * len(add), lanes=("small",) * len(add))
    theirs, mine = _split(cycle, here, idle=True)
    assert theirs == Cycle(remove=((3, 0),)) and mine.remove == ((1, 0),) and mine.add == add
    theirs, mine = _split(cycle, here, idle=False)  # something decodes: the texts go to the child
    assert theirs.add == add and theirs.remove == ((3, 0),) and mine == Cycle(remove=((1, 0),))
    bigger = Cycle(add=add + (((4, 0), Text(1)),), waited=(0.0,) * (len(add) + 1), lanes=("small",) * (len(add) + 1))
    assert _split(bigger, here, idle=True)[0].add == bigger.add  # over LOCAL_ROWS: the child's


def test_auto_stays_in_process_on_one_core_or_with_several_models(monkeypatch) -> None:
    import service.process

    auto = parse(["--engine-process", "auto"], env={})
    monkeypatch.setattr(service.process, "cores", lambda: (1, True))
    assert not engine_process(auto) and engine_process(parse(["--engine-process", "on"], env={}))
    assert engine_threads(auto, 1) == 1  # in process: the one core
    assert step_threads(auto, 1) is None
    monkeypatch.setattr(service.process, "cores", lambda: (2, True))
    assert engine_process(auto) and not engine_process(auto, models=2)  # one model only
    assert engine_threads(auto, 1) == 1  # the child: the cores less the server process's
    # the server process's steps (idle requests only) take both cores; not the child's, not several models'
    assert step_threads(auto, 1) == 2 and step_threads(auto, 2) is None
    assert step_threads(parse(["--engine-process", "on", "--threads", "1"], env={}), 1) is None
    assert step_threads(parse(["--engine-process", "off"], env={}), 1) is None


def test_a_failure_in_the_server_process_fails_its_texts_and_frees_their_rows(process_server: ServerThread,
                                                                               reversal_engine: Engine,
                                                                               monkeypatch) -> None:
    """An encoder run that fails while an idle request joins in the server process: that request fails
    (INTERNAL), none of its rows stay counted, and the next request is answered."""
    runtime = child_of(process_server)._engine.runtime

    def broken(*args):
        raise RuntimeError("encoder down")
    monkeypatch.setattr(runtime, "encode", broken)
    with pytest.raises(grpc.RpcError) as failed:
        process_server.api.Translate(pb.TranslateRequest(texts=["3 1 4"]), timeout=10)
    assert failed.value.code() is grpc.StatusCode.INTERNAL and "encoder down" in failed.value.details()
    assert process_server.metric("nmt_inflight_rows") == 0
    monkeypatch.undo()
    reply = process_server.api.Translate(pb.TranslateRequest(texts=["3 1 4"]), timeout=30)
    assert reply.translations[0].hypotheses[0].text == best(reversal_engine, ["3 1 4"])[0]
