"""``--precision auto`` (the default): int8 where the model's manifest shows it costs at most
0.3 BLEU against fp32 for greedy and beam search, fp32 otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import config_for
from service.app import load_engines
from service.config import parse
from service.models.manifest import MANIFEST, load_manifest


def with_quality(repo: Path, tmp_path: Path, engine_quality: dict | None, *, drop_int8: bool = False) -> Path:
    copy = Path(shutil.copytree(repo, tmp_path / "repo"))
    raw = json.loads((copy / MANIFEST).read_text())
    if engine_quality is not None:
        raw.setdefault("quality", {})["engine"] = engine_quality
    if drop_int8:
        raw["graphs"].pop("int8")
    (copy / MANIFEST).write_text(json.dumps(raw))  # the manifest itself carries no checksum
    return copy


def bleu(fp32_greedy: float, int8_greedy: float, fp32_beam: float, int8_beam: float) -> dict:
    return {"fp32": {"greedy": {"bleu": fp32_greedy}, "beam5": {"bleu": fp32_beam}},
            "int8": {"greedy": {"bleu": int8_greedy}, "beam5": {"bleu": int8_beam}}}


@pytest.mark.parametrize("quality, drop_int8, expected, why", [
    (bleu(47.9, 47.7, 50.9, 50.8), False, "int8", "greedy BLEU 47.9 fp32 / 47.7 int8"),
    (bleu(47.9, 47.5, 50.9, 50.8), False, "fp32", "int8 loses 0.40 BLEU (> 0.3)"),
    (bleu(47.9, 48.0, 50.9, 50.5), False, "fp32", "int8 loses 0.40 BLEU"),
    ({"fp32": {"greedy": {"bleu": 1.0}}, "int8": {"greedy": {"bleu": 1.0}}}, False, "fp32", "no measured"),
    (None, False, "fp32", "no measured int8 BLEU"),
    (bleu(47.9, 47.9, 50.9, 50.9), True, "fp32", "only fp32 graphs"),
])
def test_the_measured_default(tiny_repository: Path, tmp_path: Path, quality: dict | None, drop_int8: bool,
                              expected: str, why: str) -> None:
    repo = with_quality(tiny_repository, tmp_path, quality, drop_int8=drop_int8)
    precision, reason = load_manifest(repo).default_precision()
    assert precision == expected and why in reason
    engines = load_engines(parse(["--model-repository", str(repo), "--threads", "1"], env={}))
    assert [e.precision for e in engines] == [expected]


def test_an_explicit_precision_wins(tiny_repository: Path, tmp_path: Path) -> None:
    repo = with_quality(tiny_repository, tmp_path, bleu(47.9, 47.9, 50.9, 50.9))
    config = config_for(repo, "--precision", "fp32")
    assert config.precision == "fp32" and [e.precision for e in load_engines(config)] == ["fp32"]
    assert parse([], env={}).precision == "auto"
