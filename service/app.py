"""The served models: find, load, verify, warm up, look up, swap versions, drain, close.

Protocol-free: the front door (``service.api.frontend``), which every transport calls, resolves
requests to a ``Model`` here. Here the decoding engine (``service.decoding``) is wired to the
scheduler (``service.scheduling``); the two meet only through ``service.interface``. Process-level
tuning (threads per engine from the container's CPU limit, giving an unloaded model's memory
back) is ``service.process``'s.

Model control (``--model-control poll``, or SIGHUP in either mode): ``rescan`` looks at the repository again.
A new ``<name>/<version>/`` is loaded (checksums checked), warmed up with a translation, and only then takes
the requests for ``<name>`` (``--model-versions latest``) or joins the loaded versions (``all``); requests
already decoding finish on the version that started them. A version replaced or whose directory is gone stops
taking requests and is closed once its requests have finished. A version that fails to load is refused with
one log line and ``nmt_model_load_failures_total``; what was serving goes on. The poller tries a version only
once its directory has settled (``repository.Settling``); SIGHUP at once; a failed rescan never stops it
(``repository.Watcher``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from service.config import ModelVersions, Precision, ServeConfig
from service.errors import ErrorKind, ModelRepositoryError, NmtError, ProviderUnavailableError, shown
from service.interface import Engine
from service.metrics import Metrics
from service.models.checks import check_graphs, check_vocabularies
from service.models.manifest import Manifest, load_manifest
from service.models.repository import Settling, VersionDir, Watcher, latest, scan, version_key
from service.options import DecodingOptions
from service.process import engine_threads, release_memory, shared_pool, step_threads
from service.scheduling.remote import Scheduler, scheduler_for

if TYPE_CHECKING:
    from service.decoding.engine import Engine as OnnxEngine
    from service.decoding.sessions import global_pools

WARMUP_TEXT = "Hello world"
WARMUP_SECONDS = 60.0
LOAD_ERRORS = (ModelRepositoryError, ProviderUnavailableError, NmtError, OSError, ValueError)
log = logging.getLogger("nmt.app")


@dataclass(frozen=True)
class Model:
    """One served model version: its engine and the scheduler feeding it."""

    manifest: Manifest
    engine: Engine
    scheduler: Scheduler

    @property
    def ref(self) -> str:
        return f"{self.manifest.name}/{self.manifest.version}"


def make_engine(config: ServeConfig, d: VersionDir, *, models: int = 1) -> Engine:
    """The engine of one model version directory (checksums verified; in ``<name>/<version>/`` the
    manifest must name them), one of ``models`` (with ``--engine-process on``, the server process's)."""
    from service.decoding.engine import Engine as OnnxEngine
    from service.decoding.sessions import global_pools

    manifest = load_manifest(d.path)
    if d.name and (manifest.name, manifest.version) != (d.name, d.version):
        raise ModelRepositoryError(f"{d.path}: the manifest says {manifest.name}/{manifest.version}, "
                                   f"the directory {d.ref}")
    precision, why = (manifest.default_precision() if config.precision is Precision.AUTO
                      else (config.precision.value, "asked"))
    threads, steps = engine_threads(config, models), step_threads(config, models)
    shared = shared_pool(config, threads)
    log.info("%s/%s: %s graphs (%s), intra-op threads: %s%s", manifest.name, manifest.version, precision, why,
             "ONNX Runtime's global pool (a thread per core) for the encoder and the step"
             if shared or global_pools() else threads or "ONNX Runtime's default (one per core)",
             f" ({steps} for this process's steps, which run while the engine process is idle)" if steps else "")
    engine = OnnxEngine(manifest, precision=precision, provider=config.provider.value, intra_op_threads=threads,
                        limits=config.limits, decoder_spinning=config.decoder_spinning, int8_form=config.int8_form,
                        shortlist=config.shortlist, shared_pool=shared,
                        fused_attention=config.fused_attention, fused_encoder=config.fused_encoder,
                        step_threads=steps)
    log.info("%s/%s: int8 form %s (%s); shortlist %s (%s); encoder %s; attention %s", manifest.name, manifest.version,
             engine.int8_form or "-", engine.runtime.int8_form_reason, "on" if engine.shortlist else "off",
             engine.shortlist_reason, engine.runtime.encoder_form, engine.runtime.attention_form)
    check_engine(engine, precision)
    return engine


def check_engine(engine: OnnxEngine, precision: str) -> None:
    """A loaded ONNX engine's graphs and tokenizers must agree with its manifest's model_config:
    checksums prove the files are the ones listed, not that they belong together."""
    check_graphs(engine.manifest, precision, engine.graph_shapes())
    check_vocabularies(engine.manifest, source=engine.tokenizer.source.get_piece_size(),
                       target=engine.tokenizer.target.get_piece_size())


def load_engines(config: ServeConfig) -> list[Engine]:
    """The engines to start with: every version, or the newest of each name (``latest``)."""
    dirs, problems = scan(config.model_repository)
    for line in problems:
        log.warning("%s", line)
    if not dirs:
        raise ModelRepositoryError(f"{config.model_repository}: no manifest.json there nor in "
                                   "<name>/<version>/ below it")
    if config.model_versions is ModelVersions.LATEST and dirs[0].name:
        dirs = latest(dirs)
    return [make_engine(config, d, models=len(dirs)) for d in dirs]


def failure(e: BaseException) -> str:
    """What went wrong, in one line: our errors by their message, anything else with its type."""
    known = isinstance(e, (*LOAD_ERRORS, asyncio.TimeoutError)) and str(e)
    return str(e)[:300] if known else f"{type(e).__name__}: {str(e)[:300]}"


class ServedModels:
    """The model versions of one server; each with its own scheduler."""

    def __init__(self, config: ServeConfig, engines: Sequence[Engine], metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        self._loaded: dict[str, Model] = {}  # ref -> a version taking requests
        self._attempts: dict[str, tuple] = {}  # ref -> signature of its directory when last tried
        self._reported: dict[str, str] = {}  # directory -> the problem last logged for it
        self._settling = Settling()  # which new version directories have stopped changing
        self.watcher = Watcher()  # --model-control poll; its error: why /readyz says 503
        self._draining: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()  # one rescan at a time
        for e in engines:
            m = Model(e.manifest, e, scheduler_for(e, config, metrics, models=len(engines)))
            self._loaded[m.ref] = m
        names = sorted({m.manifest.name for m in self._loaded.values()})
        if config.default_model and config.default_model not in names:
            raise ModelRepositoryError(f"--default-model {config.default_model!r} is not among the "
                                       f"loaded models {sorted(self._loaded)}")
        self.default_name = config.default_model or (names[0] if names else "")

    @property
    def all(self) -> list[Model]:
        """Versions taking requests: the default model first, then by name, newest first."""
        models = sorted(self._loaded.values(), key=lambda m: version_key(m.manifest.version), reverse=True)
        return sorted(models, key=lambda m: (m.manifest.name != self.default_name, m.manifest.name))

    def get(self, name: str) -> Model:
        """The model a request names (``name``, or ``name/version`` while it is loaded; empty:
        the default); its newest loaded version."""
        name = name or self.default_name
        matches = [m for m in self._loaded.values() if name in (m.manifest.name, m.ref)]
        if not matches:
            known = sorted({m.manifest.name for m in self._loaded.values()})
            raise NmtError(ErrorKind.NOT_FOUND, f"model must be one of {shown(known, 300)} "
                           f"(or name/version of a loaded version), got {shown(name)}")
        return max(matches, key=lambda m: version_key(m.manifest.version))

    def start(self) -> None:
        """Start every scheduler's engine thread (inside the serving event loop)."""
        for m in self._loaded.values():
            self._started(m)

    async def warm_up(self) -> float:
        """Translate one text with every model; the seconds it took."""
        started = time.perf_counter()
        for m in self._loaded.values():
            await self._warm(m)
        return time.perf_counter() - started

    async def close(self) -> None:
        for m in self._loaded.values():
            await m.scheduler.close()
        await asyncio.gather(*self._draining, return_exceptions=True)

    # -- model control -------------------------------------------------------------------

    async def poll(self, seconds: float) -> None:
        """Rescan every ``seconds`` until cancelled (``--model-control poll``), trying a new
        version only once its directory has settled (``Settling``); the watcher never stops:
        a failed rescan is logged, counted (``nmt_model_watcher_failures_total``) and retried
        after a backoff, and ``watcher.error`` names it until a rescan succeeds (``Watcher``)."""
        await self.watcher.run(lambda: self._rescan(settle=True), seconds, log=log, describe=failure,
                               failed=self.metrics.model_watcher_failures.inc)

    async def rescan(self) -> None:
        """Look now (SIGHUP): every new version that looks complete is tried at once (the operator
        says the copy is done); a failure of the rescan itself is one log line."""
        try:
            await self._rescan(settle=False)
        except Exception as e:
            self._once("rescan", f"rescan failed: {failure(e)}")

    async def _rescan(self, *, settle: bool) -> None:
        """Take new complete versions, retire the ones whose directory is gone."""
        async with self._lock:
            dirs, problems = scan(self.config.model_repository)
            if dirs and not dirs[0].name:
                log.warning("rescan: %s is one model version; model control needs <name>/<version>/ "
                            "directories", self.config.model_repository)
                return
            for line in problems:
                self._once(line.split(":")[0], line)
            present = {d.ref for d in dirs}
            for ref in [r for r in self._loaded if r not in present]:
                self._retire(self._loaded[ref], "its directory is gone")
            self._settling.keep(present - set(self._loaded))
            for d, signature in self._candidates(dirs, settle=settle):
                if await self._try(d, signature):
                    self._attempts.pop(d.ref, None)

    def _candidates(self, dirs: list[VersionDir], *, settle: bool) -> list[tuple[VersionDir, tuple]]:
        """New versions worth a try (changed since the last try; with ``settle``, settled), newest
        first, with their signatures; with ``latest`` only those newer than what serves their name."""
        fresh = []
        for d in (d for d in dirs if d.ref not in self._loaded):
            signature = d.signature()
            if self._attempts.get(d.ref) != signature and (not settle or self._settling.settled(d.ref, signature)):
                fresh.append((d, signature))
        if self.config.model_versions is ModelVersions.LATEST:
            serving = {m.manifest.name: int(m.manifest.version) for m in self.all}
            fresh = [(d, s) for d, s in fresh if int(d.version) > serving.get(d.name, -1)]
        return sorted(fresh, key=lambda c: (c[0].name, -int(c[0].version)))

    async def _try(self, d: VersionDir, signature: tuple) -> bool:
        """Load, warm up and add one version; False (one log line, a counted failure) if it fails."""
        if self.config.model_versions is ModelVersions.LATEST:
            current = [m for m in self._loaded.values() if m.manifest.name == d.name]
            if current and int(current[0].manifest.version) >= int(d.version):
                return False  # a newer version of the name came in first
        self._attempts[d.ref] = signature
        model = None
        try:
            # engines already serving keep their threads; the new one takes its share of the cores
            models = 1 + sum(1 for m in self._loaded.values()
                             if not (self.config.model_versions is ModelVersions.LATEST and m.manifest.name == d.name))
            engine = await asyncio.to_thread(make_engine, self.config, d, models=models)
            model = Model(engine.manifest, engine, scheduler_for(engine, self.config, self.metrics, models=models))
            model.scheduler.start()
            await asyncio.wait_for(self._warm(model), WARMUP_SECONDS)
            if not d.path.is_dir():
                raise ModelRepositoryError(f"{d.path}: removed while it was being loaded")
        except Exception as e:  # LOAD_ERRORS, a warm-up timeout, or anything a hostile version causes
            if model is not None:
                await model.scheduler.close()
            self._refuse(d, signature, e)
            return False
        self._add(model)
        return True

    def _refuse(self, d: VersionDir, signature: tuple, e: Exception) -> None:
        """One ``refused`` line and one count, unless the directory changed while it was loaded:
        then it is still being copied, and is tried again once it settles."""
        if d.signature() != signature:
            self._attempts.pop(d.ref, None)
            log.info("%s changed while it was being loaded: not refused, tried again once it settles", d.ref)
            return
        log.warning("refused %s: %s", d.ref, failure(e))
        self.metrics.model_load_failures.labels(d.name).inc()

    def _add(self, model: Model) -> None:
        replaced = [m for m in self._loaded.values() if m.manifest.name == model.manifest.name]
        self._loaded[model.ref] = model
        self._started(model, scheduler_running=True)
        log.info("serving %s (%s)", model.ref, model.engine.precision)
        if self.config.model_versions is ModelVersions.LATEST:
            for old in replaced:
                self._retire(old, f"replaced by {model.ref}")

    def _retire(self, model: Model, why: str) -> None:
        """Stop routing to ``model``; close it once its requests have finished."""
        del self._loaded[model.ref]
        self.metrics.forget_model(name=model.manifest.name, version=model.manifest.version)
        log.info("retiring %s (%s); it closes when its requests finish", model.ref, why)

        async def drain() -> None:
            await model.scheduler.drained()
            await model.scheduler.close()
            release_memory()
            log.info("unloaded %s", model.ref)
        task = asyncio.create_task(drain())
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    def _started(self, model: Model, *, scheduler_running: bool = False) -> None:
        if not scheduler_running:
            model.scheduler.start()
        self.metrics.set_model(name=model.manifest.name, version=model.manifest.version,
                               sha256=model.manifest.sha256, provider=self.config.provider.value,
                               precision=model.engine.precision, int8_form=getattr(model.engine, "int8_form", ""))

    async def _warm(self, model: Model) -> None:
        """One translation; refused if it comes back empty (a tokenizer that does not fit)."""
        [t] = await model.scheduler.translate([model.engine.prepare_text(WARMUP_TEXT, DecodingOptions(), 0)])
        if not (t.hypotheses and t.hypotheses[0].text.strip()):
            raise ModelRepositoryError(f"{model.manifest.root}: the warm-up translation of "
                                       f"{WARMUP_TEXT!r} came back empty")

    def _once(self, key: str, line: str) -> None:
        """Log ``line`` once until it changes (a half-copied version is seen at every poll)."""
        if self._reported.get(key) != line:
            self._reported[key] = line
            log.warning("%s", line)
