"""``loadtest/opennmt_compare.py levers`` (issue 30): each lever a run of our trainer beside the
baseline, every candidate checkpoint scored; with a fake trainer, scorer and averager (no training)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness import ROOT

sys.path.insert(0, str(ROOT / "loadtest"))

import opennmt_compare  # noqa: E402  (loadtest/ on sys.path first, as the script runs)
from opennmt import common, compare, levers  # noqa: E402

# test BLEU of each (lever, checkpoint); long BLEU is test - 10
BLEU = {("baseline", "best"): 30.0, ("baseline", "last"): 29.5, ("baseline", "ema"): 31.0,
        ("baseline", "avg3"): 30.5, ("rsqrt", "best"): 32.25, ("rsqrt", "last"): 32.0, ("rsqrt", "ema"): 33.0,
        ("rsqrt", "avg3"): 32.5}


def fake_train(calls: list, kept: int = 4):
    def train(run: Path, *, extra: tuple[str, ...], **_) -> dict:
        calls.append((run.name, extra))
        (run / "checkpoints").mkdir(parents=True)
        for name in ("best.pt", "last.pt", "ema.pt"):
            (run / name).write_text(f"{run.name} {name[:-3]}")
        for step in range(1, kept + 1):
            (run / "checkpoints" / f"step-{step * 100}.pt").write_text(str(step * 100))
        return {"steps": 430, "sents_per_s": 160.04, "train_s": 600.0}
    return train


def fake_score(checkpoint: Path) -> dict:
    lever, label = checkpoint.read_text().split()
    return {"test": {"bleu": BLEU[lever, label], "chrf": 50.0}, "long": {"bleu": BLEU[lever, label] - 10, "chrf": 40.0}}


def fake_average(averaged: list):
    def average(kept: list[Path], out: Path) -> None:
        averaged.append([p.name for p in kept])
        out.write_text(f"{out.parent.name} {out.stem}")
    return average


def test_every_lever_runs_with_the_base_words_and_every_candidate_is_scored(tmp_path: Path) -> None:
    calls, averaged = [], []
    rows = levers.run_levers([("baseline", ()), ("rsqrt", ("--lr-schedule", "rsqrt"))], base=("--keep-checkpoints",),
                             runs_dir=tmp_path, average=3, train=fake_train(calls), score=fake_score,
                             averager=fake_average(averaged))
    assert calls == [("baseline", ("--keep-checkpoints",)), ("rsqrt", ("--keep-checkpoints", "--lr-schedule", "rsqrt"))]
    assert averaged == [["step-200.pt", "step-300.pt", "step-400.pt"]] * 2  # the last three, in step order
    assert [(r["lever"], r["checkpoint"]) for r in rows] == list(BLEU)
    assert all(r["scores"]["test"]["bleu"] == BLEU[r["lever"], r["checkpoint"]] for r in rows)
    markdown = levers.levers_markdown({"rows": rows, "steps": 430, "minutes": 10, "threads": 2, "corpus": "c",
                                       "base": ["--keep-checkpoints"], "max_sentences": 100, "machine": "m",
                                       "date": "d", "command": "P levers"})
    line = next(x for x in markdown.splitlines() if x.startswith("| rsqrt |") and "| best |" in x)
    assert "| 32.25 | 50.0 | +2.25 |" in line and "| 22.25 | 40.0 | +2.25 |" in line  # against baseline best


def test_too_few_kept_checkpoints_are_not_averaged(tmp_path: Path) -> None:
    averaged = []
    rows = levers.run_levers([("baseline", ())], base=(), runs_dir=tmp_path, average=3, train=fake_train([], kept=2),
                             score=fake_score, averager=fake_average(averaged))
    assert averaged == [] and [r["checkpoint"] for r in rows] == ["best", "last", "ema"]


@pytest.mark.parametrize("text", ["rsqrt", "=--lr 0.002", "name=", " = "])
def test_a_lever_needs_a_name_and_words(text: str) -> None:
    with pytest.raises(SystemExit, match="NAME=ARGS"):
        levers.parse_lever(text)


def test_the_levers_subcommand_runs_a_step_budget_and_writes_the_table(tmp_path: Path, monkeypatch) -> None:
    calls: list = []
    train = fake_train(calls)
    budgets: list = []

    def our_run(run: Path, *, minutes: float, threads: int, corpus: Path, tokenizers: Path, extra=()) -> dict:
        budgets.append((minutes, threads, corpus.name, tokenizers.name))
        return train(run, extra=extra)

    monkeypatch.setattr(compare, "our_run", our_run)
    monkeypatch.setattr(compare, "machine_info", lambda: {"cpu": "Fake CPU", "flags": ["avx2"], "cores": 2})
    monkeypatch.setattr(levers, "score_checkpoint", lambda ckpt, **_: fake_score(ckpt))
    monkeypatch.setattr(levers, "same_weights", lambda best, last: False)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    import export.train.checkpoint as checkpoint
    monkeypatch.setattr(checkpoint, "release", lambda kept, out, average: out.write_text(f"{out.parent.name} avg3"))
    assert opennmt_compare.main(["levers", str(tmp_path / "corpus"), "--tokenizers", str(tmp_path / "tok"),
                                 "--work", str(tmp_path / "work"), "--steps", "430", "--base-args", "--ema-decay 0.99",
                                 "--lever", "rsqrt=--lr-schedule rsqrt --warmup-steps 100"]) == 0
    assert calls == [("baseline", ("--ema-decay", "0.99", "--max-steps", "430")),
                     ("rsqrt", ("--ema-decay", "0.99", "--max-steps", "430", "--lr-schedule", "rsqrt",
                                "--warmup-steps", "100"))]
    assert {b[0] for b in budgets} == {600.0}  # a step budget: the clock only guards
    data = json.loads((tmp_path / "results" / "opennmt_levers.json").read_text())
    assert len(data["rows"]) == 8 and data["steps"] == 430 and "flags avx2" in data["machine"]
    assert "430 updates each" in (tmp_path / "results" / "opennmt_levers.md").read_text()


def test_a_finished_run_is_reused_and_last_is_left_out_when_it_is_best(tmp_path: Path) -> None:
    calls, averaged = [], []
    fake_train(calls)(tmp_path / "baseline", extra=())  # trained before: the run directory holds it
    calls.clear()
    reused = []

    def reuse(run: Path, extra: tuple[str, ...]) -> dict | None:
        reused.append(run.name)
        return {"steps": 430, "sents_per_s": 150.0, "train_s": 610.0} if run.name == "baseline" else None

    rows = levers.run_levers([("baseline", ()), ("rsqrt", ("--lr-schedule", "rsqrt"))], base=(), runs_dir=tmp_path,
                             average=3, train=fake_train(calls), score=fake_score, averager=fake_average(averaged),
                             reuse=reuse, same=lambda best, last: True)
    assert reused == ["baseline", "rsqrt"] and [c[0] for c in calls] == ["rsqrt"]  # only the new lever trains
    assert [(r["lever"], r["checkpoint"]) for r in rows] == [(lever, label) for lever in ("baseline", "rsqrt")
                                                             for label in ("best", "ema", "avg3")]
    assert rows[0]["sents_per_s"] == 150.0
    averaged.clear()
    levers.candidates(tmp_path / "rsqrt", 3, fake_average(averaged))  # its average is newer than the kept ones
    assert averaged == []


def test_a_checkpoint_is_scored_once_for_the_same_file_and_sentences(tmp_path: Path) -> None:
    checkpoint = tmp_path / "best.pt"
    checkpoint.write_text("baseline best")
    scored = []

    def score(path: Path) -> dict:
        scored.append(path.name)
        return fake_score(path)

    once = levers.cached(score, 100)
    assert once(checkpoint) == once(checkpoint) == fake_score(checkpoint) and scored == ["best.pt"]
    levers.cached(score, 200)(checkpoint)  # other sentences
    checkpoint.write_text("baseline ema")  # another file
    assert levers.cached(score, 200)(checkpoint)["test"]["bleu"] == BLEU["baseline", "ema"]
    assert scored == ["best.pt"] * 3


def test_finished_run_recognises_the_settings_of_a_real_run(tiny_corpus: Path, tiny_tokenizers: Path,
                                                            tmp_path: Path) -> None:
    from export.cli import train_main

    run = tmp_path / "run"
    words = [str(tiny_corpus), "--tokenizers", str(tiny_tokenizers), "--output", str(run), "--max-steps", "3",
             "--batch-tokens", "300", "--threads", "1", "--emb-size", "16", "--enc-hidden-size", "16",
             "--dec-hidden-size", "16", "--attn-size", "16", "--out-size", "16", "--keep-checkpoints"]
    assert not levers.finished_run(run, words)
    assert train_main(words) == 0
    assert levers.finished_run(run, words)
    assert not levers.finished_run(run, words + ["--lr", "0.002"])  # another training setting
    assert not levers.finished_run(run, words + ["--dropout", "0.1"])  # another model
    assert not levers.finished_run(run, words + ["--max-steps", "6"])  # another budget
