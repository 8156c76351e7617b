"""Scheduler: the pure batching and admission state, on a fake clock (no engine, no event loop).

The async handle is ``tests/test_scheduler_handle.py``; the stand-ins, ``tests/scheduler_fakes.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from scheduler_fakes import FakeEngine, config, prep
from service.errors import ErrorKind, NmtError
from service.metrics import Metrics
from service.scheduling.admission import SchedulerState
from service.scheduling.scheduler import Scheduler


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


def test_early_refusal_counts_the_least_work_and_leaves_a_too_large_request_to_submit() -> None:
    state = SchedulerState(config(max_queued_work=100))
    text = prep(length=4, beam=2)  # 2 rows x 17 steps = 34
    state.submit(0, [text, text], now=0.0, deadline=None)
    state.refuse_if_full(32)  # 68 + 32 = 100: fits
    with pytest.raises(NmtError, match=r"^server overloaded: queued work would be at least 101 \(estimated "
                       r"rows x steps; this request at least 33\), above the limit max_queued_work=100; "
                       r"retry later$") as e:
        state.refuse_if_full(33)
    assert e.value.kind is ErrorKind.RESOURCE_EXHAUSTED and state.work == 68
    state.refuse_if_full(101)  # above the limit alone: submit refuses it INVALID_ARGUMENT
    with pytest.raises(NmtError, match="request work must be at most max_queued_work=100") as e:
        state.submit(1, [prep(length=60, beam=1)], now=0.0, deadline=None)
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT


def test_the_handle_refuses_early_under_the_schedulers_lock() -> None:
    scheduler = Scheduler(FakeEngine(), config(max_queued_work=100), metrics=Metrics())
    scheduler.state.submit(0, [prep(length=4, beam=2)] * 2, now=0.0, deadline=None)  # 68 queued
    outcome: list[BaseException | None] = []

    def refuse() -> None:
        try:
            scheduler.refuse_if_full(40)
            outcome.append(None)
        except NmtError as e:
            outcome.append(e)
    with scheduler._lock:  # the engine thread deciding a cycle
        thread = threading.Thread(target=refuse)
        thread.start()
        time.sleep(0.05)
        assert outcome == []  # waits for the lock: never reads a half-updated state
        scheduler.state.cancel(0)  # the cycle frees the work before it lets go
    thread.join(10)
    assert outcome == [None]  # decided on the state after the cycle: 0 + 40 fits
