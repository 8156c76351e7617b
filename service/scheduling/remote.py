"""Batches that decode in a process of their own (``nmt serve --engine-process on``).

In one process, grpc.aio's event loop and the engine thread share one GIL and two cores' worth
of threads. Here each model's batches and decoder steps live in a child process (``serve_engine``,
started with ``spawn``: no fork of a process that holds ONNX Runtime's threads), and the server
process keeps everything else: the requests, ``SchedulerState``'s admission and fairness,
deadlines, rendering, metrics. Measured on 2 cores (``docs/serving.md``): with one intra-op
thread for the child and the other core left to the server process, 1.19x texts/s at one text
per call and 0.96x at eight, on 1.50 and 1.31 cores against 1.84 and 1.92.

``ProcessScheduler`` is ``Scheduler`` with its engine thread replaced by a *driver* thread that
speaks to the child through one pipe. The child never waits for the server while it has rows:
after every step it sends a ``Tick`` (cycles applied so far, live rows, finished texts, streaming
prefixes, the metrics it observed) and steps on; the driver answers a tick with the next cycle
(``Change``: removals, texts joining, lane weights), which the child applies before a later step.
So texts join a step later than in process. Idle, the child blocks on the pipe and the driver
on the scheduler's wake event, as the engine thread does.

A failed cycle or step fails what the child was decoding (as in process); a child that dies
(killed, out of memory) fails what it held, with UNAVAILABLE, and is started again.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterator

from service.config import SchedulerConfig, ServeConfig
from service.errors import ErrorKind, NmtError
from service.interface import Decoded, Engine, Key, Prepared
from service.metrics import Metrics
from service.process import name_os_thread
from service.scheduling.admission import Cycle
from service.scheduling.lanes import Lanes, change, step
from service.scheduling.scheduler import ENGINE_THREAD, Scheduler, _Outcome

log = logging.getLogger("nmt.engine_process")
DRIVER_THREAD = "nmt-driver"  # the server process's thread that speaks to the child
RESTART_PAUSE = 1.0  # seconds between a child's death and its successor's start
STOP_SECONDS = 5.0  # a child told to stop that is still there after this is killed


def scheduler_for(engine: Engine, config: ServeConfig, metrics: Metrics) -> Scheduler:
    """``nmt serve``'s scheduler for ``engine``: a ``ProcessScheduler`` with ``--engine-process on``
    where another process can build the same engine (an ONNX engine as loaded, with its
    ``construction``; not a caller's wrapper around one), else ``Scheduler``."""
    if config.engine_process and "construction" in vars(engine):
        return ProcessScheduler(engine, config.scheduler, metrics=metrics)
    return Scheduler(engine, config.scheduler, metrics=metrics)


@dataclass(frozen=True)
class Change:
    """One cycle for the child: removals, then texts joining (with their lane and streaming flag)."""

    remove: tuple[Key, ...]
    add: tuple[tuple[Key, Prepared], ...]
    lanes: tuple[str, ...]
    stream: tuple[bool, ...]
    weights: dict[str, int]  # clients decoding in each lane (``SchedulerState.lane_weights``)


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
    conn.send(("ready", ""))
    try:
        _decode(conn, engine)
    except (EOFError, OSError):  # the server process is gone
        pass


def _decode(conn: Connection, engine: Any) -> None:
    """Apply cycles and step until told to stop (``None``), a tick after every step."""
    lanes, recorder, streaming, weights, applied = Lanes(engine.new_batch), _Recorder(), set(), {}, 0
    while True:
        changes = [] if lanes.live_rows else [conn.recv()]  # idle: wait for work
        while conn.poll():
            changes.append(conn.recv())
        if None in changes:  # stop
            return
        error = ""
        try:
            for c in changes:
                applied, weights = applied + 1, c.weights
                change(lanes, Cycle(remove=c.remove, add=c.add, lanes=c.lanes), recorder)
                streaming.difference_update(c.remove)
                streaming.update(key for (key, _), s in zip(c.add, c.stream) if s)
            finished, prefixes = step(lanes, weights, sorted(streaming), recorder)
            streaming.difference_update(key for key, _ in finished)
        except Exception as e:  # as in process: what was decoding fails, the engine goes on afresh
            lanes, streaming, finished, prefixes = Lanes(engine.new_batch), set(), [], {}
            error = f"decoding failed: {type(e).__name__}: {e}"
        conn.send(Tick(applied, lanes.live_rows, finished, prefixes, recorder.take(), error))


class ProcessScheduler(Scheduler):
    """``Scheduler`` whose batches decode in a child process (module docstring)."""

    def __init__(self, engine: Any, config: SchedulerConfig, *, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(engine, config, metrics=metrics, clock=clock)
        self.process: multiprocessing.process.BaseProcess | None = None  # the child now
        self._conn: Connection | None = None

    def start(self) -> None:
        self._spawn()
        super().start()  # the driver thread, where the engine thread would be

    def _spawn(self) -> None:
        if self.process is not None and self._conn is not None:  # the one before, dead or dying
            self._conn.close()
            self.process.join(STOP_SECONDS)
            if self.process.is_alive():
                self.process.kill()
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=serve_engine, name=ENGINE_THREAD, daemon=True,
                                       args=(child, type(self._engine), str(self._engine.manifest.root),
                                             self._engine.construction))
        self.process.start()
        child.close()
        log.info("%s: batches decode in process %s (--engine-process on)", self._model_label, self.process.pid)

    async def close(self) -> None:
        """Stop the driver (as ``Scheduler.close``), then the child."""
        await super().close()
        if self._conn is not None and self.process is not None:
            try:
                self._conn.send(None)
            except OSError:  # already gone
                pass
            self.process.join(STOP_SECONDS)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self._conn.close()

    def _engine_loop(self) -> None:
        """The driver: wait for the child, drive it; if it dies, fail what it held and start another."""
        name_os_thread(DRIVER_THREAD)
        while not self._closing:
            try:
                if self._ready():
                    self._drive()
                    continue
                why = "could not start"
            except (EOFError, OSError) as e:
                why = f"stopped ({type(e).__name__}, exit code {self.process.exitcode if self.process else None})"
            if self._closing:
                return
            log.error("%s: the engine process %s; starting another", self._model_label, why)
            self._fail_running(NmtError(ErrorKind.UNAVAILABLE, f"the engine process {why}; retry"))
            time.sleep(RESTART_PAUSE)
            self._spawn()

    def _ready(self) -> bool:
        """Wait for the child's first word: True once it has loaded the model."""
        assert self._conn is not None
        while not self._conn.poll(0.1):
            if self._closing:
                return True  # _drive returns at once
        kind, why = self._conn.recv()
        if kind != "ready":
            log.error("%s: the engine process could not load the model: %s", self._model_label, why)
        return kind == "ready"

    def _drive(self) -> None:
        """Answer ticks with cycles while the child has rows or cycles to apply; else wait for arrivals."""
        assert self._conn is not None and self.process is not None
        conn, sent, applied, rows, weights = self._conn, 0, 0, 0, None
        while not self._closing:
            tick: Tick | None = None
            if rows or sent > applied:
                if not conn.poll(0.1):
                    continue
                tick = conn.recv()
                applied, rows = tick.applied, tick.rows
                if tick.error:  # the child dropped its batches (it sends nothing finished with an error)
                    self._fail_running(NmtError(ErrorKind.INTERNAL, tick.error))
            elif not self.process.is_alive():  # died idle: what is queued waits for the next child
                raise EOFError("exited while idle")
            with self._lock:
                for key, _ in tick.finished if tick else ():  # first: their rows are free for this cycle
                    self.state.finish(key)
                now, cycle = self._next_cycle()
                stream = tuple(self.state.running[key].stream for key, _ in cycle.add)
                new_weights = self.state.lane_weights()
                wake_at = None if rows or cycle.add else self.state.next_wake(now)
                self._observe_queue()
            if cycle.add or cycle.remove or new_weights != weights:
                weights = new_weights
                conn.send(Change(cycle.remove, cycle.add, cycle.lanes, stream, weights))
                sent += 1
            for waited in cycle.waited:
                self._metrics.queue_wait.observe(waited)
            if tick is not None:
                self._report(tick)
            if not rows and sent == applied:
                self._wake.wait(None if wake_at is None else max(0.0, wake_at - now))

    def _report(self, tick: Tick) -> None:
        for name, value in tick.observed:
            getattr(self._metrics, name).observe(value)
        if tick.finished or tick.prefixes:
            self._post(self._deliver, _Outcome(tick.finished, tick.prefixes))
