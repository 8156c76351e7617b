"""Admission: which queued texts join the running batch, and when. Pure code.

``SchedulerState`` is the "pure state" half of the scheduler (handle + pure state + one background
task, as text-generation-inference's ``router/src/queue.rs``): plain synchronous code with the clock
passed in, no I/O and no engine, tested on its own (``tests/test_scheduler.py``). It keeps the
queued texts (arrival order), the texts decoding, the estimated work (rows x steps) for admission
control, and decides each cycle's removals and additions within the row and token budgets.
``service.scheduling.scheduler.Scheduler`` drives it from the event loop.

Fairness between clients (a token's identity, else the peer address): each client with work is owed
an equal share of the rows (``max_rows`` over the clients queued or decoding). Clients below their
share go first, the one with the fewest rows decoding first (rows this cycle's choices included; the
least recently served among equals), its oldest text first, then its texts of that text's length
bucket (less padding); clients at or above their share then take what is left oldest text first, so
that heavy requests finish one after another instead of all late together. So a newcomer's text
joins at the next rows that free up, ahead of any backlog, and no client's backlog pushes others
out; when a client's oldest text does not fit, its lane's rows are kept for it (nobody starves).
Small requests decode in a lane of their own, with its own budgets, ``SMALL_LANE_SCALE`` times the
bulk lane's (``service.scheduling.lanes``). With one client it is the old order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from service.config import SchedulerConfig
from service.errors import ErrorKind, NmtError, invalid
from service.interface import Key, Prepared

BUCKET_TOKENS = 8
"""Sources whose lengths fall in the same 8-piece bucket are batched together first."""
SMALL_LANE_SCALE = 2
"""The small lane's budgets are this many times ``max_rows`` and ``max_tokens`` (the bulk lane's, whose
steps a small request waits for): one step of 256 small rows serves more than two of 128 (Zen 4)."""
BULK_TEXTS_WHILE_SHARED = 2
"""While small requests decode or wait, at most this many bulk texts join per cycle: one long
encoder run of eight heavy texts would hold up every small request's next step."""


def overloaded(*, total: int, work: int, limit: int, bound: str = "") -> NmtError:
    """The one overload refusal: queued work would be ``total`` with this request's ``work``;
    ``bound`` "at least " when the work is a lower bound (before tokenizing)."""
    return NmtError(ErrorKind.RESOURCE_EXHAUSTED,
                    f"server overloaded: queued work would be {bound}{total} (estimated rows x "
                    f"steps; this request {bound}{work}), above the limit max_queued_work={limit}; "
                    "retry later")


@dataclass
class Entry:
    """One text of a request, queued or decoding."""

    key: Key
    prepared: Prepared
    arrived: float  # clock() when submitted
    deadline: float | None  # clock() after which the request fails
    stream: bool = False  # the request wants the agreed prefix after every step
    client: str = ""  # who sent it (fairness): a token's identity, else the peer address
    lane: str = "bulk"  # the batch it decodes in (``service.scheduling.lanes``)


