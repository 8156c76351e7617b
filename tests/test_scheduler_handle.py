"""Scheduler: the async handle (``translate``, ``stream``) over a fake engine, in its own thread.

The pure state is ``tests/test_scheduler.py``; the stand-ins, ``tests/scheduler_fakes.py``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from scheduler_fakes import FakeEngine, config, prep
from service.config import SchedulerConfig
from service.errors import ErrorKind, NmtError
from service.interface import Final, Partial, Translation
from service.metrics import Metrics
from service.scheduling.scheduler import ENGINE_THREAD, Scheduler


def run_with(engine: FakeEngine, cfg: SchedulerConfig, body):  # body(scheduler) -> coroutine
    async def main():
        scheduler = Scheduler(engine, cfg, metrics=Metrics())
        scheduler.start()
        try:
            return await body(scheduler), scheduler
        finally:
            await scheduler.close()
    return asyncio.run(main())


def sample(scheduler: Scheduler, name: str) -> float:
    return scheduler._metrics.registry.get_sample_value(name) or 0.0


def test_translate_answers_in_order_from_one_engine_thread() -> None:
    engine = FakeEngine()
    result, scheduler = run_with(engine, config(), lambda s: s.translate([prep(5), prep(1), prep(3)]))
    assert [t.hypotheses[0].text for t in result] == ["t5", "t1", "t3"]
    assert len(engine.threads) == 1 and threading.main_thread().name not in engine.threads
    assert engine.rendered == {threading.main_thread().name}  # text is made on the event loop
    assert sample(scheduler, "nmt_batch_rows_sum") == 3 + 2 + 2 + 1 + 1  # texts leave as they finish
    assert sample(scheduler, "nmt_generated_tokens_total") == 9
    assert sample(scheduler, "nmt_inflight_rows") == 0


async def until(condition) -> None:
    """Poll (the event loop may be slow on a loaded machine: no fixed sleeps)."""
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not met")


def test_the_engine_keeps_stepping_while_the_event_loop_is_busy() -> None:
    engine = FakeEngine(step_seconds=0.001)

    async def body(s: Scheduler) -> tuple[int, str]:
        task = asyncio.create_task(s.translate([prep(100_000)]))
        await until(lambda: ("step", 1) in engine.calls)
        before = len(engine.calls)
        time.sleep(0.2)  # block the event loop: no round trip can happen
        during = len(engine.calls) - before
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return during, (await s.translate([prep(3)]))[0].hypotheses[0].text
    (during, after), _ = run_with(engine, config(), body)
    assert during >= 20  # ~200 steps of 1 ms; a step per loop round trip would give 0 or 1
    assert after == "t3"


def test_results_posted_while_the_event_loop_is_busy_arrive_in_one_wake_up_in_order() -> None:
    engine = FakeEngine(step_seconds=0.001)

    async def body(s: Scheduler) -> tuple[list[int], list[str]]:
        drained: list[int] = []  # posts taken per wake-up of the event loop
        run = s._run_posted
        s._run_posted = lambda: (drained.append(len(s._posted)), run())
        tasks = [asyncio.create_task(s.translate([prep(n)])) for n in range(1, 41)]
        await until(lambda: any(name == "step" for name, _ in engine.calls))
        time.sleep(0.2)  # ~40 steps finish a text each while the loop cannot run
        results = await asyncio.gather(*tasks)
        return drained, [r[0].hypotheses[0].text for r in results]
    (drained, texts), _ = run_with(engine, config(max_rows=64), body)
    assert texts == [f"t{n}" for n in range(1, 41)]
    assert max(drained) >= 10 and len(drained) <= 40 - 9  # one self-pipe write for many posts


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_engine_thread_is_named_where_top_and_proc_show_threads() -> None:
    def os_names() -> list[str]:
        return [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]

    async def body(s: Scheduler) -> list[str]:
        await s.translate([prep(2)])  # the engine thread has run
        return os_names()
    assert ENGINE_THREAD not in os_names()
    names, _ = run_with(FakeEngine(), config(), body)
    assert names.count(ENGINE_THREAD) == 1


def step_order(engine: FakeEngine, step_level: bool) -> list[str]:
    async def body(s: Scheduler) -> list[str]:
        order: list[str] = []

        async def one(steps: int) -> None:
            await s.translate([prep(steps)])
            order.append(f"t{steps}")
        long = asyncio.create_task(one(100))
        await until(lambda: ("step", 1) in engine.calls)  # the long text is decoding
        await one(2)
        await long
        return order
    return run_with(engine, config(step_level=step_level, max_wait=0.0), body)[0]


def test_step_level_short_request_overtakes_a_long_one() -> None:
    engine = FakeEngine(step_seconds=0.005)
    assert step_order(engine, True) == ["t2", "t100"]
    assert ("step", 2) in engine.calls  # the short text joined the running batch


def test_request_level_short_request_waits_for_the_running_batch() -> None:
    engine = FakeEngine(step_seconds=0.005)
    assert step_order(engine, False) == ["t100", "t2"]
    assert ("step", 2) not in engine.calls


def test_deadline_mid_decode_removes_rows_and_fails_the_request() -> None:
    engine = FakeEngine(step_seconds=0.01)

    async def body(s: Scheduler) -> None:
        with pytest.raises(NmtError, match="deadline exceeded") as e:
            await s.translate([prep(1000)], timeout=0.2)
        assert e.value.kind is ErrorKind.DEADLINE_EXCEEDED
        assert (await s.translate([prep(2)]))[0].hypotheses[0].text == "t2"  # still serving
    _, scheduler = run_with(engine, config(), body)
    removed = engine.calls.index(("remove", [(0, 0)]))
    assert engine.calls[removed + 1] == ("add", [(1, 0)])  # no step of the expired text after it
    assert 1 <= engine.calls[:removed].count(("step", 1)) < 100  # stopped mid-decode
    assert sample(scheduler, "nmt_inflight_rows") == 0


def test_cancelled_call_frees_its_rows_at_the_next_step() -> None:
    engine = FakeEngine(step_seconds=0.005)

    async def body(s: Scheduler) -> float:
        task = asyncio.create_task(s.translate([prep(1000, beam=2)]))
        await until(lambda: ("step", 2) in engine.calls)
        rows = sample(s, "nmt_inflight_rows")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.calls[-1][0] == "remove")
        await asyncio.sleep(0.05)
        return rows
    rows, scheduler = run_with(engine, config(), body)
    assert rows == 2 and sample(scheduler, "nmt_inflight_rows") == 0
    assert ("remove", [(0, 0)]) in engine.calls
    assert engine.calls[-1] == ("remove", [(0, 0)])  # no step after it: the batch is empty


def test_overload_is_rejected_at_once_while_accepted_work_finishes() -> None:
    async def body(s: Scheduler) -> list[Translation]:
        first = asyncio.create_task(s.translate([prep(20)]))
        await asyncio.sleep(0)
        with pytest.raises(NmtError, match="max_queued_work=20") as e:
            await s.translate([prep(20)])
        assert e.value.kind is ErrorKind.RESOURCE_EXHAUSTED
        return await first
    result, _ = run_with(FakeEngine(), config(max_queued_work=20), body)  # 1 row x 17 steps each
    assert result[0].hypotheses[0].text == "t20"


def test_engine_failure_fails_its_requests_and_the_next_batch_works() -> None:
    engine = FakeEngine()

    async def body(s: Scheduler) -> str:
        engine.fail = True
        with pytest.raises(NmtError, match="decoding failed: RuntimeError: onnxruntime exploded"):
            await s.translate([prep(3)])
        engine.fail = False
        return (await s.translate([prep(3)]))[0].hypotheses[0].text
    assert run_with(engine, config(), body)[0] == "t3"


def test_stream_sends_growing_prefixes_then_the_translations() -> None:
    async def body(s: Scheduler) -> list:
        return [event async for event in s.stream([prep(3), prep(1)])]
    events, _ = run_with(FakeEngine(), config(), body)
    assert events[:-1] == [Partial(("a", "t1")), Partial(("aa", "t1"))]
    assert isinstance(events[-1], Final)
    assert [t.hypotheses[0].text for t in events[-1].translations] == ["t3", "t1"]


@pytest.mark.parametrize("kind", ["in process", "engine process"])
def test_a_close_just_before_the_cycle_clears_the_wake_still_wakes_the_thread(kind: str) -> None:
    """``close`` sets ``_closing`` then the wake event; an engine thread (or the engine process's driver)
    that had checked ``_closing`` just before cannot clear that wake away in ``_next_cycle`` and then wait
    for ever (a full test run hung at exit on it: the driver waiting, close joining it)."""
    if kind == "in process":
        scheduler = Scheduler(FakeEngine(), config(), metrics=Metrics())
    else:
        from service.scheduling.remote import ProcessScheduler
        scheduler = ProcessScheduler(FakeEngine(), config(), metrics=Metrics())
    scheduler._closing = True  # what close does, between the thread's check of it and its cycle
    scheduler._wake.set()
    with scheduler._lock:
        scheduler._next_cycle()
    assert scheduler._wake.wait(0)  # the thread's wait returns at once, and its loop sees _closing
