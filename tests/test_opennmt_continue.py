"""Continued runs for issue 30's 60-minute figure (``compare --continue-ours RUN --continue-peer RUN``):
our run trained on by ``nmt train --resume`` in a copy, OpenNMT-py's by ``train_from`` with its
batches replayed and skipped (worker faked: no OpenNMT-py here), and the orchestration's checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness import ROOT

sys.path.insert(0, str(ROOT / "loadtest"))

import opennmt_compare  # noqa: E402  (loadtest/ on sys.path first, as the script runs)
from opennmt import common, compare, train  # noqa: E402

from test_opennmt_compare import MACHINE, FakeTrainer, fake_evaluate  # noqa: E402

TINY = ("--emb-size", "16", "--enc-hidden-size", "16", "--dec-hidden-size", "16", "--attn-size", "16",
        "--out-size", "16", "--batch-tokens", "300", "--keep-checkpoints")


def batch(rows: int, lengths: list[int]) -> dict:
    """An OpenNMT batch as the clock reads it: tgt (rows, len, 1), BOS first, padding 1."""
    tgt = torch.ones(rows, max(lengths) + 1, 1, dtype=torch.long)
    for r, n in enumerate(lengths):
        tgt[r, : n + 1, 0] = 5
    return {"tgt": tgt}


def test_the_clock_skips_the_batches_a_continued_run_trained(tmp_path: Path) -> None:
    batches = [(batch(2, [3, 2]), "b"), (batch(1, [4]), "b"), (batch(3, [1, 1, 2]), "b"), (batch(2, [5, 5]), "b")]
    trained: list = []

    def original(self, train_iter, train_steps, **kwargs):
        trained.extend(b for b, _ in train_iter)

    stats: dict = {}
    fake_self = type("T", (), {"train_loss": type("L", (), {"padding_idx": 1})(), "model": torch.nn.Linear(2, 2)})()
    train.clocked_train(original, stats, budget=3600, write=lambda: None, skip=2)(fake_self, batches, 10)
    assert [b["tgt"].shape[0] for b in trained] == [3, 2]  # the last two batches only
    assert (stats["skipped_batches"], stats["skipped_sentences"], stats["skipped_tgt_tokens"]) == (2, 3, 9)
    assert (stats["steps"], stats["sentences"], stats["tgt_tokens"]) == (2, 5, 14)


def peer_previous(tmp_path: Path) -> Path:
    prev = tmp_path / "opennmt-r1"
    prev.mkdir()
    (prev / "model_step_817.pt").write_text("weights")
    (prev / "train.log").write_text("first part\n")
    (prev / "stats.json").write_text(json.dumps({
        "budget_s": 1800.0, "threads": 2, "torch": "2.13.0+cpu", "parameters": 12, "steps": 817,
        "sentences": 185230, "tgt_tokens": 2165264, "train_s": 1801.6, "sents_per_s": 102.8,
        "tgt_tokens_per_s": 1201.8, "checkpoint": str(prev / "model_step_817.pt")}))
    return prev


@pytest.mark.parametrize("replayed, ok", [((817, 185230, 2165264), True), ((817, 185000, 2165264), False)])
def test_the_peer_continues_from_its_last_checkpoint_with_its_optimizer(tmp_path: Path, monkeypatch,
                                                                        replayed: tuple, ok: bool) -> None:
    prev, data, run = peer_previous(tmp_path), tmp_path / "data", tmp_path / "continued"
    data.mkdir()
    (data / "train.src").write_text("a\nb\n")
    seen: dict = {}

    def fake_worker(run_dir: Path, *, minutes: float, threads: int, skip: int) -> None:
        seen.update(minutes=minutes, skip=skip, config=(run_dir / "config.yaml").read_text())
        (run_dir / "model_step_1634.pt").write_text("more weights")
        (run_dir / "stats.json").write_text(json.dumps({
            "budget_s": minutes * 60, "threads": 2, "torch": "2.13.0+cpu", "parameters": 12, "steps": 817,
            "sentences": 185000, "tgt_tokens": 2160000, "train_s": 1798.4, "skipped_batches": replayed[0],
            "skipped_sentences": replayed[1], "skipped_tgt_tokens": replayed[2]}))

    monkeypatch.setattr(train, "need_onmt", lambda: None)
    monkeypatch.setattr(train, "run_worker", fake_worker)
    if not ok:
        with pytest.raises(SystemExit, match="replayed .* are not the ones"):
            train.onmt_continue(data, prev, run, minutes=60, threads=2, valid_steps=2000, save_steps=1000,
                                report_every=100)
        return
    stats = train.onmt_continue(data, prev, run, minutes=60, threads=2, valid_steps=2000, save_steps=1000,
                                report_every=100)
    assert seen["skip"] == 817 and seen["minutes"] == pytest.approx(60 - 1801.6 / 60)
    assert f'train_from: "{run / "model_step_817.pt"}"' in seen["config"]
    assert 'reset_optim: "none"' in seen["config"] and f'save_model: "{run / "model"}"' in seen["config"]
    assert (stats["steps"], stats["sentences"], stats["tgt_tokens"]) == (1634, 370230, 4325264)
    assert stats["train_s"] == pytest.approx(3600.0) and stats["sents_per_s"] == pytest.approx(370230 / 3600.0)
    assert stats["checkpoint"] == str(run / "model_step_1634.pt") and stats["part"]["steps"] == 817
    assert sorted(p.name for p in prev.iterdir()) == ["model_step_817.pt", "stats.json", "train.log"]  # untouched
    assert json.loads((run / "stats.json").read_text())["continued_from"] == str(prev)


def test_a_peer_run_past_the_budget_is_not_continued(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(train, "need_onmt", lambda: None)
    with pytest.raises(SystemExit, match=r"already trained 30.03 min \(asked for 30\)"):
        train.onmt_continue(tmp_path, peer_previous(tmp_path), tmp_path / "x", minutes=30, threads=2,
                            valid_steps=2000, save_steps=1000, report_every=100)


def test_our_run_is_continued_in_a_copy_until_the_minutes_in_all(tiny_corpus: Path, tiny_tokenizers: Path,
                                                                  tmp_path: Path) -> None:
    """Real ``nmt train`` runs (tiny model): the first for 0.05 minutes, then a copy trained on to 0.1."""
    from export.train.checkpoint import load_checkpoint

    first = tmp_path / "ours-30"
    stats = compare.our_run(first, minutes=0.05, threads=1, corpus=tiny_corpus, tokenizers=tiny_tokenizers,
                            extra=TINY)
    compare.continuable(first, threads=1, corpus=tiny_corpus, tokenizers=tiny_tokenizers, extra=TINY)
    with pytest.raises(SystemExit, match="not a finished run of our recipe with the words"):
        compare.continuable(first, threads=1, corpus=tiny_corpus, tokenizers=tiny_tokenizers,
                            extra=(*TINY, "--lr", "0.002"))
    before = (first / "last.pt").stat().st_mtime_ns
    more = compare.our_run(tmp_path / "ours-60", minutes=0.1, threads=1, corpus=tiny_corpus,
                           tokenizers=tiny_tokenizers, extra=TINY, previous=first)
    assert (first / "last.pt").stat().st_mtime_ns == before  # the run continued stays as it was
    state = load_checkpoint(tmp_path / "ours-60" / "last.pt").extra["train_state"]
    assert state["elapsed"] >= 6.0 and more["steps"] == state["step"] > stats["steps"]
    assert more["continued_from"] == str(first) and "--resume" in more["command"]


def test_compare_continues_both_runs_in_one_round_and_writes_its_own_files(tmp_path: Path, monkeypatch) -> None:
    calls: list = []
    checked: list = []
    monkeypatch.setattr(compare, "our_run", FakeTrainer("ours", calls, [2100]))
    monkeypatch.setattr(compare, "peer_run", FakeTrainer("opennmt", calls, [1634]))
    monkeypatch.setattr(compare, "evaluate_runs", fake_evaluate)
    monkeypatch.setattr(compare, "need_onmt", lambda: None)
    monkeypatch.setattr(compare, "cmd_prepare", lambda args: None)
    monkeypatch.setattr(compare, "machine_info", lambda: dict(MACHINE))
    monkeypatch.setattr(compare, "continuable", lambda run, **kw: checked.append((run, kw["extra"])))
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    peer = peer_previous(tmp_path)
    argv = ["compare", "corpus", "--tokenizers", "tok", "--minutes", "60", "--work", str(tmp_path / "work"),
            "--ours-args=--valid-long 200", "--continue-ours", str(tmp_path / "ours-r1"), "--continue-peer", str(peer)]
    assert opennmt_compare.main(argv) == 0
    assert checked == [(tmp_path / "ours-r1", ("--valid-long", "200"))]
    assert [(c["who"], c["minutes"], c["previous"]) for c in calls] == [
        ("ours", 60, tmp_path / "ours-r1"), ("opennmt", 60, peer)]
    res = json.loads((tmp_path / "results" / "opennmt_compare_60min.json").read_text())
    assert res["plan"]["continued"] == [str(tmp_path / "ours-r1"), str(peer)]
    assert res["rounds"][0]["runs"]["ours"]["run"] == str(tmp_path / "work" / "continued-60m" / "compare" / "ours-r1")
    assert "--continue-peer" in res["command"] and not (tmp_path / "results" / "opennmt_compare.json").exists()
    assert "**Continued runs:**" in (tmp_path / "results" / "opennmt_compare_60min.md").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--continue-ours", "a"], "go together"),
    (["--continue-ours", "a", "--continue-peer", "b", "--rounds", "2"], "one round"),
])
def test_continued_runs_are_refused_without_their_pair_or_in_rounds(extra: list, message: str, monkeypatch) -> None:
    monkeypatch.setattr(compare, "need_onmt", lambda: pytest.fail("got as far as OpenNMT"))
    with pytest.raises(SystemExit, match=message):
        opennmt_compare.main(["compare", "c", "--tokenizers", "t", "--minutes", "60", *extra])
