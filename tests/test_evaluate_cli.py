"""`nmt evaluate` on a tiny model, and the `nmt` command's offline/online split."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import sacrebleu

from export.cli import train_main
from export.evaluate import evaluate
from service.cli import INSTALL_HINT
from service.cli import main as nmt_main


def test_evaluate_writes_scores_tables_and_heatmaps(tiny_checkpoint: Path, tiny_corpus: Path,
                                                   tmp_path: Path) -> None:
    results = evaluate.evaluate(tiny_checkpoint, tiny_corpus, tmp_path / "eval", beam_size=3,
                                heatmaps=("Delete %s files?", "The red car"), log=lambda *_: None)
    assert set(results["decoders"]) == {"greedy", "beam3"}
    refs = [json.loads(line)["tgt_raw"] for line in (tiny_corpus / "test.jsonl").read_text().splitlines()]
    for name, r in results["decoders"].items():  # the scores are those of the outputs it wrote
        written = (tmp_path / "eval" / f"{name}.txt").read_text().splitlines()
        assert r["bleu"] == round(sacrebleu.corpus_bleu(written, [refs]).score, 2)
        assert r["chrf"] == round(sacrebleu.corpus_chrf(written, [refs]).score, 2)
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


def test_evaluate_command_scores_the_reversal_model_high(reversal_checkpoint: Path, reversal_corpus: Path,
                                                         tmp_path: Path, capsys) -> None:
    """``nmt evaluate`` on a model known to reverse digit strings: a broken decoder, scorer or
    output order would score far lower (the untrained tiny model scores near 0)."""
    out = tmp_path / "eval"
    assert nmt_main(["evaluate", str(reversal_checkpoint), "--corpus", str(reversal_corpus), "--output", str(out),
                     "--beam", "2", "--max-sentences", "100", "--heatmap", "1 2 3", "--threads", "1"]) == 0
    assert "| greedy |" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["sentences"] == 100 and set(results["decoders"]) == {"greedy", "beam2"}
    sources = [json.loads(line)["src_raw"] for line in (reversal_corpus / "test.jsonl").read_text().splitlines()]
    for name, r in results["decoders"].items():
        written = (out / f"{name}.txt").read_text().splitlines()
        reversed_ = sum(w == " ".join(reversed(s.split())) for w, s in zip(written, sources))
        assert reversed_ >= 90, name  # as the served model (test_api.py: 190 of 200)
        assert r["bleu"] >= 90 and r["chrf"] >= 90, (name, r["bleu"], r["chrf"])
    assert results["heatmaps"][0]["translation"] == "3 2 1"


def test_evaluate_command_scores_the_long_set(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path,
                                             capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pairs = (tiny_corpus / "test.jsonl").read_text().splitlines()
    (corpus / "long.jsonl").write_text("\n".join(pairs[:3]) + "\n")  # another split than test
    out = tmp_path / "eval"
    assert nmt_main(["evaluate", str(tiny_checkpoint), "--corpus", str(corpus), "--split", "long",
                     "--output", str(out), "--beam", "2", "--heatmap", "1 2", "--threads", "1"]) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["split"] == "long" and results["sentences"] == 3
    assert len((out / "beam2.txt").read_text().splitlines()) == 3


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
    assert re.fullmatch(r"nmt corpus: offline command, not available here \(export(\.\w+)* is not installed\); "
                        + re.escape(INSTALL_HINT) + "\n", proc.stderr), proc.stderr  # names what is missing


def test_unknown_command(capsys) -> None:
    assert nmt_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_characters_with_no_piece_are_counted_and_kept(tiny_checkpoint: Path, tiny_tokenizers: Path,
                                                      tmp_path: Path) -> None:
    """Runs of characters the vocabulary cannot read (an emoji with its skin tone, a rare symbol) are
    counted per split, and the share found again in the translations is reported (issue 30, item 4)."""
    from conftest import make_corpus
    from service.text.tokenizer import Tokenizer

    tok = Tokenizer(tiny_tokenizers / "source.model", tiny_tokenizers / "target.model")
    assert evaluate.unknown_runs(tok, "Delete 👍🏽 files %s ⌘ now") == ("👍🏽", "⌘")  # %s is a placeholder
    assert evaluate.kept_runs(["Supprimer 👍🏽 ⌘", "⌘"], (("👍🏽", "⌘", "⌘"), ("⌘",))) == (4, 3)
    pairs = [("Delete 👍🏽 files", "Supprimer 👍🏽 fichiers"), ("The red car ⌘", "La voiture rouge ⌘"),
             ("The red car", "La voiture rouge")]
    corpus = make_corpus(tmp_path / "corpus", pairs, pairs)
    results = evaluate.evaluate(tiny_checkpoint, corpus, tmp_path / "eval", beam_size=2, heatmaps=(),
                                log=lambda *_: None)
    for name, r in results["decoders"].items():
        written = (tmp_path / "eval" / f"{name}.txt").read_text().splitlines()
        expected = sum(run in line for run, line in zip(("👍🏽", "⌘"), written)) / 2
        assert r["unknown_runs"] == 2 and r["unknown_kept"] == expected, name
    assert "of 2 |" in (tmp_path / "eval" / "results.md").read_text()