def client_order(entries: list[Entry]) -> list[Entry]:
    """A client's queued texts (arrival order) in the order it would add them, reversed (pop()
    takes the next): its oldest text, then by distance of length bucket to the oldest's, then
    arrival."""
    head = entries[0]
    bucket = len(head.prepared.source_ids) // BUCKET_TOKENS
    rest = sorted(range(1, len(entries)), key=lambda i: (
        abs(len(entries[i].prepared.source_ids) // BUCKET_TOKENS - bucket), i))
    return [entries[i] for i in reversed(rest)] + [head]


@dataclass(frozen=True)
class Cycle:
    """What the next engine cycle does, in this order."""

    remove: tuple[Key, ...] = ()  # rows to drop (cancelled, deadline passed)
    add: tuple[tuple[Key, Prepared], ...] = ()  # texts to encode, longest first
    waited: tuple[float, ...] = ()  # queue wait of each added text, seconds
    lanes: tuple[str, ...] = ()  # the lane of each added text


class SchedulerState:
    """Which texts decode next. Pure: no I/O, no engine, time passed in."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.budgets = {lane: (config.max_rows * scale, config.max_tokens * scale)  # rows, rows x padded length
                        for lane, scale in (("small", SMALL_LANE_SCALE), ("bulk", 1))}
        self.queue: list[Entry] = []  # arrival order
        self.running: dict[Key, Entry] = {}
        self.pending_removal: list[Key] = []
        self.work = 0  # estimated rows x steps of queued and running texts
        self.client_rows: Counter[str] = Counter()  # decoder rows of the running texts, by client
        self.client_work: Counter[str] = Counter()  # estimated work of the queued texts, by client
        self.queued_rows: Counter[str] = Counter()  # decoder rows of the queued texts, by lane
        self.served_at: dict[str, int] = {}  # client -> the admission count when it last got rows
        self._admissions = 0

    @property
    def running_rows(self) -> int:  # decoder rows of the running texts
        return sum(self.client_rows.values())

    def submit(self, request_id: int, prepared: Sequence[Prepared], *, now: float,
               deadline: float | None, stream: bool = False, client: str = "") -> None:
        """Queue a request's texts, or raise RESOURCE_EXHAUSTED naming the limit (INVALID_ARGUMENT
        when the request alone exceeds it: no retry could ever succeed)."""
        work = sum(p.work for p in prepared)
        limit = self.config.max_queued_work
        if work > limit:
            raise invalid("request work", f"at most max_queued_work={limit} (estimated rows x steps: "
                          "beam_size x maximum target length, summed over texts; lower beam_size or "
                          "max_decoding_length, or send fewer or shorter texts)", work)
        if self.work + work > limit:
            raise overloaded(total=self.work + work, work=work, limit=limit)
        self.work += work
        self.client_work[client] += work
        lane = "small" if 0 < sum(p.rows for p in prepared) <= self.config.small_rows else "bulk"
        self.queue += [Entry((request_id, i), p, now, deadline, stream, client, lane) for i, p in enumerate(prepared)]
        self.queued_rows[lane] += sum(p.rows for p in prepared)

    def refuse_if_full(self, least: int) -> None:
        """RESOURCE_EXHAUSTED before a request is tokenized when even its least work (each of its
        rows one step) would pass the limit: under a flood a refusal costs a comparison, not a
        tokenization. A request above the limit alone is left to ``submit``, which says so."""
        limit = self.config.max_queued_work
        if least <= limit < self.work + least:
            raise overloaded(total=self.work + least, work=least, limit=limit, bound="at least ")

    def cancel(self, request_id: int) -> None:
        """Drop the request's queued texts; its decoding rows leave at the next cycle."""
        for e in [e for e in self.queue if e.key[0] == request_id]:
            self.queue.remove(e)
            self.work -= e.prepared.work
            self._unqueue(e)
        for key in [k for k in self.running if k[0] == request_id]:
            self._leave(key)
            self.pending_removal.append(key)

    def finish(self, key: Key) -> None:
        """A text finished decoding (its rows already left the batch)."""
        if key in self.running:
            self._leave(key)
        elif key in self.pending_removal:  # cancelled during the step that finished it
            self.pending_removal.remove(key)

    def _leave(self, key: Key) -> None:
        entry = self.running.pop(key)
        self.work -= entry.prepared.work
        self.client_rows[entry.client] -= entry.prepared.rows
        if self.client_rows[entry.client] <= 0:
            del self.client_rows[entry.client]
            self._gone(entry.client)

    def _unqueue(self, entry: Entry) -> None:
        self.queued_rows[entry.lane] -= entry.prepared.rows
        self.client_work[entry.client] -= entry.prepared.work
        if self.client_work[entry.client] <= 0:
            del self.client_work[entry.client]
            self._gone(entry.client)

    def _gone(self, client: str) -> None:
        """Forget when a client was served once it has nothing queued or decoding."""
        if client not in self.client_rows and client not in self.client_work:
            self.served_at.pop(client, None)

    def expired(self, now: float) -> list[int]:
        """Requests whose deadline passed; the caller fails them and calls cancel()."""
        entries = itertools.chain(self.queue, self.running.values())
        return sorted({e.key[0] for e in entries if e.deadline is not None and now >= e.deadline})

    def reset(self) -> list[int]:
        """Forget the running batch (the engine failed); the requests it held."""
        lost = sorted({k[0] for k in self.running})
        for request_id in lost:
            self.cancel(request_id)
        self.pending_removal.clear()
        return lost

    def next_wake(self, now: float) -> float | None:
        """When the background task must look again if nothing new arrives (None: idle)."""
        if self.running or self.pending_removal:
            return now
        if not self.queue:
            return None
        if self.config.step_level or sum(e.prepared.rows for e in self.queue) >= self.config.max_rows:
            return now
        times = [self.queue[0].arrived + self.config.max_wait]
        times += [e.deadline for e in self.queue if e.deadline is not None]
        return min(times)

    def take(self, now: float) -> Cycle:
        """The next cycle: pending removals, and the queued texts that join now."""
        remove, self.pending_removal = tuple(self.pending_removal), []
        chosen = self._choose(now)
        taken = {id(e) for e in chosen}
        self.queue = [e for e in self.queue if id(e) not in taken]
        for e in chosen:
            self.running[e.key] = e
            self.client_rows[e.client] += e.prepared.rows
            self._unqueue(e)
        chosen.sort(key=lambda e: -len(e.prepared.source_ids))
        return Cycle(remove=remove, add=tuple((e.key, e.prepared) for e in chosen),
                     waited=tuple(now - e.arrived for e in chosen), lanes=tuple(e.lane for e in chosen))

    def lane_weights(self) -> dict[str, int]:
        """Clients decoding in each lane: its share of the engine (``service.scheduling.lanes``)."""
        clients: dict[str, set[str]] = {}
        for e in self.running.values():
            clients.setdefault(e.lane, set()).add(e.client)
        return {lane: len(c) for lane, c in clients.items()}

    def _choose(self, now: float) -> list[Entry]:
        """The queued texts that join now: by client (fewest rows first), within each lane's row
        and token budgets (each lane has its own: a small request never waits for a heavy text
        to free rows). A client's oldest text that does not fit closes its lane for this cycle:
        nobody overtakes it there."""
        if not self.queue or (self.running and not self.config.step_level):
            return []
        idle = not self.running
        rows: Counter[str] = Counter()
        longest: Counter[str] = Counter()
        for e in self.running.values():
            rows[e.lane] += e.prepared.rows
            longest[e.lane] = max(longest[e.lane], len(e.prepared.source_ids))
        lanes = {lane for lane, n in self.queued_rows.items() if n > 0}
        free = max(self.budgets[lane][0] - rows.get(lane, 0) for lane in lanes)
        if free <= 0 or self._should_wait(now, idle=idle, free_rows=free):
            return []
        by_client, heads = self._by_client()
        orders: dict[str, list[Entry]] = {}  # client_order, made when a cycle first visits the client
        load = Counter({c: self.client_rows.get(c, 0) for c in heads})
        chosen, bulk_added = [], 0
        closed = {lane for lane in lanes if self._full(lane, rows[lane], longest[lane])}  # nothing more joins there
        shared = rows["small"] > 0 or "small" in lanes
        share = self.config.max_rows / max(1, len(set(heads) | set(self.client_rows)))

        def turn(c: str) -> tuple:
            """Below its share of rows: fewest rows first (the least recently served among equals);
            at or above it: the oldest text first, so that heavy requests finish one after another
            rather than all late together."""
            if load[c] < share:
                return (0, load[c], self.served_at.get(c, -1), heads[c].arrived)
            return (1, heads[c].arrived, 0, 0.0)
        # whose turn: a heap (a turn changes only when its client is served; ties: the first queued)
        turns = [(turn(c), i, c) for i, c in enumerate(heads)]
        heapq.heapify(turns)
        while turns and not closed >= lanes:
            _, i, client = heapq.heappop(turns)
            if client not in orders:
                orders[client] = client_order(by_client[client])
            e = orders[client].pop()
            if e.lane == "bulk" and shared and bulk_added >= BULK_TEXTS_WHILE_SHARED:
                closed.add(e.lane)  # one short encoder run at a time while small requests wait for steps
            if e.lane not in closed:
                new_rows, new_longest = rows[e.lane] + e.prepared.rows, max(longest[e.lane], len(e.prepared.source_ids))
                fits = new_rows <= self.budgets[e.lane][0] and new_rows * new_longest <= self.budgets[e.lane][1]
                if fits or (idle and not chosen):  # the first text of a batch always fits
                    chosen.append(e)
                    bulk_added += e.lane == "bulk"
                    load[client] += e.prepared.rows
                    self._admissions += 1
                    self.served_at[client] = self._admissions
                    rows[e.lane], longest[e.lane] = new_rows, new_longest
                    if self._full(e.lane, new_rows, new_longest):
                        closed.add(e.lane)
                elif e is heads[client]:
                    closed.add(e.lane)  # keep the rows for this client's oldest text rather than starve it
            if orders[client]:
                heapq.heappush(turns, (turn(client), i, client))
        return chosen

    def _full(self, lane: str, rows: int, longest: int) -> bool:
        """Whether no text fits ``lane`` at ``rows`` rows padded to ``longest`` (each adds a row)."""
        max_rows, max_tokens = self.budgets[lane]
        return rows >= max_rows or (rows + 1) * longest > max_tokens

    def _by_client(self) -> tuple[dict[str, list[Entry]], dict[str, Entry]]:
        """Each client's queued texts, oldest first; and its oldest."""
        by_client: dict[str, list[Entry]] = {}
        for e in self.queue:
            by_client.setdefault(e.client, []).append(e)
        return by_client, {c: entries[0] for c, entries in by_client.items()}

    def _should_wait(self, now: float, *, idle: bool, free_rows: int) -> bool:
        """Wait up to max_wait for more texts, unless the queued ones fill the free rows.

        Request-level: fills a new batch. Step-level: texts that arrive while the
        batch runs share one encoder run; an idle batch starts at once, since
        what arrives next joins it at the next step anyway.
        """
        if idle and self.config.step_level:
            return False
        return sum(self.queued_rows.values()) < free_rows and now < self.queue[0].arrived + self.config.max_wait

