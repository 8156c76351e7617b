"""``export/`` is grouped by stage (``../shared/DESIGN.md``): data -> train -> graphs -> evaluate,
each importing only the stages before it; files and functions within the size rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXPORT = Path(__file__).resolve().parents[1] / "export"
STAGES = ["export.data", "export.train", "export.graphs", "export.evaluate"]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 300, 60
MODULES = sorted(EXPORT.rglob("*.py"))


def name_of(path: Path) -> str:
    return ".".join(path.relative_to(EXPORT.parent).with_suffix("").parts).removesuffix(".__init__")


def stage_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def export_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "export"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "export":
            found += [f"{node.module}.{a.name}" if node.module in ("export", *STAGES) else node.module
                      for a in node.names]
    return found


def test_every_module_belongs_to_a_stage() -> None:
    loose = [name_of(p) for p in MODULES if stage_of(name_of(p)) not in (*STAGES, "export", "export.cli")]
    assert not loose and all(EXPORT.joinpath(*s.split(".")[1:], "__init__.py").is_file() for s in STAGES)
    assert sorted(p.name for p in EXPORT.glob("*.py")) == ["__init__.py", "cli.py"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(EXPORT.parent)))
def test_a_stage_imports_only_the_stages_before_it(path: Path) -> None:
    own = stage_of(name_of(path))
    if own not in STAGES:  # export/cli.py wires them all
        return
    for imported in export_imports(ast.parse(path.read_text())):
        other = stage_of(imported)
        assert other in STAGES and STAGES.index(other) <= STAGES.index(own), \
            f"{name_of(path)} imports {imported}: an arrow that runs back"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(EXPORT.parent)))
def test_files_and_functions_within_the_size_rule(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(source.splitlines())} lines"
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
