"""Fairness between clients (issue 31): decoder rows go to the client with the fewest, its oldest
text first; a newcomer joins ahead of another client's backlog; a client's oldest text keeps the
rows it waits for; who a client is (token, peer, x-client-id); per-client gauges."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harness import config_for
from scheduler_fakes import FakeEngine, config, prep
from service.api.frontend import Frontend, peer_address
from service.app import ServedModels
from service.metrics import Metrics
from service.scheduling.admission import SchedulerState
from service.scheduling.client_metrics import MAX_CLIENTS, ClientGauges
from service.scheduling.scheduler import Scheduler


def added(state: SchedulerState, now: float) -> list[tuple[int, int]]:
    return [key for key, _ in state.take(now).add]


def test_heavy_clients_take_rows_in_turns() -> None:
    state = SchedulerState(config(max_rows=16))
    for request, client in enumerate("ABC"):
        state.submit(request, [prep(beam=4) for _ in range(4)], now=request * 0.1, deadline=None, client=client)
    assert sorted(added(state, 1.0)) == [(0, 0), (0, 1), (1, 0), (2, 0)]  # A, B, C, then A (oldest)
    assert dict(state.client_rows) == {"A": 8, "B": 4, "C": 4}
    state.finish((0, 0))
    assert added(state, 1.1) == [(1, 1)]  # A, B and C have 4 rows each: B was served least recently


def test_a_newcomer_joins_ahead_of_another_clients_backlog() -> None:
    state = SchedulerState(config(max_rows=16))
    state.submit(0, [prep(beam=4) for _ in range(10)], now=0.0, deadline=None, client="heavy")
    assert len(added(state, 0.0)) == 4
    state.submit(1, [prep()], now=1.0, deadline=None, client="light")
    state.finish((0, 0))  # 4 rows free: the light client has none decoding, it goes first
    assert added(state, 1.0) == [(1, 0)]  # and the heavy one's next text (4 rows) waits: 13 + 4 > 16
    assert state.client_work["heavy"] > 0 and "light" not in state.client_work


def test_the_least_served_clients_oldest_text_keeps_the_rows_it_waits_for() -> None:
    state = SchedulerState(config(max_rows=8))
    state.submit(0, [prep(beam=1) for _ in range(7)], now=0.0, deadline=None, client="A")
    assert len(added(state, 0.0)) == 7
    state.submit(1, [prep(beam=4)], now=1.0, deadline=None, client="B")  # 1 row free: does not fit
    state.submit(2, [prep(beam=1)], now=1.0, deadline=None, client="A")  # would fit
    assert added(state, 1.0) == []  # B has fewer rows: its text waits for room, A does not overtake
    for i in range(3):
        state.finish((0, i))
    assert added(state, 2.0) == [(1, 0)]


def test_one_client_keeps_the_old_order() -> None:
    state = SchedulerState(config(max_rows=3))
    state.submit(0, [prep(length=n) for n in [5, 30, 6, 31, 7]], now=0.0, deadline=None, client="solo")
    assert added(state, 1.0) == [(0, 4), (0, 2), (0, 0)]


def _frontend(repository: Path, *flags: str) -> Frontend:
    config = config_for(repository, *flags)
    metrics = Metrics()
    return Frontend(config=config, models=ServedModels(config, [], metrics), metrics=metrics)


def test_who_a_client_is(reversal_repository: Path, tmp_path: Path) -> None:
    assert peer_address("ipv4:10.1.2.3:5123") == "10.1.2.3" and peer_address("ipv6:[::1]:80") == "::1"
    assert peer_address("127.0.0.1") == "127.0.0.1"
    door = _frontend(reversal_repository)
    assert door.client(authorization="Bearer abc", peer="ipv4:10.0.0.1:99", client_id="me") == "10.0.0.1"
    tokens = tmp_path / "tokens"
    tokens.write_text("abc\n")
    keyed = _frontend(reversal_repository, "--auth-token-file", str(tokens))
    who = keyed.client(authorization="Bearer abc", peer="ipv4:10.0.0.1:99", client_id="me")
    assert who.startswith("token:") and "abc" not in who
    assert who != keyed.client(authorization="Bearer abd", peer="ipv4:10.0.0.1:99")
    trusting = _frontend(reversal_repository, "--trust-client-id", "on")
    assert trusting.client(authorization=None, peer="ipv4:10.0.0.1:99", client_id="me\x00" + "x" * 99) == (
        "id:me" + "x" * 62)
    assert trusting.client(authorization=None, peer="ipv4:10.0.0.1:99", client_id=None) == "10.0.0.1"


def _series(metrics: Metrics, name: str) -> dict[str, float]:
    return {s.labels["client"]: s.value for m in metrics.registry.collect() if m.name == name
            for s in m.samples}


def test_per_client_gauges_come_and_go() -> None:
    metrics = Metrics()
    scheduler = Scheduler(FakeEngine(step_seconds=0.02), config(max_rows=4), metrics=metrics)

    async def main() -> dict[str, float]:
        scheduler.start()
        try:
            slow = asyncio.create_task(scheduler.translate([prep(steps=30, beam=2)], client="A"))
            await asyncio.sleep(0.1)
            seen = _series(metrics, "nmt_client_rows")
            await slow
            return seen
        finally:
            await scheduler.close()
    seen = asyncio.run(main())
    assert seen == {"A": 2.0}
    assert _series(metrics, "nmt_client_rows") == {} and _series(metrics, "nmt_client_queued_work") == {}


def test_a_crowd_of_clients_adds_up_under_other() -> None:
    metrics = Metrics()
    gauges = ClientGauges.of(metrics)
    rows = {f"10.0.0.{i}": i + 1 for i in range(MAX_CLIENTS + 5)}
    gauges.set("m/1", rows, {})
    shown = _series(metrics, "nmt_client_rows")
    assert len(shown) == MAX_CLIENTS + 1 and shown["other"] == sum(range(1, 6))
    assert ClientGauges.of(metrics) is gauges


def test_a_small_request_decodes_in_its_own_lane_with_its_own_rows() -> None:
    state = SchedulerState(config(max_rows=8, small_rows=2))
    state.submit(0, [prep(beam=4), prep(beam=4), prep(beam=4)], now=0.0, deadline=None, client="heavy")
    assert added(state, 0.0) == [(0, 0), (0, 1)]  # the bulk lane's 8 rows are full
    state.submit(1, [prep()], now=1.0, deadline=None, client="light")
    cycle = state.take(1.0)
    assert [key for key, _ in cycle.add] == [(1, 0)] and cycle.lanes == ("small",)
    assert state.lane_weights() == {"bulk": 1, "small": 1}


def test_the_small_lane_holds_twice_the_rows_and_tokens_of_the_bulk_lane() -> None:
    from service.scheduling.admission import SMALL_LANE_SCALE

    assert SMALL_LANE_SCALE == 2
    state = SchedulerState(config(max_rows=4, max_tokens=1000, small_rows=1))
    for client in range(10):  # one-row requests of ten clients: the small lane
        state.submit(client, [prep()], now=0.0, deadline=None, client=f"c{client}")
    cycle = state.take(0.0)
    assert len(cycle.add) == 8 and set(cycle.lanes) == {"small"}  # 2 x max_rows
    state.submit(10, [prep()] * 6, now=0.0, deadline=None, client="bulky")  # 6 rows: bulk
    assert [lane for lane in state.take(0.0).lanes] == ["bulk"] * 2  # bulk texts join 2 a cycle beside small ones
    assert len(state.take(0.0).add) == 2 and not state.take(0.0).add  # and stop at max_rows
    tokens = SchedulerState(config(max_rows=100, max_tokens=40, small_rows=1))
    for client in range(25):  # 4-piece sources: 20 rows make 80 tokens, 2 x max_tokens
        tokens.submit(client, [prep()], now=0.0, deadline=None, client=f"c{client}")
    assert len(tokens.take(0.0).add) == 20


class _TimedBatch:
    """A batch whose step takes ``cost`` seconds of a fake clock, and never finishes a text."""

    def __init__(self, clock: list[float], cost: float) -> None:
        self.clock, self.cost, self.live_rows = clock, cost, 0

    def add(self, items) -> None:
        self.live_rows += len(items)

    def step(self) -> list:
        self.clock[0] += self.cost
        return []


def test_lanes_share_the_engine_by_their_clients() -> None:
    from service.scheduling.lanes import BULK, SMALL, Lanes

    clock = [0.0]
    costs = iter([0.012, 0.001])  # the bulk lane's batch is made first
    lanes = Lanes(lambda: _TimedBatch(clock, next(costs)), clock=lambda: clock[0])
    lanes.add(BULK, [((0, 0), None)])
    lanes.add(SMALL, [((1, 0), None)])
    order = []
    for _ in range(20):
        lane = lanes.next_lane()
        lanes.step(lane, {BULK: 3, SMALL: 1}[lane])
        order.append(lane)
    assert order.count(SMALL) / order.count(BULK) == pytest.approx(4, abs=1)  # 1 ms steps: 4 per 12 ms / 3
    assert lanes.next_lane() is not None
