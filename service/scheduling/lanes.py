"""Lanes: the running batches of one scheduler, and which one steps next.

With fairness on, a small request (at most ``SchedulerConfig.small_rows`` decoder rows in all:
one text greedy, a few texts, a short beam) decodes in the ``small`` lane, everything else in
``bulk``. Each lane is its own ``DecodeBatch``; the engine thread steps one lane per cycle, the
one furthest behind its share of engine time, a lane's share being the number of clients
decoding in it (start-time fair queueing over lanes: each lane's virtual time is its engine
seconds over its weight; a lane that was idle starts at the others' virtual time, so idling
earns no credit). So a one-text request beside three heavy clients gets about a quarter of the
engine: a few of its cheap steps after each heavy step, instead of every one of its steps
waiting for a step of 128 heavy rows. With one lane busy (every request small, or every request
big, or ``--fairness off``) it steps every cycle: the old behaviour.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from service.interface import DecodeBatch, Decoded, Key, Prepared
from service.metrics import Metrics
from service.scheduling.admission import Cycle

SMALL, BULK = "small", "bulk"
LANES = (SMALL, BULK)
SMALL_BOOST = 4
"""A client decoding in the small lane weighs this many: its request's 1-ms steps then fit
between two heavy steps of 13 ms, not one per heavy step (light p50 47 against 65 ms beside
three heavy clients, p99 about 110 against 145 ms; the engine's row-steps 0.91x: AMD Zen 3,
AVX2, ``/tmp`` traces of ``loadtest/bench_fairness.py``'s round). It costs the others only
while small requests are decoding."""


class Lanes:
    """The batches by lane, which lane holds which text, and each lane's engine time."""

    def __init__(self, new_batch: Callable[[], DecodeBatch], clock: Callable[[], float] = time.perf_counter) -> None:
        self._new_batch, self._clock = new_batch, clock
        self.batches: dict[str, DecodeBatch] = {}
        self.lane_of: dict[Key, str] = {}
        self.virtual: dict[str, float] = {lane: 0.0 for lane in LANES}  # engine seconds / weight

    @property
    def live_rows(self) -> int:
        return sum(b.live_rows for b in self.batches.values())

    def batch(self, lane: str) -> DecodeBatch:
        if lane not in self.batches:
            self.batches[lane] = self._new_batch()
        return self.batches[lane]

    def remove(self, keys: list[Key]) -> None:
        by_lane: dict[str, list[Key]] = {}
        for key in keys:
            lane = self.lane_of.pop(key, None)
            if lane is not None:
                by_lane.setdefault(lane, []).append(key)
        for lane, lane_keys in by_lane.items():
            self.batch(lane).remove(lane_keys)

    def add(self, lane: str, items: list[tuple[Key, Prepared]], encoded: Any = None) -> None:
        """``items`` join ``lane``; ``encoded``: the engine's ``encode(items)``, done already."""
        batch = self.batch(lane)
        if not batch.live_rows:  # idle until now: no credit for the time it did not use
            busy = [self.virtual[other] for other, b in self.batches.items() if other != lane and b.live_rows]
            self.virtual[lane] = max([self.virtual[lane], *busy])
        if encoded is None:
            batch.add(items)
        else:
            batch.join(encoded)  # type: ignore[attr-defined]  # an engine that encodes also joins
        self.lane_of.update((key, lane) for key, _ in items)

    def next_lane(self) -> str | None:
        """The busy lane furthest behind its share (``step`` charges each step by the lane's weight)."""
        busy = [lane for lane in LANES if lane in self.batches and self.batches[lane].live_rows]
        if not busy:
            return None
        return min(busy, key=lambda lane: (self.virtual[lane], LANES.index(lane)))

    def step(self, lane: str, weight: int) -> tuple[list[tuple[Key, Decoded]], float]:
        """One step of ``lane``; its finished texts and the seconds it took (charged to the lane)."""
        started = self._clock()
        finished = self.batch(lane).step()
        seconds = self._clock() - started
        self.virtual[lane] += seconds / max(1, weight)
        for key, _ in finished:
            self.lane_of.pop(key, None)
        return finished, seconds

    def prefix(self, key: Key) -> list[int]:
        return self.batch(self.lane_of[key]).prefix(key)


def by_lane(cycle: Cycle) -> dict[str, list[tuple[Key, Prepared]]]:
    """A cycle's texts joining, by lane (in lane order; each lane's in the cycle's order)."""
    lanes = {lane: [item for item, item_lane in zip(cycle.add, cycle.lanes) if item_lane == lane] for lane in LANES}
    return {lane: items for lane, items in lanes.items() if items}


def change(lanes: Lanes, cycle: Cycle, metrics: Metrics, encoded: dict[str, Any] | None = None) -> None:
    """A cycle's removals, then its additions (one encoder run per lane, unless ``encoded`` has the
    lane's texts encoded already: ``service.scheduling.remote``)."""
    if cycle.remove:
        lanes.remove(list(cycle.remove))
    if cycle.add:
        for waited in cycle.waited:
            metrics.queue_wait.observe(waited)
        for lane, items in by_lane(cycle).items():
            if encoded is not None and lane in encoded:
                lanes.add(lane, items, encoded[lane])
                continue
            with metrics.encode_duration.time():
                lanes.add(lane, items)


def step(lanes: Lanes, weights: dict[str, int], streaming: list[Key], metrics: Metrics
         ) -> tuple[list[tuple[Key, Decoded]], dict[Key, list[int]]]:
    """One decoder step of the lane furthest behind its share (if any): the texts it finished,
    and the agreed prefixes of its streaming texts; metrics observed here."""
    weights = {lane: w * (SMALL_BOOST if lane == SMALL else 1) for lane, w in weights.items()}
    lane = lanes.next_lane()
    if lane is None:
        return [], {}
    batch = lanes.batch(lane)
    rows, (real, padded) = batch.live_rows, batch.padded_tokens
    finished, seconds = lanes.step(lane, weights.get(lane, 1))
    metrics.decode_duration.observe(seconds)
    metrics.batch_rows.observe(rows)
    metrics.padding_ratio.observe((padded - real) / padded if padded else 0.0)
    done = {key for key, _ in finished}
    return finished, {k: lanes.prefix(k) for k in streaming if k not in done and lanes.lane_of.get(k) == lane}
