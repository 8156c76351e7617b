"""Batches that decode in a process of their own (``nmt serve --engine-process on``).

In one process, grpc.aio's event loop and the engine thread share one GIL and two cores' worth
of threads. Here each model's batches and decoder steps live in a child process
(``service.scheduling.child``, started with ``spawn``: no fork of a process that holds ONNX
Runtime's threads), and the server process keeps everything else: the requests,
``SchedulerState``'s admission and fairness, deadlines, the encoder runs, rendering, metrics.
Measured on 2 cores (``docs/serving.md``): one intra-op thread for the child, the other core
for the server process; 1.25x texts/s at one text per call and 1.31x at eight against in
process, on 1.68 and 1.74 cores against 1.85 and 1.93 (before the fused encoder); idle latency
that of in process since the server process decodes idle requests itself (below), its steps on
every core (``service.process.step_threads``). ``--engine-process auto``, the default, turns it on
for one model (``service.process.engine_process``).

``ProcessScheduler`` is ``Scheduler`` with its engine thread replaced by a *driver* thread that
speaks to the child through one pipe. The child never waits for the server while it has rows:
after every step it sends a ``Tick`` (cycles applied so far, live rows, finished texts, streaming
prefixes, the metrics it observed) and steps on; the driver reads every tick there is and
answers with the next cycle (``Change``: removals, texts joining, lane weights), which the child
applies before a later step. So texts join a step later than in process. While the child decodes
``ENCODE_HERE_ROWS`` rows or more, the driver encodes the texts joining (its own encoder session,
in the child's int8 form: the same bits) while the child runs that step, and the child only
appends their rows; below, the child encodes them. Idle, the child waits for the pipe and
the driver for the scheduler's wake event, as the engine thread does; and a cycle of at most
``LOCAL_ROWS`` rows that finds both processes idle (the child for ``LOCAL_QUIET`` seconds) decodes in
the server process (``_here``, on the driver thread, as in process): one text at a time pays no hops
to the child and back.

A failed cycle or step fails what the child was decoding (as in process); a child that dies
(killed, out of memory) fails what it held, with UNAVAILABLE, and is started again.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from service.config import SchedulerConfig, ServeConfig
from service.errors import ErrorKind, NmtError
from service.interface import Engine, Key
from service.metrics import Metrics
from service.process import engine_process, name_os_thread
from service.scheduling.admission import Cycle
from service.scheduling.child import Change, Tick, serve_engine
from service.scheduling.lanes import Lanes, by_lane
from service.scheduling.scheduler import ENGINE_THREAD, Scheduler, _Outcome

log = logging.getLogger("nmt.engine_process")
DRIVER_THREAD = "nmt-driver"  # the server process's thread that speaks to the child
RESTART_PAUSE = 1.0  # seconds between a child's death and its successor's start
STOP_SECONDS = 5.0  # a child told to stop that is still there after this is killed
LOCAL_ROWS = 8  # a cycle of at most this many rows, finding everything idle, decodes in the server process
LOCAL_QUIET = 0.05
"""...and only once the child has had no rows for this many seconds: at saturation the child empties
for a moment now and then (about once a second at one text per call on the Zen 4), and a text decoded
here then took this process's GIL from the event loop for its ~20 steps, and left the 2-thread step
pool's worker spinning (0.04-0.08 of a core, ``docs/speed-round2.md``)."""
ENCODE_HERE_ROWS = 64
"""The server process encodes a cycle's texts only while the child decodes at least this many rows (its
last tick's): below, the child has time to spare, and its encoding them saves this process, the bound
at one text per call (its Python is most of a core there), the encoder run and the pipe's copy of
about 50 KB a text (Zen 4 [avx2 avx512_vnni], 5 rounds against encoding here always: 1.05x / 1.02x
texts/s at one / eight texts per call; the child encoding always: 1.03x / 0.90x, 3 rounds; 128 against 64:
1.01x / 1.00x, 5 rounds)."""


