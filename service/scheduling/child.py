"""The engine process's side of ``nmt serve --engine-process on`` (``service.scheduling.remote``):
what the server and the child say to each other (``Change``, ``Tick``), and the child's life
(``serve_engine``): build the engine, then apply cycles and step, a tick after every step.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterator

from service.interface import Decoded, Key, Prepared
from service.process import freeze_heap, name_os_thread
from service.scheduling.admission import Cycle
from service.scheduling.lanes import Lanes, change, step
from service.scheduling.scheduler import ENGINE_THREAD


@dataclass(frozen=True)
class Change:
    """One cycle for the child: removals, then texts joining (with their lane and streaming flag)."""

    remove: tuple[Key, ...]
    add: tuple[tuple[Key, Prepared], ...]
    lanes: tuple[str, ...]
    stream: tuple[bool, ...]
    weights: dict[str, int]  # clients decoding in each lane (``SchedulerState.lane_weights``)
    encoded: dict[str, Any] | None = None  # lane -> its texts encoded by the server (None: the child encodes)


@dataclass(frozen=True)
class Tick:
    """The child's report after a step (or after cycles that left it without rows)."""

    applied: int  # cycles applied so far
    rows: int  # live rows after the step
    finished: list[tuple[Key, Decoded]]
    prefixes: dict[Key, list[int]]  # streaming texts still decoding -> their agreed target ids
    observed: list[tuple[str, float]]  # (Metrics histogram attribute, value), for the server to observe
    error: str = ""  # the cycle or step failed: the child dropped its batches


class _Recorder:
    """Stands in for ``Metrics`` in the child: what ``change`` and ``step`` observe, kept for a tick."""

    def __init__(self) -> None:
        self.observed: list[tuple[str, float]] = []

    def __getattr__(self, name: str) -> _Histogram:
        return _Histogram(self.observed, name)

    def take(self) -> list[tuple[str, float]]:
        observed, self.observed = self.observed, []
        return observed


class _Histogram:
    def __init__(self, observed: list[tuple[str, float]], name: str) -> None:
        self._observed, self._name = observed, name

    def observe(self, value: float) -> None:
        self._observed.append((self._name, value))

    @contextmanager
    def time(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - started)


def serve_engine(conn: Connection, kind: type, root: str, construction: dict[str, Any]) -> None:
    """The child's life: build the engine (``kind``, the server's engine class, as the server
    built it), say ready, then decode until told to stop."""
    name_os_thread(ENGINE_THREAD)
    try:
        engine = kind(Path(root), **construction)
    except Exception as e:  # the server process loaded the same model: only a fault gets here
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    freeze_heap()
    conn.send(("ready", engine.int8_form))
    try:
        _decode(conn, engine)
    except (EOFError, OSError):  # the server process is gone
        pass


def _decode(conn: Connection, engine: Any) -> None:
    """Apply cycles and step until told to stop (``None``), a tick after every step."""
    lanes, recorder, streaming, weights, applied = Lanes(engine.new_batch), _Recorder(), set(), {}, 0
    inbox = _inbox(conn)
    while True:
        changes = [] if lanes.live_rows else [inbox.get()]  # idle: wait for work
        while not inbox.empty():
            changes.append(inbox.get())
        if None in changes:  # stop
            return
        if EOFError in changes:
            raise EOFError("the server process is gone")
        error = ""
        try:
            for c in changes:
                applied, weights = applied + 1, c.weights
                change(lanes, Cycle(remove=c.remove, add=c.add, lanes=c.lanes), recorder, c.encoded)
                streaming.difference_update(c.remove)
                streaming.update(key for (key, _), s in zip(c.add, c.stream) if s)
            finished, prefixes = step(lanes, weights, sorted(streaming), recorder)
            streaming.difference_update(key for key, _ in finished)
        except Exception as e:  # as in process: what was decoding fails, the engine goes on afresh
            lanes, streaming, finished, prefixes = Lanes(engine.new_batch), set(), [], {}
            error = f"decoding failed: {type(e).__name__}: {e}"
        conn.send(Tick(applied, lanes.live_rows, finished, prefixes, recorder.take(), error))


def _inbox(conn: Connection) -> queue.SimpleQueue:
    """What the server sends, read as it comes by a thread of the child's: the child never leaves
    the pipe full, so the driver's send of a large change (encoded texts) and the child's send of
    a large tick cannot wait for each other. Ends with ``None`` (stop) or ``EOFError`` (gone)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            while (message := conn.recv()) is not None:
                inbox.put(message)
        except (EOFError, OSError):
            message = EOFError
        inbox.put(message)
    threading.Thread(target=read, name="nmt-inbox", daemon=True).start()
    return inbox
