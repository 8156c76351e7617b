"""Scheduler: the pure batching state (fake clock) and the async handle (fake engine)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Hashable, Sequence

import pytest

from service.config import SchedulerConfig
from service.errors import ErrorKind, NmtError
from service.interface import Decoded, Final, Finished, Hypothesis, Partial, Prepared, Translation
from service.metrics import Metrics
from service.options import DecodingOptions
from service.scheduling.admission import SchedulerState
from service.scheduling.scheduler import Scheduler


def prep(steps: int = 3, *, length: int = 4, beam: int = 1) -> Prepared:
    """A text the fake engine decodes in ``steps`` steps; ``length`` source pieces."""
    return Prepared(text=str(steps), source_ids=tuple(range(4, 4 + length - 1)) + (3,),
                    source_pieces=("x",) * length, placeholders=(),
                    options=DecodingOptions(beam_size=beam, num_hypotheses=1))


def config(**overrides: object) -> SchedulerConfig:
    base = dict(max_rows=8, max_tokens=1000, max_wait=0.01, max_queued_work=10_000, step_level=True)
    return SchedulerConfig(**{**base, **overrides})


def added(state: SchedulerState, now: float) -> list[tuple[int, int]]:
    return [key for key, _ in state.take(now).add]


# ---- pure state -------------------------------------------------------------------------

def test_step_level_idle_batch_starts_at_once() -> None:
    state = SchedulerState(config(max_wait=0.01))
    state.submit(0, [prep()], now=0.0, deadline=None)
    assert state.next_wake(0.0) == 0.0
    assert added(state, 0.0) == [(0, 0)]


def test_request_level_idle_batch_waits_for_more_texts_up_to_max_wait() -> None:
    state = SchedulerState(config(max_wait=0.01, step_level=False))
    state.submit(0, [prep()], now=0.0, deadline=None)
    assert state.next_wake(0.0) == pytest.approx(0.01)
    assert added(state, 0.005) == []
    state.submit(1, [prep()], now=0.006, deadline=None)
    assert added(state, 0.01) == [(0, 0), (1, 0)]


def test_full_queue_starts_at_once_and_row_budget_caps_the_batch() -> None:
    state = SchedulerState(config(max_rows=4))
    state.submit(0, [prep() for _ in range(6)], now=0.0, deadline=None)
    assert state.next_wake(0.0) == 0.0
    assert added(state, 0.0) == [(0, i) for i in range(4)]
    assert added(state, 0.0) == []  # no rows free
    state.finish((0, 1))
    assert added(state, 0.0) == [(0, 4)]


def test_beam_rows_and_token_budget_count_padded_source() -> None:
    state = SchedulerState(config(max_rows=100, max_tokens=40))
    state.submit(0, [prep(length=10, beam=2), prep(length=10, beam=2), prep(length=5)], now=0.0,
                 deadline=None)
    # 2 rows x 10 + 2 rows x 10 = 40 fits; a fifth row would make 5 x 10 = 50
    assert added(state, 1.0) == [(0, 0), (0, 1)]
    assert state.running_rows == 4


def test_running_batch_admits_after_max_wait_or_when_arrivals_fill_it() -> None:
    state = SchedulerState(config(max_wait=1.0, max_rows=8))
    state.submit(0, [prep()], now=0.0, deadline=None)
    assert added(state, 0.0) == [(0, 0)]
    state.submit(1, [prep()], now=1.5, deadline=None)
    assert state.next_wake(1.5) == 1.5
    assert added(state, 1.5) == []  # arrivals share one encoder run
    assert added(state, 2.5) == [(1, 0)]  # joins the running batch (step-level)
    state.submit(2, [prep() for _ in range(7)], now=3.0, deadline=None)
    assert added(state, 3.0) == [(2, i) for i in range(6)]  # enough to fill the free rows


def test_request_level_starts_a_batch_only_when_the_running_one_is_empty() -> None:
    state = SchedulerState(config(step_level=False, max_wait=0.0))
    state.submit(0, [prep(), prep()], now=0.0, deadline=None)
    assert added(state, 0.0) == [(0, 0), (0, 1)]
    state.submit(1, [prep()], now=0.1, deadline=None)
    state.finish((0, 0))
    assert added(state, 0.2) == []
    state.finish((0, 1))
    assert added(state, 0.2) == [(1, 0)]


def test_oldest_first_then_same_length_bucket_longest_first() -> None:
    state = SchedulerState(config(max_rows=3))
    lengths = [5, 30, 6, 31, 7]
    state.submit(0, [prep(length=n) for n in lengths], now=0.0, deadline=None)
    cycle = state.take(1.0)
    assert [key for key, _ in cycle.add] == [(0, 4), (0, 2), (0, 0)]  # lengths 7, 6, 5
    assert cycle.waited == (1.0, 1.0, 1.0)
    assert [len(e.prepared.source_ids) for e in state.queue] == [30, 31]


def test_oldest_text_is_not_starved_by_smaller_ones() -> None:
    state = SchedulerState(config(max_rows=4))
    state.submit(0, [prep(beam=3)], now=0.0, deadline=None)
    assert added(state, 1.0) == [(0, 0)]
    state.submit(1, [prep(beam=2)], now=1.0, deadline=None)  # oldest queued: needs 2 rows, 1 free
    state.submit(2, [prep(beam=1)], now=1.0, deadline=None)  # would fit
    assert added(state, 1.0) == []
    state.finish((0, 0))
    assert added(state, 2.0) == [(1, 0), (2, 0)]


def test_text_bigger_than_the_budgets_runs_alone() -> None:
    state = SchedulerState(config(max_rows=2, max_tokens=10))
    state.submit(0, [prep(length=50, beam=4), prep()], now=0.0, deadline=None)
    assert added(state, 1.0) == [(0, 0)]
    assert added(state, 1.0) == []


def test_admission_limit_counts_queued_and_running_work() -> None:
    state = SchedulerState(config(max_queued_work=100))
    text = prep(length=4, beam=2)  # 2 rows x (3.0 x 4 + 5 = 17 steps) = 34
    state.submit(0, [text, text], now=0.0, deadline=None)
    added(state, 1.0)
    with pytest.raises(NmtError, match=r"queued work would be 102 .*this request 34.*max_queued_work=100"):
        state.submit(1, [text], now=1.0, deadline=None)
    state.finish((0, 0))
    state.submit(1, [text], now=1.0, deadline=None)
    assert state.work == 68


def test_cancel_drops_queued_texts_and_removes_running_rows_at_next_take() -> None:
    state = SchedulerState(config(max_rows=1))
    state.submit(0, [prep(), prep()], now=0.0, deadline=None)
    assert added(state, 1.0) == [(0, 0)]
    state.cancel(0)
    assert state.queue == [] and state.running == {} and state.work == 0
    assert state.take(1.0).remove == ((0, 0),)
    assert state.take(1.0).remove == ()


def test_finish_during_the_step_that_was_cancelled_removes_nothing() -> None:
    state = SchedulerState(config())
    state.submit(0, [prep()], now=0.0, deadline=None)
    added(state, 1.0)
    state.cancel(0)
    state.finish((0, 0))  # the engine already dropped its rows
    assert state.take(1.0).remove == ()


def test_expired_requests_queued_or_running_and_wake_for_deadlines() -> None:
    state = SchedulerState(config(max_wait=5.0, step_level=False))
    state.submit(0, [prep()], now=0.0, deadline=2.0)
    state.submit(1, [prep()], now=0.0, deadline=1.0)
    assert state.next_wake(0.0) == 1.0  # before the batch window ends
    assert added(state, 5.0) == [(0, 0), (1, 0)]
    state.submit(2, [prep()], now=5.0, deadline=6.0)
    assert state.expired(1.5) == [1]
    assert state.expired(6.0) == [0, 1, 2]


def test_next_wake_idle_is_none() -> None:
    assert SchedulerState(config()).next_wake(3.0) is None


# ---- the async handle with a fake engine ---------------------------------------------------

class FakeBatch:
    """Decodes text "n" in n steps into text[::-1]; records which thread did what."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.live: dict[Hashable, list] = {}  # key -> [prepared, steps done]

    def add(self, items: Sequence[tuple[Hashable, Prepared]]) -> None:
        self.engine.record("add", [k for k, _ in items])
        for key, p in items:
            self.live[key] = [p, 0]

    def step(self) -> list[tuple[Hashable, Decoded]]:
        self.engine.record("step", self.live_rows)
        if self.engine.fail:
            raise RuntimeError("onnxruntime exploded")
        time.sleep(self.engine.step_seconds)
        done = []
        for key, item in list(self.live.items()):
            item[1] += 1
            if item[1] >= int(item[0].text):
                del self.live[key]
                hyp = Finished(tokens=(7,) * item[1], score=-1.0, length=item[1], normalized=-1.0)
                done.append((key, Decoded(hypotheses=(hyp,), steps=item[1])))
        return done

    def remove(self, keys: Sequence[Hashable]) -> None:
        self.engine.record("remove", list(keys))
        for key in keys:
            del self.live[key]

    def prefix(self, key: Hashable) -> list[int]:
        return [7] * self.live[key][1]

    @property
    def live_rows(self) -> int:
        return sum(p.rows for p, _ in self.live.values())

    @property
    def padded_tokens(self) -> tuple[int, int]:
        lengths = [len(p.source_ids) for p, _ in self.live.values()]
        return sum(lengths), len(lengths) * max(lengths, default=0)


class FakeEngine:
    def __init__(self, step_seconds: float = 0.0) -> None:
        self.step_seconds, self.fail = step_seconds, False
        self.calls: list[tuple[str, object]] = []
        self.threads: set[str] = set()  # threads that ran the batch
        self.rendered: set[str] = set()  # threads that made text

    def record(self, what: str, arg: object) -> None:
        self.calls.append((what, arg))
        self.threads.add(threading.current_thread().name)

    def new_batch(self) -> FakeBatch:
        return FakeBatch(self)

    def translation(self, prepared: Prepared, decoded: Decoded) -> Translation:
        self.rendered.add(threading.current_thread().name)
        best = decoded.hypotheses[0]
        hyp = Hypothesis(text=f"t{prepared.text}", score=best.score, tokens=("t",) * len(best.tokens))
        return Translation(hypotheses=(hyp,), source_tokens=("x",), steps=decoded.steps)

    def partial_text(self, prepared: Prepared, ids: Sequence[int]) -> str:
        return "a" * len(ids)


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
