"""The front door (``service.api.frontend``) on its own: what a new transport (LibreTranslate's
routes, say) would call, with no gRPC or HTTP server around it; and the one error table."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from harness import ROOT, config_for
from service.api.frontend import STATUS, Frontend, status
from service.app import ServedModels
from service.decoding.engine import Engine
from service.errors import ErrorKind, NmtError
from service.interface import Final
from service.metrics import Metrics
from service.options import DecodingOptions


def test_every_error_kind_has_one_grpc_code_and_one_http_status() -> None:
    assert set(STATUS) == set(ErrorKind)
    assert all(s.name == kind.name for kind, s in STATUS.items())  # the name every wire format shows
    assert len({s.grpc for s in STATUS.values()}) == len({s.http for s in STATUS.values()}) == len(STATUS)
    assert (status(ErrorKind.RESOURCE_EXHAUSTED).grpc, status(ErrorKind.RESOURCE_EXHAUSTED).http) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, 429)


def test_the_front_door_imports_no_transport() -> None:
    code = ("import sys, service.api.frontend; print(sorted(m for m in sys.modules if m in "
            "('service.api.grpc_server', 'service.api.http_server', 'service.api.server', 'aiohttp')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_front_door_serves_a_request_without_any_transport(reversal_repository: Path,
                                                               reversal_engine: Engine) -> None:
    config = config_for(reversal_repository)
    expected = [t.hypotheses[0].text for t in reversal_engine.translate(["1 2 3", "4 5"])]

    async def main() -> tuple[list[str], list[str], NmtError, NmtError]:
        metrics = Metrics()
        models = ServedModels(config, [Engine(reversal_repository)], metrics)
        door = Frontend(config=config, models=models, metrics=metrics)
        models.start()
        try:
            admitted = door.admit_request(texts=["1 2 3", "4 5"], options=DecodingOptions(),
                                          model="reversal")
            translations = await door.translate(admitted, timeout=60)
            events = [e async for e in door.stream(admitted, timeout=60)]
            assert isinstance(events[-1], Final)
            with pytest.raises(NmtError) as empty:
                door.admit_request(texts=[], options=DecodingOptions())
            with pytest.raises(NmtError) as unknown:
                door.admit_request(texts=["1"], options=DecodingOptions(), model="de-en")
        finally:
            await models.close()
        return ([t.hypotheses[0].text for t in translations],
                [t.hypotheses[0].text for t in events[-1].translations], empty.value, unknown.value)
    texts, streamed, empty, unknown = asyncio.run(main())
    assert texts == streamed == expected
    assert empty.kind is ErrorKind.INVALID_ARGUMENT
    assert empty.message == "texts must be at least one text, got 0"
    assert unknown.kind is ErrorKind.NOT_FOUND and status(unknown.kind).http == 404


def test_a_bug_becomes_internal_and_a_late_deadline_is_counted(reversal_repository: Path) -> None:
    metrics = Metrics()
    door = Frontend(config=config_for(reversal_repository), models=ServedModels(
        config_for(reversal_repository), [], metrics), metrics=metrics)
    error = door.failure(ZeroDivisionError("division by zero"), method="Translate")
    assert error.kind is ErrorKind.INTERNAL
    assert error.message == "internal error: ZeroDivisionError: division by zero"
    late = NmtError(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded while queued or decoding")
    assert door.failure(late, method="Translate") is late
    assert metrics.registry.get_sample_value("nmt_deadline_exceeded_total") == 1
