"""Who joins the batch, checked against the policy written as a plain loop.

``SchedulerState._choose`` finds whose turn it is with a heap and stops once every lane is
closed (a full lane closes: every text has a row). The reference below is the policy as
``docs/serving.md`` states it, one text at a time with a ``min`` over every client and no early
stop; on random traffic (submits, cycles, finishes, cancels) both must admit the same texts in
the same order.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_fakes import config, prep
from service.scheduling import admission
from service.scheduling.admission import BULK_TEXTS_WHILE_SHARED, SchedulerState, client_order


class Reference(SchedulerState):
    def _choose(self, now: float) -> list:
        if not self.queue or (self.running and not self.config.step_level):
            return []
        idle, rows, longest = not self.running, Counter(), Counter()
        for e in self.running.values():
            rows[e.lane] += e.prepared.rows
            longest[e.lane] = max(longest[e.lane], len(e.prepared.source_ids))
        def room(lane: str) -> tuple[int, int]:  # the small lane's budgets are SMALL_LANE_SCALE times
            scale = admission.SMALL_LANE_SCALE if lane == "small" else 1
            return self.config.max_rows * scale, self.config.max_tokens * scale
        free = max(room(e.lane)[0] - rows.get(e.lane, 0) for e in self.queue)
        if free <= 0 or self._should_wait(now, idle=idle, free_rows=free):
            return []
        by_client, heads = self._by_client()
        orders = {c: client_order(entries) for c, entries in by_client.items()}
        load = Counter({c: self.client_rows.get(c, 0) for c in orders})
        share = self.config.max_rows / max(1, len(set(orders) | set(self.client_rows)))
        shared = rows["small"] > 0 or any(e.lane == "small" for e in self.queue)
        chosen, closed, bulk = [], set(), 0
        while orders:
            client = min(orders, key=lambda c: (0, load[c], self.served_at.get(c, -1), heads[c].arrived)
                         if load[c] < share else (1, heads[c].arrived, 0, 0.0))
            e = orders[client].pop()
            if not orders[client]:
                del orders[client]
            if e.lane in closed or (e.lane == "bulk" and shared and bulk >= BULK_TEXTS_WHILE_SHARED):
                continue
            n, width = rows[e.lane] + e.prepared.rows, max(longest[e.lane], len(e.prepared.source_ids))
            if (n > room(e.lane)[0] or n * width > room(e.lane)[1]) and not (idle and not chosen):
                if e is heads[client]:
                    closed.add(e.lane)
                continue
            self._admissions += 1
            self.served_at[client], load[client] = self._admissions, load[client] + e.prepared.rows
            rows[e.lane], longest[e.lane], bulk = n, width, bulk + (e.lane == "bulk")
            chosen.append(e)
        return chosen


TEXT = st.tuples(st.integers(1, 40), st.sampled_from([1, 1, 2, 5]))  # (source pieces, beam)
OP = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 9), st.lists(TEXT, min_size=1, max_size=9)),
    st.tuples(st.just("take"), st.sampled_from([0.0, 0.001, 0.02])),
    st.tuples(st.just("finish"), st.integers(0, 1000)),
    st.tuples(st.just("cancel"), st.integers(0, 1000)))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OP, max_size=80), max_rows=st.sampled_from([4, 8, 32]),
       max_tokens=st.sampled_from([40, 300, 5000]), small_rows=st.sampled_from([0, 4]),
       step_level=st.booleans())
def test_the_heap_and_the_early_stop_admit_what_the_plain_policy_admits(
        ops: list, max_rows: int, max_tokens: int, small_rows: int, step_level: bool) -> None:
    cfg = config(max_rows=max_rows, max_tokens=max_tokens, small_rows=small_rows, step_level=step_level,
                 max_wait=0.01, max_queued_work=100_000)
    states, now, requests = (SchedulerState(cfg), Reference(cfg)), 0.0, 0
    for op in ops:
        if op[0] == "submit":
            texts = [prep(length=length, beam=beam) for length, beam in op[2]]
            for s in states:
                s.submit(requests, texts, now=now, deadline=None, client=f"c{op[1]}")
            requests += 1
        elif op[0] == "take":
            now += op[1]
            got, expected = (s.take(now) for s in states)
            assert (got.remove, got.add, got.waited, got.lanes) == (
                expected.remove, expected.add, expected.waited, expected.lanes)
        elif op[0] == "finish" and states[0].running:
            key = sorted(states[0].running)[op[1] % len(states[0].running)]
            for s in states:
                s.finish(key)
        elif op[0] == "cancel" and requests:
            for s in states:
                s.cancel(op[1] % requests)
        assert states[0].client_rows == states[1].client_rows and states[0].served_at == states[1].served_at


def test_a_full_lane_ends_the_cycle_without_visiting_every_queued_text(monkeypatch) -> None:
    """Four clients of 50 texts each, two free rows: the plain loop popped all 196 queued texts
    (and ordered every client's); now two texts of two clients."""
    state = SchedulerState(config(max_rows=4, max_tokens=1000, max_queued_work=100_000))
    for client in range(4):
        state.submit(client, [prep() for _ in range(50)], now=0.0, deadline=None, client=f"c{client}")
    assert len(state.take(0.0).add) == 4
    for key in sorted(state.running)[:2]:
        state.finish(key)
    popped: list = []
    monkeypatch.setattr(admission, "client_order", lambda entries: _Counting(client_order(entries), popped))
    assert [key for key, _ in state.take(1.0).add] == [(0, 1), (1, 1)]
    assert len(popped) == 2


class _Counting(list):
    def __init__(self, items: list, log: list) -> None:
        super().__init__(items)
        self.log = log

    def pop(self, *args):  # type: ignore[override]
        item = super().pop(*args)
        self.log.append(item)
        return item
