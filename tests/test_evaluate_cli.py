"""`nmt evaluate` on a tiny model, and the `nmt` command's offline/online split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from export import evaluate
from export.cli import train_main
from service.cli import main as nmt_main


def test_evaluate_writes_scores_tables_and_heatmaps(tiny_checkpoint: Path, tiny_corpus: Path,
                                                   tmp_path: Path) -> None:
    results = evaluate.evaluate(tiny_checkpoint, tiny_corpus, tmp_path / "eval", beam_size=3,
                                heatmaps=("Delete %s files?", "The red car"), log=lambda *_: None)
    assert set(results["decoders"]) == {"greedy", "beam3"}
    for r in results["decoders"].values():
        assert 0.0 <= r["bleu"] <= 100.0 and 0.0 <= r["chrf"] <= 100.0
        assert sum(b["sentences"] for b in r["bleu_by_source_words"].values()) == results["sentences"]
        assert r["placeholders_kept"] == 1.0  # restoration never loses one, even untrained
        assert r["sentences_unseen"] == 0 and r["bleu_unseen"] is None  # the tiny test split is in train
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["decoders"] == results["decoders"]
    for k in range(2):
        assert (tmp_path / "eval" / f"heatmap-{k}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "eval" / "greedy.txt").read_text().splitlines()
    assert len(lines) == results["sentences"]
    assert "| greedy |" in (tmp_path / "eval" / "results.md").read_text()


def test_train_cli_reports_missing_inputs_in_one_line(tiny_tokenizers: Path, tmp_path: Path, capsys) -> None:
    rc = train_main([str(tmp_path / "nope"), "--tokenizers", str(tiny_tokenizers), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "nope/train.jsonl: split file does not exist" in err
    rc = train_main([str(tmp_path), "--tokenizers", str(tmp_path), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "source.model: SentencePiece model does not exist" in err


def test_offline_command_without_export_says_how_to_install() -> None:
    code = ("import sys; sys.modules['export'] = None\n"  # as in the serving image: no export/
            "from service.cli import main; sys.exit(main(['corpus', '--help']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "offline command" in proc.stderr and "nmt-serve[export]" in proc.stderr
    assert "torch" not in proc.stderr.lower() or "not installed" in proc.stderr


def test_unknown_command(capsys) -> None:
    assert nmt_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