def scheduler_for(engine: Engine, config: ServeConfig, metrics: Metrics, models: int = 1) -> Scheduler:
    """``nmt serve``'s scheduler for ``engine`` (one of ``models``): a ``ProcessScheduler`` with
    ``--engine-process on`` (or ``auto``: ``service.process.engine_process``) where another process
    can build the same engine (an ONNX engine as loaded, with its ``construction``; not a caller's
    wrapper around one), else ``Scheduler``."""
    if engine_process(config, models) and "construction" in vars(engine):
        return ProcessScheduler(engine, config.scheduler, metrics=metrics)
    return Scheduler(engine, config.scheduler, metrics=metrics)


class ProcessScheduler(Scheduler):
    """``Scheduler`` whose batches decode in a child process (module docstring)."""

    def __init__(self, engine: Any, config: SchedulerConfig, *, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(engine, config, metrics=metrics, clock=clock)
        self.process: multiprocessing.process.BaseProcess | None = None  # the child now
        self._conn: Connection | None = None
        self._encodes = False  # the server process encodes what joins (the child's graphs are its own)

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
        # the child's steps on the engine's threads: the server process's take every core only while idle
        self.process = context.Process(target=serve_engine, name=ENGINE_THREAD, daemon=True,
                                       args=(child, type(self._engine), str(self._engine.manifest.root),
                                             {**self._engine.construction, "step_threads": None}))
        self.process.start()
        child.close()
        log.info("%s: batches decode in process %s (the engine process: --engine-process on, or auto for one model)",
                 self._model_label, self.process.pid)

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
        kind, said = self._conn.recv()
        if kind != "ready":
            log.error("%s: the engine process could not load the model: %s", self._model_label, said)
            return False
        # the child's sessions took the same int8 form as this process's (same CPU, same check):
        # then this process's encoder gives the child's bits, and encodes while the child steps
        self._encodes = said == self._engine.int8_form
        if not self._encodes:
            log.warning("%s: the engine process runs int8 form %r, this process %r: the child encodes",
                        self._model_label, said, self._engine.int8_form)
        return True

    def _drive(self) -> None:
        """Answer ticks with cycles while the child has rows or cycles to apply; else wait for arrivals.
        A cycle of at most ``LOCAL_ROWS`` rows that finds the child and this process idle, the child for
        ``LOCAL_QUIET`` seconds, decodes here (``_here``): an idle server answers one text without the
        hops to the child and back."""
        assert self._conn is not None and self.process is not None
        conn, sent, applied, rows, weights, busy_at = self._conn, 0, 0, 0, None, -math.inf
        here = Lanes(self._engine.new_batch)  # the texts decoding in this process
        while not self._closing:
            ticks: list[Tick] = []
            if rows or sent > applied:
                ticks = self._ticks(here, wait=not here.live_rows)  # steps to take here: no waiting
                if not ticks and not here.live_rows:
                    continue
                applied, rows = (ticks[-1].applied, ticks[-1].rows) if ticks else (applied, rows)
            elif not self.process.is_alive():  # died idle: what is queued waits for the next child
                raise EOFError("exited while idle")
            with self._lock:
                for key, _ in (f for tick in ticks for f in tick.finished):  # first: their rows are free
                    self.state.finish(key)
                now, cycle = self._next_cycle()
                busy_at = now if rows or sent > applied or ticks else busy_at  # a tick: it had rows till now
                quiet = not rows and sent == applied and not here.live_rows and now - busy_at >= LOCAL_QUIET
                cycle, local = _split(cycle, here, idle=quiet)
                stream = tuple(self.state.running[key].stream for key, _ in cycle.add)
                streaming = [k for k in here.lane_of if k in self.state.running and self.state.running[k].stream]
                new_weights = self.state.lane_weights()
                wake_at = None if rows or cycle.add else self.state.next_wake(now)
                self._observe_queue()
            for tick in ticks:  # first: the finished texts' answers need not wait for an encoder run
                self._report(tick)
            if cycle.add or cycle.remove or (rows and new_weights != weights):  # an idle child hears of
                weights = new_weights  # new weights with its next texts (texts decoding here change them)
                encoded = self._encode(cycle) if cycle.add and self._encodes and rows >= ENCODE_HERE_ROWS else None
                conn.send(Change(cycle.remove, cycle.add, cycle.lanes, stream, weights, encoded))
                sent += 1
                for waited in cycle.waited:
                    self._metrics.queue_wait.observe(waited)
            if local.add or local.remove or here.live_rows:  # then no waiting: the next cycle may have texts
                here = self._here(here, local, new_weights, streaming)
            elif not rows and sent == applied:
                self._wake.wait(None if wake_at is None else max(0.0, wake_at - now))

    def _ticks(self, here: Lanes, *, wait: bool) -> list[Tick]:
        """Every tick the child has sent, the first waited for up to 0.1 s if ``wait``. A tick with an
        error (the child dropped its batches, and sent nothing finished) fails the child's texts."""
        assert self._conn is not None
        ticks: list[Tick] = []
        while self._conn.poll(0.1 if wait and not ticks else 0):
            ticks.append(self._conn.recv())
            if ticks[-1].error:
                with self._lock:
                    lost = [key for key in self.state.running if key not in here.lane_of]
                self._fail_texts(lost, NmtError(ErrorKind.INTERNAL, ticks[-1].error))
        return ticks

    def _here(self, here: Lanes, local: Cycle, weights: dict[str, int], streaming: list[Key]) -> Lanes:
        """One cycle and step of the texts decoding in this process, as the engine thread runs them in
        process; on a failure they (and the cycle's, joined or not) fail, the child's go on, and a fresh
        ``Lanes`` is returned."""
        if (error := self._cycle(here, local, weights, streaming)) is None:
            return here
        self._fail_texts(list({*here.lane_of, *(key for key, _ in local.add)}), error)
        return Lanes(self._engine.new_batch)

    def _fail_texts(self, keys: list[Key], error: NmtError) -> None:
        """Texts lost on one side (this process's, or the child's): out of the state, their requests failed."""
        with self._lock:
            for key in keys:
                self.state.finish(key)
            self._observe_queue()
        self._post(self._fail_all, sorted({key[0] for key in keys}), error)

    def _encode(self, cycle: Cycle) -> dict[str, Any] | None:
        """The cycle's texts encoded here, by lane, while the child runs its next step; None (the
        child encodes them, and reports a failure as in process) if encoding fails here."""
        encoded = {}
        try:
            for lane, items in by_lane(cycle).items():
                with self._metrics.encode_duration.time():
                    encoded[lane] = self._engine.encode(items)
        except Exception:
            log.exception("%s: encoding in the server process failed; the engine process encodes",
                          self._model_label)
            return None
        return encoded

    def _report(self, tick: Tick) -> None:
        for name, value in tick.observed:
            getattr(self._metrics, name).observe(value)
        if tick.finished or tick.prefixes:
            self._post(self._deliver, _Outcome(tick.finished, tick.prefixes))


def _split(cycle: Cycle, here: Lanes, *, idle: bool) -> tuple[Cycle, Cycle]:
    """(the child's part of ``cycle``, this process's): removals go where their texts decode; the
    texts joining decode here only when everything is ``idle`` and they are at most ``LOCAL_ROWS`` rows."""
    mine = tuple(key for key in cycle.remove if key in here.lane_of)
    theirs = tuple(key for key in cycle.remove if key not in here.lane_of)
    if idle and cycle.add and sum(prepared.rows for _, prepared in cycle.add) <= LOCAL_ROWS:
        return Cycle(remove=theirs), Cycle(remove=mine, add=cycle.add, waited=cycle.waited, lanes=cycle.lanes)
    return Cycle(remove=theirs, add=cycle.add, waited=cycle.waited, lanes=cycle.lanes), Cycle(remove=mine)
