"""Scheduler: one queue for all clients, step-level (continuous) batching.

Shaped as handle + pure state + one engine thread (the shape of text-generation-inference's
``router/src/queue.rs`` and Ray Serve's ``serve/batching.py``):

- ``SchedulerState`` (``service.scheduling.admission``) decides, as plain synchronous code with an injected
  clock, which queued texts join the running batch and which rows leave it (``tests/test_scheduler.py``).
- ``Scheduler`` is the handle requests await. ONE engine thread loops: under a lock it asks the state for the
  next cycle (removals, additions, expired deadlines), runs it and one decoder step, and posts finished texts
  (and streaming prefixes) to the event loop, which answers the requests. The engine never waits for the loop
  between steps, so a busy loop (a burst of requests to tokenize) does not stall decoding; the loop runs no model.

The unit of a decoder step is a row; a text owns ``beam_size`` rows. Between two steps, queued texts join
(``DecodeBatch.add``) and finished texts are answered at once. Texts queue for at most ``max_wait`` (unless they
fill the free rows) so that arrivals share one encoder run. With ``step_level=False`` (request-level batching,
the benchmark baseline) a new batch only starts once the running one is empty."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from service.config import SchedulerConfig
from service.errors import ErrorKind, NmtError
from service.interface import Decoded, Engine, Event, Final, Key, Partial, Prepared, Translation
from service.metrics import Metrics
from service.process import name_os_thread
from service.scheduling.admission import Cycle, SchedulerState
from service.scheduling.lanes import Lanes, change, step
from service.scheduling.client_metrics import ClientGauges

ENGINE_THREAD = "nmt-engine"  # its name in Python and, on Linux, in top -H and /proc


@dataclass
class _Request:
    prepared: Sequence[Prepared]
    events: asyncio.Queue  # Partial..., then Final or an NmtError
    results: dict[int, Translation] = field(default_factory=dict)
    prefixes: list[str] = field(default_factory=list)  # streaming: the last text sent per text


@dataclass(frozen=True)
class _Outcome:
    """What one engine cycle did that requests wait for (computed in the engine thread)."""

    finished: list[tuple[Key, Decoded]]
    prefixes: dict[Key, list[int]]  # streaming texts still decoding -> their agreed target ids


class Scheduler:
    """The handle: ``translate``/``stream`` for requests, one engine thread for the model."""

    def __init__(self, engine: Engine, config: SchedulerConfig, *, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine, self._metrics, self._clock = engine, metrics, clock
        self.state = SchedulerState(config)
        self._lock = threading.Lock()  # guards state: the loop submits and cancels, the engine thread takes
        self._wake, self._closing = threading.Event(), False  # something for an idle engine thread: arrival, cancel, close
        self._requests: dict[int, _Request] = {}  # event-loop thread only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()  # set while no request waits on this scheduler
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._client_gauges = ClientGauges.of(metrics)
        manifest = getattr(engine, "manifest", None)
        self._model_label = f"{manifest.name}/{manifest.version}" if manifest is not None else ""
        self._clients_shown: tuple[dict, dict] = ({}, {})
        self._posted: list[tuple[Callable[..., None], tuple]] = []  # for the event loop, in order
        self._posted_lock = threading.Lock()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_loop, name=ENGINE_THREAD, daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the engine thread (after its current step); requests still waiting get UNAVAILABLE."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.sleep(0)  # what the thread posted before it stopped
        for request_id in list(self._requests):
            self._fail(request_id, NmtError(ErrorKind.UNAVAILABLE, "server shutting down"))

    async def drained(self) -> None:
        """Return once no request waits on this scheduler (a retiring model version)."""
        while self._requests:
            self._idle.clear()
            await self._idle.wait()

    def _forget(self, request_id: int) -> _Request | None:
        """Take a request out of the event loop's table (answered, failed, cancelled)."""
        request = self._requests.pop(request_id, None)
        if not self._requests:
            self._idle.set()
        return request

    def refuse_if_full(self, least: int) -> None:
        """Admission before tokenizing: RESOURCE_EXHAUSTED at once when a request of at least ``least`` work
        (rows x steps) cannot fit now (``SchedulerState.refuse_if_full``); ``stream``'s submit decides exactly."""
        with self._lock:
            self.state.refuse_if_full(least)

    async def translate(self, prepared: Sequence[Prepared], *, timeout: float | None = None,
                        client: str = "") -> list[Translation]:
        """Translations of ``prepared``, in order; raises NmtError."""
        async with aclosing(self.stream(prepared, timeout=timeout, partials=False, client=client)) as events:
            async for event in events:
                if isinstance(event, Final):
                    return list(event.translations)
        raise AssertionError("unreachable: the stream ends with the translations")

    async def stream(self, prepared: Sequence[Prepared], *, timeout: float | None = None,
                     partials: bool = True, client: str = "") -> AsyncIterator[Event]:
        """``Partial`` updates as decoding goes (if ``partials``), then one ``Final``; ``client``
        (who sent it) decides its turn among the others' (``SchedulerState``)."""
        request_id = next(self._ids)
        with self._lock:
            now = self._clock()
            self.state.submit(request_id, prepared, now=now, deadline=None if timeout is None else now + timeout,
                              stream=partials, client=client)
            self._observe_queue()
        request = _Request(prepared=prepared, events=asyncio.Queue(), prefixes=[""] * len(prepared))
        self._requests[request_id] = request
        for p in prepared:
            self._metrics.source_tokens.observe(len(p.source_ids))
        self._wake.set()
        try:
            while True:
                event = await request.events.get()
                if isinstance(event, NmtError):
                    raise event
                yield event
                if isinstance(event, Final):
                    return
        finally:
            if self._forget(request_id) is not None:  # cancelled or abandoned
                self._cancel(request_id)

    # -- the engine thread --------------------------------------------------------------

    def _engine_loop(self) -> None:
        """Decide under the lock, remove, add, step, again: never waits for the event loop (it hears of results)."""
        lanes: Lanes | None = None
        name_os_thread(ENGINE_THREAD)
        while not self._closing:
            with self._lock:
                now, cycle = self._next_cycle()
                busy = bool(cycle.add or cycle.remove or self.state.running)
                streaming = [k for k, e in self.state.running.items() if e.stream]
                weights = self.state.lane_weights()
                wake_at = None if busy else self.state.next_wake(now)
                self._observe_queue()
            if not busy:
                self._wake.wait(None if wake_at is None else max(0.0, wake_at - now))
                continue
            lanes = lanes or Lanes(self._engine.new_batch)
            if (error := self._cycle(lanes, cycle, weights, streaming)) is not None:
                lanes = None  # fail what was decoding, start afresh
                self._fail_running(error)

    def _cycle(self, lanes: Lanes, cycle: Cycle, weights: dict[str, int], streaming: list[Key]) -> NmtError | None:
        """``cycle`` on ``lanes`` and a step, finished texts answered; the error if the engine failed (the caller fails what it held)."""
        try:
            change(lanes, cycle, self._metrics)
            outcome = _Outcome(*step(lanes, weights, streaming, self._metrics))
        except Exception as e:  # a runtime failure
            return e if isinstance(e, NmtError) else NmtError(ErrorKind.INTERNAL, f"decoding failed: {type(e).__name__}: {e}")
        if outcome.finished or outcome.prefixes:
            with self._lock:
                for key, _ in outcome.finished:
                    self.state.finish(key)
                self._observe_queue()
            self._post(self._deliver, outcome)
        return None

    def _next_cycle(self) -> tuple[float, Cycle]:  # holding the lock
        """Now, and the next cycle; requests whose deadline passed are cancelled and failed."""
        self._wake.clear()  # a submit or cancel after this sets it again
        if self._closing:  # a close before the clear (its set erased): the thread must not wait past it
            self._wake.set()
        now = self._clock()
        if expired := self.state.expired(now):
            for request_id in expired:
                self.state.cancel(request_id)
            self._post(self._fail_all, expired, NmtError(
                ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded while queued or decoding"))
        return now, self.state.take(now)

    def _fail_running(self, error: NmtError) -> None:  # the engine failed; the queue waits on
        with self._lock:
            lost = self.state.reset()
            self._observe_queue()
        self._post(self._fail_all, lost, error)

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        """Hand ``callback(*args)`` to the event loop, in order. One wake-up (a self-pipe write,
        and a GIL handoff) per batch of posts: while the loop has not yet run the last one, the
        next posts join it (at saturation most steps finish texts, and the loop runs behind)."""
        assert self._loop is not None
        with self._posted_lock:
            self._posted.append((callback, args))
            if len(self._posted) > 1:
                return  # a drain is scheduled and has not taken the list yet
        try:
            self._loop.call_soon_threadsafe(self._run_posted)
        except RuntimeError:  # the loop closed under a server that never called close()
            self._closing = True

    def _run_posted(self) -> None:
        with self._posted_lock:
            posted, self._posted = self._posted, []
        for callback, args in posted:
            try:
                callback(*args)
            except Exception as e:  # as the loop would for separate callbacks: log, go on
                asyncio.get_running_loop().call_exception_handler({"message": f"error in {callback!r}", "exception": e})

    # -- the event loop: text, results, failures, cancels ----------------------------------

    def _deliver(self, outcome: _Outcome) -> None:
        """Render finished texts and streaming prefixes (here, not in the engine thread), and
        answer the requests they complete."""
        touched = set()
        for (request_id, index), decoded in outcome.finished:
            request = self._requests.get(request_id)
            if request is None:
                continue
            try:
                translation = self._engine.translation(request.prepared[index], decoded)
            except Exception as e:  # a bug in detokenizing: this request fails, the server goes on
                self._fail(request_id, NmtError(ErrorKind.INTERNAL, f"rendering failed: {type(e).__name__}: {e}"))
                continue
            touched.add(request_id)
            request.results[index] = translation
            if translation.hypotheses:
                request.prefixes[index] = translation.hypotheses[0].text
        self._send_partials(outcome.prefixes)
        for request_id in touched:
            request = self._requests.get(request_id)
            if request is not None and len(request.results) == len(request.prepared):
                self._complete(request_id, request)

    def _send_partials(self, prefixes: dict[Key, list[int]]) -> None:
        changed: set[int] = set()
        for (request_id, index), ids in prefixes.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            text = self._engine.partial_text(request.prepared[index], ids)
            if request.prefixes[index] != text:
                request.prefixes[index] = text
                changed.add(request_id)
        for request_id in changed:
            request = self._requests[request_id]
            if len(request.results) < len(request.prepared):
                request.events.put_nowait(Partial(tuple(request.prefixes)))

    def _complete(self, request_id: int, request: _Request) -> None:
        translations = [request.results[i] for i in range(len(request.prepared))]
        self._metrics.decoder_steps.observe(max(t.steps for t in translations))
        for t in translations:
            if t.hypotheses:
                self._metrics.target_tokens.observe(len(t.hypotheses[0].tokens))
                self._metrics.generated_tokens.inc(len(t.hypotheses[0].tokens))
        self._forget(request_id)
        request.events.put_nowait(Final(tuple(translations)))

    def _fail_all(self, request_ids: list[int], error: NmtError) -> None:
        for request_id in request_ids:
            self._fail(request_id, error)

    def _fail(self, request_id: int, error: NmtError) -> None:
        request = self._forget(request_id)
        self._cancel(request_id)
        if request is not None:
            request.events.put_nowait(error)

    def _cancel(self, request_id: int) -> None:
        """Drop the request from the state: queued texts now, decoding rows at the next step."""
        with self._lock:
            self.state.cancel(request_id)
            self._observe_queue()
        self._wake.set()

    def _observe_queue(self) -> None:  # holding the lock
        self._metrics.queue_depth.set(len(self.state.queue))
        self._metrics.inflight_rows.set(self.state.running_rows)
        clients = (dict(self.state.client_rows), dict(self.state.client_work))
        if clients != self._clients_shown:  # the common cycle changes nothing here
            self._clients_shown = clients
            self._client_gauges.set(self._model_label, *clients)
