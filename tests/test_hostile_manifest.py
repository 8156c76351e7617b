"""Hostile model repositories: malformed manifests and version directories are refused with one
line naming the path and the field; the server and its watcher go on (issue 31, rows 1, 6, 12)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import ServerThread, config_for, wait_until
from service.api import convert
from service.errors import ModelRepositoryError
from service.models.manifest import MANIFEST, MAX_MANIFEST_BYTES, load_manifest
from service.models.repository import scan
from service.proto.nmt.v1 import translation_pb2 as pb
from test_reload import REQUEST, add_version


@pytest.fixture(scope="module")
def good_raw(reversal_repository: Path) -> dict[str, Any]:
    return json.loads((reversal_repository / MANIFEST).read_text())


def write(root: Path, raw: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return root


def use(manifest) -> None:
    """Everything the server reads from a loaded manifest after loading it."""
    convert.model_info(manifest, precision="fp32", provider="cpu", is_default=True)
    manifest.default_precision()
    assert manifest.max_source_tokens >= 1


@pytest.mark.parametrize("field, value, message", [
    ("limits", "x", r"limits must be an object, got 'x'"),
    ("limits", {"max_source_tokens": 1e400}, r"limits\.max_source_tokens must be an integer from 1 to "
                                             r"100000, got inf"),
    ("limits", {"max_source_tokens": 0}, r"limits\.max_source_tokens .* got 0"),
    ("limits", {"max_source_tokens": True}, r"limits\.max_source_tokens .* got True"),
    ("quality", "high", r"quality must be an object, got 'high'"),
    ("quality", {"engine": {"fp32": {"greedy": {"bleu": "30"}}}},
     r"quality\.engine\.fp32\.greedy\.bleu must be a finite number, got '30'"),
    ("quality", {"engine": {"fp32": 3}}, r"quality\.engine\.fp32 must be an object, got 3"),
    ("languages", 5, r"languages must be .*, got 5"),
    ("languages", {"source": 1}, r"languages must be .*, got \{'source': 1\}"),
    ("shortlist", {"file": 3}, r"shortlist\.file must be a file name, got 3"),
    ("shortlist", {"file": "s.npz", "bleu": {"test": "x"}}, r"shortlist\.bleu\.test must be an object"),
])
def test_a_mistyped_field_is_refused_at_load_naming_it(tmp_path: Path, good_raw: dict, field: str,
                                                       value: Any, message: str) -> None:
    root = write(tmp_path / "v", {**good_raw, field: value})
    with pytest.raises(ModelRepositoryError, match=rf"manifest\.json: {message}"):
        load_manifest(root, verify=False)


def test_an_oversized_or_deeply_nested_manifest_is_refused(tmp_path: Path, good_raw: dict) -> None:
    big = write(tmp_path / "big", {**good_raw, "padding": "x" * MAX_MANIFEST_BYTES})
    with pytest.raises(ModelRepositoryError, match=rf"at most {MAX_MANIFEST_BYTES} bytes, got \d+"):
        load_manifest(big, verify=False)
    deep = write(tmp_path / "deep", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelRepositoryError, match="not valid JSON"):
        load_manifest(deep, verify=False)
    digits = write(tmp_path / "digits", '{"x": ' + "9" * 5000 + "}")
    with pytest.raises(ModelRepositoryError, match="not valid JSON"):
        load_manifest(digits, verify=False)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3),
                    max_leaves=8)
FIELDS = ["limits", "quality", "languages", "shortlist", "name", "version", "special_ids", "tokenizers",
          "graphs", "files", "model_config"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON,
       nested=st.sampled_from([None, "engine", "max_source_tokens", "source", "file", "bleu"]))
def test_a_mutated_manifest_either_loads_and_serves_or_is_refused(tmp_path: Path, good_raw: dict,
                                                                  field: str, value: Any, nested) -> None:
    raw = json.loads(json.dumps(good_raw))
    if nested and isinstance(raw.get(field), dict):
        raw[field][nested] = value
    else:
        raw[field] = value
    root = tmp_path / "mutant"
    shutil.rmtree(root, ignore_errors=True)
    write(root, raw)
    try:
        manifest = load_manifest(root, verify=False)
    except ModelRepositoryError as e:
        assert "manifest.json" in str(e)
        return
    use(manifest)  # loaded: then nothing the server reads later may fail


def test_a_version_directory_with_a_non_ascii_digit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m" / "\u00b2").mkdir(parents=True)  # "²".isdigit(), but int("²") fails
    found, problems = scan(tmp_path)
    assert found == []
    assert problems == [f"refused {tmp_path / 'm' / chr(0xb2)}: a version directory's name must be a "
                        "number, got '²' (ASCII digits 0-9)"]


def test_hot_reload_survives_malformed_versions(reversal_repository: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Started with ``²`` present; then three malformed versions and a good one, by polling."""
    root = tmp_path / "models"
    add_version(reversal_repository, root, "1")
    (root / "reversal" / "\u00b2").mkdir()
    caplog.set_level(logging.INFO, logger="nmt.app")
    with ServerThread(config_for(root, "--model-control", "poll", "--poll-seconds", "0.1")) as server:
        bad = {"2": ("limits", "x"), "3": ("limits", {"max_source_tokens": 1e400}), "4": ("quality", "high"),
               "5": ("languages", 5)}
        for version, (field, value) in bad.items():
            add_version(reversal_repository, root, version,
                        edit=lambda _root, raw, f=field, v=value: raw.__setitem__(f, v))
        wait_until(lambda: server.metric("nmt_model_load_failures_total", name="reversal") == 4, timeout=60,
                   what="four refusals")
        add_version(reversal_repository, root, "90")
        wait_until(lambda: server.api.Translate(REQUEST, timeout=30).model_version == "90", timeout=60,
                   what="version 90 by polling")
        assert [(m.name, m.version) for m in server.api.ListModels(pb.ListModelsRequest(), timeout=10).models] == [
            ("reversal", "90")]
    lines = [r.getMessage() for r in caplog.records if r.name == "nmt.app"]
    for version, (field, _) in bad.items():
        refused = [line for line in lines if line.startswith(f"refused reversal/{version}:")]
        assert len(refused) == 1 and f"{version}/manifest.json: {field}" in refused[0], (version, lines)
    # once when the server started, once when the watcher first saw it: never again
    assert sum(line.startswith("refused ") and "\u00b2" in line for line in lines) == 2
    assert not any("rescan failed" in line for line in lines)


def test_the_watcher_survives_a_failing_rescan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A rescan's own failure (a bug, a file system error) is one line and a count; the polls go on."""
    import asyncio

    from service import app as app_module
    from service.metrics import Metrics

    calls = []

    def scan_failing(root: Path):
        calls.append(root)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(app_module, "scan", scan_failing)
    models = app_module.ServedModels(config_for(tmp_path), [], Metrics())

    async def poll_a_while() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(models.poll(0.01), 0.5)

    asyncio.run(poll_a_while())
    assert len(calls) >= 4  # at 0.01, 0.03, 0.07, 0.15, 0.31 s: the waits double (tests/test_watcher.py)
    assert models.metrics.model_watcher_failures._value.get() == len(calls)
    assert models.watcher.error == "RuntimeError: disk on fire"  # /readyz names it
    lines = [r.getMessage() for r in caplog.records if r.name == "nmt.app"]
    assert lines == ["rescan failed: RuntimeError: disk on fire"]
