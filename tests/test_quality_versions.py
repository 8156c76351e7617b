"""``loadtest/quality_versions.py``: versions compared through the engine on held-out sentences."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "loadtest"))

import quality_versions  # noqa: E402  (loadtest/ on sys.path first, as the script runs)


def test_sentences_trained_on_are_left_out_and_both_systems_scored_alike(tiny_repository: Path, tiny_corpus: Path,
                                                                        tmp_path: Path) -> None:
    from export.evaluate.evaluate import letters

    train = tmp_path / "train.jsonl"  # a third of the test split's sources, as if trained on
    tests = (tiny_corpus / "test.jsonl").read_text().splitlines()
    train.write_text("\n".join(tests[::3]) + "\n")
    trained = {letters(json.loads(line)["src"]) for line in tests[::3]}
    expected = sum(letters(json.loads(line)["src"]) not in trained for line in tests)
    out = tmp_path / "versions"
    assert quality_versions.main(["new=" + str(tiny_repository), "old=" + str(tiny_repository),
                                  "--corpus", str(tiny_corpus), "--exclude-train", str(train),
                                  "--splits", "test", "--beams", "1", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["new", "old"]
    assert {r["sentences"] for r in rows} == {expected} and 0 < expected < len(tests)
    assert (rows[0]["bleu"], rows[0]["chrf"]) == (rows[1]["bleu"], rows[1]["chrf"])  # one model twice
    assert f"| test ({expected}) | 1 |" in out.with_suffix(".md").read_text()
