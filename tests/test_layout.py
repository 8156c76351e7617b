"""``service/`` is laid out by the request's path and its imports run down only
(``../shared/DESIGN.md``): a module imports its own package or layers below its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[1] / "service"
LAYERS = [
    {"service.errors", "service.proto", "service.choices", "service.languages"},
    {"service.options", "service.metrics"},
    {"service.interface", "service.config"},
    {"service.text", "service.models", "service.process"},
    {"service.decoding", "service.scheduling"},  # these two meet only through service.interface
    {"service.app"},
    {"service.api", "service.clients"},
    {"service.cli"},
]
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
CLIENTS_MAY_IMPORT = {"service.proto", "service.text", "service.options", "service.languages"}


def unit(module: str) -> str:
    """The layer unit of a module: ``service.decoding.batch`` -> ``service.decoding``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                      if node.module == "service"]
    return found


MODULES = sorted(p for p in SERVICE.rglob("*.py") if "proto" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SERVICE.parent)))
def test_imports_run_down_only(path: Path) -> None:
    module = ".".join(path.relative_to(SERVICE.parent).with_suffix("").parts).removesuffix(".__init__")
    own = unit(module)
    if own == "service":  # service/__init__.py
        return
    assert own in LEVEL, f"{module}: a new top-level unit of service/ belongs in LAYERS"
    for imported in imports(path):
        if not imported.startswith("service.") or unit(imported) == own:
            assert imported.split(".")[0] not in ("torch", "export"), f"{module} imports {imported}"
            if own not in ("service.api", "service.clients", "service.cli"):
                assert imported.split(".")[0] != "grpc", f"{module}: protobuf and gRPC stay at the edge"
            continue
        other = unit(imported)
        assert LEVEL[other] < LEVEL[own], f"{module} imports {imported}: an arrow that runs up"
        if own == "service.clients":
            assert other in CLIENTS_MAY_IMPORT, f"{module} imports {imported}"
        if LEVEL[own] < LEVEL["service.api"]:
            assert other != "service.proto", f"{module}: protobuf below the api layer"


def test_every_unit_exists() -> None:
    for name in LEVEL:
        rel = Path(*name.split(".")[1:])
        assert (SERVICE / rel).is_dir() or (SERVICE / rel).with_suffix(".py").is_file(), name


TRANSPORTS = ("service.api.grpc_server", "service.api.http_server")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transport_calls_the_front_door_and_imports_no_other_transport(transport: str) -> None:
    path = SERVICE.parent.joinpath(*transport.split(".")).with_suffix(".py")
    found = {".".join(m.split(".")[:3]) for m in imports(path)}
    assert "service.api.frontend" in found
    others = {*TRANSPORTS, "service.api.server"} - {transport}  # server.App knows them all
    assert not found & others, f"{transport} imports another transport"
