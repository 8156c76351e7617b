"""Scheduler: one queue for all clients, step-level (continuous) batching.

Shaped as handle + pure state + one background task (STYLE.md item 6):

- ``SchedulerState`` (``service.admission``) decides, as plain synchronous
  code with an injected clock, which queued texts join the running batch and
  which rows leave it. Tested without a model (``tests/test_scheduler.py``).
- ``Scheduler`` is the handle requests await. Its one background task runs
  cycles (remove, add, decoder steps) in ONE executor thread, so ONNX Runtime
  work never blocks the event loop, and fans results and errors out to each
  request. A cycle keeps stepping in the executor until something happens
  (a text finishes, a request arrives or is cancelled, a deadline or the batch
  window passes): one event-loop round trip per event, not per step.

The unit of a decoder step is a row; a text owns ``beam_size`` rows. Between
two steps, queued texts join (``DecodeBatch.add``) and finished texts are
answered at once. Texts queue for at most ``max_wait`` (unless they fill the
free rows) so that arrivals share one encoder run. With ``step_level=False``
(request-level batching, the benchmark baseline) a new batch only starts once
the running one is empty.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Hashable, Sequence

from service.admission import Cycle, Key, SchedulerConfig, SchedulerState
from service.errors import ErrorKind, NmtError
from service.interface import DecodeBatch, Engine, Prepared, Translation
from service.metrics import Metrics

STEPS_PER_CYCLE = 32
"""Most decoder steps one executor call runs while nothing happens (no arrival,
cancel, finished text or deadline): saves an event-loop round trip per step."""


@dataclass(frozen=True)
class Partial:
    """A streaming update: per text, the text all its live beams agree on."""

    texts: tuple[str, ...]


@dataclass
class _Request:
    count: int
    events: asyncio.Queue  # Partial..., then list[Translation] or an NmtError
    stream: bool
    results: dict[int, Translation] = field(default_factory=dict)
    prefixes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Step:
    rows: int  # rows the decoder step ran on
    padding: tuple[int, int]  # (real, padded) source tokens of those rows
    seconds: float


@dataclass(frozen=True)
class _Outcome:
    """What one engine cycle did (computed in the executor thread)."""

    finished: list[tuple[Hashable, Translation]]
    prefixes: dict[Key, str]  # streaming texts still decoding -> their agreed prefix
    encode_seconds: float | None
    steps: list[_Step]


class Scheduler:
    """The handle: ``translate``/``stream`` for requests, one background task for the engine."""

    def __init__(self, engine: Engine, config: SchedulerConfig, *, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine, self._metrics, self._clock = engine, metrics, clock
        self.state = SchedulerState(config)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-engine")
        self._batch: DecodeBatch | None = None  # touched only in the executor thread
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._interrupt = threading.Event()  # tells the executor to return after this step
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="nmt-scheduler")

    async def close(self) -> None:
        """Stop the background task; requests still waiting get UNAVAILABLE."""
        self._interrupt.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for request_id in list(self._requests):
            self._fail(request_id, NmtError(ErrorKind.UNAVAILABLE, "server shutting down"))
        self._executor.shutdown(wait=True)

    async def translate(self, prepared: Sequence[Prepared], *, timeout: float | None = None
                        ) -> list[Translation]:
        """Translations of ``prepared``, in order; raises NmtError."""
        async with aclosing(self.stream(prepared, timeout=timeout, partials=False)) as events:
            async for event in events:
                if isinstance(event, list):
                    return event
        raise AssertionError("unreachable: the stream ends with the translations")

    async def stream(self, prepared: Sequence[Prepared], *, timeout: float | None = None,
                     partials: bool = True) -> AsyncIterator[Partial | list[Translation]]:
        """``Partial`` updates as decoding goes (if ``partials``), then the translations."""
        now = self._clock()
        request_id = next(self._ids)
        self.state.submit(request_id, prepared, now=now,
                          deadline=None if timeout is None else now + timeout)
        request = _Request(count=len(prepared), events=asyncio.Queue(), stream=partials,
                           prefixes=[""] * len(prepared))
        self._requests[request_id] = request
        for p in prepared:
            self._metrics.source_tokens.observe(len(p.source_ids))
        self._observe_queue()
        self._wake.set()
        self._interrupt.set()
        try:
            while True:
                event = await request.events.get()
                if isinstance(event, NmtError):
                    raise event
                yield event
                if isinstance(event, list):
                    return
        finally:
            if self._requests.pop(request_id, None) is not None:  # cancelled or abandoned
                self.state.cancel(request_id)
                self._observe_queue()
                self._wake.set()
                self._interrupt.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            self._interrupt.clear()
            now = self._clock()
            for request_id in self.state.expired(now):
                self._fail(request_id, NmtError(ErrorKind.DEADLINE_EXCEEDED,
                                                "deadline exceeded while queued or decoding"))
            cycle = self.state.take(now)
            self._observe_queue()
            if not (cycle.add or cycle.remove or self.state.running):
                await self._sleep(self.state.next_wake(now), now)
                continue
            streaming = [k for k in self.state.running if self._streams(k[0])]
            try:
                outcome = await loop.run_in_executor(self._executor, self._engine_cycle, cycle,
                                                     streaming, self.state.next_decision())
            except Exception as e:  # a runtime failure: fail what was decoding, start afresh
                self._batch = None
                error = e if isinstance(e, NmtError) else NmtError(
                    ErrorKind.INTERNAL, f"decoding failed: {type(e).__name__}: {e}")
                for request_id in self.state.reset():
                    self._fail(request_id, error)
                continue
            self._deliver(outcome, cycle)

    async def _sleep(self, wake_at: float | None, now: float) -> None:
        timeout = None if wake_at is None else max(0.0, wake_at - now)
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass

    def _engine_cycle(self, cycle: Cycle, streaming: list[Key], decide_at: float | None) -> _Outcome:
        """Runs in the executor thread: remove, add (one encoder run), then decoder steps
        until a text finishes, something happens on the loop, or ``decide_at`` passes."""
        if self._batch is None:
            self._batch = self._engine.new_batch()
        batch = self._batch
        if cycle.remove:
            batch.remove(list(cycle.remove))
        encode = None
        if cycle.add:
            start = time.perf_counter()
            batch.add(list(cycle.add))
            encode = time.perf_counter() - start
        steps: list[_Step] = []
        finished: list[tuple[Hashable, Translation]] = []
        while batch.live_rows and not finished and len(steps) < STEPS_PER_CYCLE:
            rows, padding, start = batch.live_rows, batch.padded_tokens, time.perf_counter()
            finished = batch.step()
            steps.append(_Step(rows, padding, time.perf_counter() - start))
            if streaming or self._interrupt.is_set() or (decide_at is not None and self._clock() >= decide_at):
                break
        done = {key for key, _ in finished}
        prefixes = {k: batch.prefix(k) for k in streaming if k not in done}
        return _Outcome(finished, prefixes, encode, steps)

    def _deliver(self, outcome: _Outcome, cycle: Cycle) -> None:
        m = self._metrics
        for waited in cycle.waited:
            m.queue_wait.observe(waited)
        if outcome.encode_seconds is not None:
            m.encode_duration.observe(outcome.encode_seconds)
        for step in outcome.steps:
            m.decode_duration.observe(step.seconds)
            m.batch_rows.observe(step.rows)
            real, padded = step.padding
            m.padding_ratio.observe((padded - real) / padded if padded else 0.0)
        touched = set()
        for key, translation in outcome.finished:
            self.state.finish(key)
            request = self._requests.get(key[0])
            if request is not None:
                touched.add(key[0])
                request.results[key[1]] = translation
                if request.stream and translation.hypotheses:
                    request.prefixes[key[1]] = translation.hypotheses[0].text
        self._send_partials(outcome.prefixes)
        for request_id in touched:
            request = self._requests[request_id]
            if len(request.results) == request.count:
                self._complete(request_id, request)
        self._observe_queue()

    def _send_partials(self, prefixes: dict[Key, str]) -> None:
        changed: set[int] = set()
        for (request_id, index), text in prefixes.items():
            request = self._requests.get(request_id)
            if request is not None and request.prefixes[index] != text:
                request.prefixes[index] = text
                changed.add(request_id)
        for request_id in changed:
            request = self._requests[request_id]
            if len(request.results) < request.count:
                request.events.put_nowait(Partial(tuple(request.prefixes)))

    def _complete(self, request_id: int, request: _Request) -> None:
        translations = [request.results[i] for i in range(request.count)]
        self._metrics.decoder_steps.observe(max(t.steps for t in translations))
        for t in translations:
            if t.hypotheses:
                self._metrics.target_tokens.observe(len(t.hypotheses[0].tokens))
                self._metrics.generated_tokens.inc(len(t.hypotheses[0].tokens))
        del self._requests[request_id]
        request.events.put_nowait(translations)

    def _fail(self, request_id: int, error: NmtError) -> None:
        self.state.cancel(request_id)
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.events.put_nowait(error)

    def _observe_queue(self) -> None:
        self._metrics.queue_depth.set(len(self.state.queue))
        self._metrics.inflight_rows.set(self.state.running_rows)

    def _streams(self, request_id: int) -> bool:
        request = self._requests.get(request_id)
        return request is not None and request.stream
