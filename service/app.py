"""The served models: find them, load them, warm them up, look them up, close them.

Protocol-free: the gRPC server (``service.api.grpc_server``) and any other front end
use one ``ServedModels``. Here the decoding engine (``service.decoding``) is wired to
the scheduler (``service.scheduling``); the two meet only through ``service.interface``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from service.config import ServeConfig
from service.errors import ErrorKind, ModelRepositoryError, NmtError, shown
from service.interface import Engine
from service.metrics import Metrics
from service.models.manifest import MANIFEST, Manifest, check_graphs, check_vocabularies
from service.options import DecodingOptions
from service.scheduling.scheduler import Scheduler

WARMUP_TEXT = "Hello world"


@dataclass(frozen=True)
class Model:
    """One served model: its engine and the scheduler feeding it."""

    manifest: Manifest
    engine: Engine
    scheduler: Scheduler

    @property
    def ref(self) -> str:
        return f"{self.manifest.name}/{self.manifest.version}"


def find_repositories(root: Path) -> list[Path]:
    """``root`` itself if it holds a manifest, else every ``root/<name>/<version>/``."""
    if (root / MANIFEST).is_file():
        return [root]
    found = sorted(p.parent for p in root.glob(f"*/*/{MANIFEST}"))
    if not found:
        raise ModelRepositoryError(f"{root}: no {MANIFEST} there nor in <name>/<version>/ below it")
    return found


def load_engines(config: ServeConfig) -> list[Engine]:
    """One engine per model repository (checksums verified by the engine's manifest load)."""
    from service.decoding.engine import Engine as OnnxEngine

    engines = [OnnxEngine(path, precision=config.precision, provider=config.provider,
                          intra_op_threads=config.threads or None, limits=config.limits,
                          decoder_spinning=config.decoder_spinning)
               for path in find_repositories(config.model_repository)]
    for engine in engines:
        check_engine(engine, config.precision)
    return engines


def check_engine(engine: Any, precision: str) -> None:
    """A loaded ONNX engine's graphs and tokenizers must agree with its manifest's model_config:
    checksums prove the files are the ones listed, not that they belong together."""
    sessions = {"encoder": engine.runtime.encoder, "decoder_step": engine.runtime.decoder}
    shapes = {graph: {a.name: list(a.shape) for a in [*s.get_inputs(), *s.get_outputs()]}
              for graph, s in sessions.items()}
    check_graphs(engine.manifest, precision, shapes)
    check_vocabularies(engine.manifest, source=engine.tokenizer.source.get_piece_size(),
                       target=engine.tokenizer.target.get_piece_size())


def version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


class ServedModels:
    """The models of one server, the default one first; each with its own scheduler."""

    def __init__(self, config: ServeConfig, engines: Sequence[Engine], metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        models = [Model(e.manifest, e, Scheduler(e, config.scheduler, metrics=metrics)) for e in engines]
        models.sort(key=lambda m: version_key(m.manifest.version), reverse=True)  # newest first
        models.sort(key=lambda m: (m.manifest.name != config.default_model, m.manifest.name))
        if config.default_model and models[0].manifest.name != config.default_model:
            raise ModelRepositoryError(f"--default-model {config.default_model!r} is not among the "
                                       f"loaded models {[m.ref for m in models]}")
        self.all = models

    def get(self, name: str) -> Model:
        """The model a request names (``name`` or ``name/version``; empty: the default)."""
        if not name:
            return self.all[0]
        matches = [m for m in self.all if name in (m.manifest.name, m.ref)]
        if not matches:
            raise NmtError(ErrorKind.NOT_FOUND, f"model must be one of "
                           f"{sorted({m.manifest.name for m in self.all})}, got {shown(name)}")
        return max(matches, key=lambda m: version_key(m.manifest.version))

    def start(self) -> None:
        """Start every scheduler's engine thread (inside the serving event loop)."""
        for m in self.all:
            m.scheduler.start()
            self.metrics.set_model(name=m.manifest.name, version=m.manifest.version,
                                   sha256=m.manifest.sha256, provider=self.config.provider,
                                   precision=self.config.precision)

    async def warm_up(self) -> float:
        """Translate one text with every model; the seconds it took."""
        started = time.perf_counter()
        for m in self.all:
            await m.scheduler.translate([m.engine.prepare(WARMUP_TEXT, DecodingOptions(), 0)])
        return time.perf_counter() - started

    async def close(self) -> None:
        for m in self.all:
            await m.scheduler.close()
