"""``loadtest/opennmt_compare.py compare`` (issue 30): the orchestration with fake trainers and a
fake evaluator injected (no OpenNMT-py, no training): the alternating order, equal budgets, the
medians and differences in the written files, SMOKE labels, the machine line and failed runs."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from pathlib import Path

import pytest

from harness import ROOT

sys.path.insert(0, str(ROOT / "loadtest"))

import opennmt_compare  # noqa: E402  (loadtest/ on sys.path first, as the script runs)
from opennmt import common, compare  # noqa: E402

# Per-round test BLEU of the fakes: the medians of the differences (1.0) and the difference of
# the medians (31 - 29 = 2.0) differ, so a test can tell which one a file reports.
OURS_BLEU, PEER_BLEU = [30.0, 34.0, 31.0], [29.0, 35.0, 28.0]
MACHINE = {"cpu": "Fake CPU 9000", "flags": ["avx2", "avx512_vnni"], "cores": 2}


class FakeTrainer:
    """Records every call (into a log shared by both trainers); writes a checkpoint."""

    def __init__(self, who: str, calls: list, steps: list[int], fail_round: int | None = None) -> None:
        self.who, self.calls, self.steps, self.fail_round = who, calls, steps, fail_round

    def __call__(self, run: Path, *, minutes: float, threads: int, **extra) -> dict:
        round_no = int(run.name.rsplit("-r", 1)[1])
        self.calls.append({"who": self.who, "round": round_no, "minutes": minutes, "threads": threads, **extra})
        if round_no == self.fail_round:
            raise SystemExit(f"{self.who} training failed (1); {run / 'train.log'} ends: boom")
        run.mkdir(parents=True, exist_ok=True)
        (run / "model.pt").write_text(f"{self.who} {round_no}")
        steps = self.steps[round_no - 1]
        return {"steps": steps, "sentences": steps * 200, "tgt_tokens": steps * 2400, "train_s": minutes * 60 - 1,
                "sents_per_s": steps * 200 / (minutes * 60), "tgt_tokens_per_s": steps * 2400 / (minutes * 60),
                "checkpoint": str(run / "model.pt")}


def fake_evaluate(ours: Path, peer: Path, out_dir: Path, **_) -> dict:
    """Scores read off the fake checkpoints: each system's BLEU for that round, chrF = BLEU + 20."""
    def scores(ckpt: Path, table: list[float], long_shift: float) -> dict:
        who, round_no = ckpt.read_text().split()
        bleu = table[int(round_no) - 1] - long_shift
        return {"bleu": bleu, "chrf": bleu + 20}

    assert ours.read_text().startswith("ours") and peer.read_text().startswith("opennmt")
    return {split: {"sentences": n, "ours": scores(ours, OURS_BLEU, shift),
                    "opennmt": scores(peer, PEER_BLEU, 2 * shift)}
            for split, n, shift in (("test", 40, 0.0), ("long", 20, 5.0))}


def make_plan(tmp_path: Path, *, minutes: float = 30, rounds: int = 3,
              max_sentences: int | None = None) -> compare.Plan:
    return compare.Plan(corpus=tmp_path / "corpus", tokenizers=tmp_path / "tok", work=tmp_path / "work",
                        minutes=minutes, rounds=rounds, threads=2, max_sentences=max_sentences, command="P compare")


def run_fake(tmp_path: Path, calls: list | None = None, **plan) -> dict:
    calls = [] if calls is None else calls
    trainers = {"ours": FakeTrainer("ours", calls, [100, 120, 110]),
                "opennmt": FakeTrainer("opennmt", calls, [80, 90, 70])}
    return compare.run_compare(make_plan(tmp_path, **plan), trainers=trainers, evaluate=fake_evaluate,
                               machine=lambda: dict(MACHINE))


def test_order_alternates_across_rounds(tmp_path: Path) -> None:
    calls: list = []
    res = run_fake(tmp_path, calls, rounds=3)
    assert [(c["round"], c["who"]) for c in calls] == [(1, "ours"), (1, "opennmt"), (2, "opennmt"), (2, "ours"),
                                                       (3, "ours"), (3, "opennmt")]
    assert [r["order"] for r in res["rounds"]] == [["ours", "opennmt"], ["opennmt", "ours"], ["ours", "opennmt"]]
    assert res["rounds"][1]["runs"]["ours"]["run"].endswith("compare/ours-r2")


def test_both_runs_of_a_round_get_the_same_minutes(tmp_path: Path) -> None:
    calls: list = []
    res = run_fake(tmp_path, calls, minutes=12.5, rounds=2)
    assert {(c["minutes"], c["threads"]) for c in calls} == {(12.5, 2)} and len(calls) == 4
    for r in res["rounds"]:
        runs = r["runs"]
        assert runs["ours"]["minutes"] == runs["opennmt"]["minutes"] == 12.5
        assert runs["ours"]["minutes_used"] == round((12.5 * 60 - 1) / 60, 2)
        assert len(runs["opennmt"]["loadavg_before"]) == len(runs["opennmt"]["loadavg_after"]) == 3


def test_medians_and_differences_in_the_written_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    res = run_fake(tmp_path, rounds=3)
    common.write_results("opennmt_compare", res, compare.compare_markdown(res), ensure_ascii=False)
    data = json.loads((tmp_path / "results" / "opennmt_compare.json").read_text())
    med = data["median"]
    assert med["ours"]["test_bleu"] == statistics.median(OURS_BLEU) == 31.0
    assert med["opennmt"]["test_bleu"] == statistics.median(PEER_BLEU) == 29.0
    diffs = [o - p for o, p in zip(OURS_BLEU, PEER_BLEU)]
    assert [r["differences"]["test"]["bleu"] for r in data["rounds"]] == diffs
    assert med["differences"]["test"]["bleu"] == statistics.median(diffs) == 1.0  # not 31 - 29
    long_diffs = [(o - 5) - (p - 10) for o, p in zip(OURS_BLEU, PEER_BLEU)]
    assert med["differences"]["long"]["chrf"] == statistics.median(long_diffs)
    assert med["ours"]["steps"] == 110 and med["opennmt"]["steps"] == 80
    assert med["opennmt"]["sents_per_s"] == round(80 * 200 / 1800, 2)
    md = (tmp_path / "results" / "opennmt_compare.md").read_text()
    medians = md.split("## Medians over 3 round(s)")[1]
    assert "| ours | 110 | 12.2 |" in medians and "| OpenNMT-py | 80 | 8.9 |" in medians
    assert "| ours − OpenNMT-py | | | | | | **+1.00** | **+1.00** | **+6.00** | **+6.00** |" in medians
    assert "## Round 2 (OpenNMT-py then ours)" in md and "**-1.00**" in md.split("## Round 3")[0]
    assert "Reproduce: `P compare`" in md and "SMOKE" not in md


@pytest.mark.parametrize("minutes, max_sentences, smoke", [(9.9, None, True), (10, None, False),
                                                             (30, 50, True), (30, None, False)])
def test_smoke_label(tmp_path: Path, minutes: float, max_sentences: int | None, smoke: bool) -> None:
    res = run_fake(tmp_path, minutes=minutes, rounds=1, max_sentences=max_sentences)
    assert res["smoke"] is smoke
    assert ("**SMOKE figures**" in compare.compare_markdown(res)) is smoke


def test_machine_line_holds_the_cpu_flags(tmp_path: Path) -> None:
    res = run_fake(tmp_path, rounds=1)
    assert res["machine"]["flags"] == MACHINE["flags"] and isinstance(res["machine"]["load_end"], float)
    line = next(x for x in compare.compare_markdown(res).splitlines() if x.startswith("Machine: "))
    assert "2 CPUs (Fake CPU 9000), flags avx2, avx512_vnni;" in line and "load average" in line


def test_machine_info_reads_this_cpu() -> None:
    from service.decoding.int8_form import reported_flags

    box = compare.machine_info()
    assert box["flags"] == reported_flags() and box["cores"] >= 1
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert box["cpu"] in cpuinfo.read_text()


def test_a_failing_peer_run_is_an_error_naming_the_run(tmp_path: Path) -> None:
    calls: list = []
    trainers = {"ours": FakeTrainer("ours", calls, [100, 120]),
                "opennmt": FakeTrainer("opennmt", calls, [80, 90], fail_round=2)}
    with pytest.raises(compare.CompareError, match=r"round 2: the OpenNMT-py run .*opennmt-r2 failed: .*boom"):
        compare.run_compare(make_plan(tmp_path, rounds=2), trainers=trainers, evaluate=fake_evaluate,
                            machine=lambda: dict(MACHINE))
    assert [(c["round"], c["who"]) for c in calls] == [(1, "ours"), (1, "opennmt"), (2, "opennmt")]


def test_a_run_without_its_counts_is_an_error(tmp_path: Path) -> None:
    trainers = {"ours": lambda run, **_: {"steps": 1, "checkpoint": "x"}, "opennmt": FakeTrainer("opennmt", [], [1])}
    with pytest.raises(compare.CompareError, match=r"round 1: the ours run .*ours-r1 reported no sentences"):
        compare.run_compare(make_plan(tmp_path, rounds=1), trainers=trainers, evaluate=fake_evaluate,
                            machine=lambda: dict(MACHINE))


@pytest.fixture
def wired(tmp_path: Path, monkeypatch) -> dict:
    """``main`` with the workers faked: trainers, evaluator, OpenNMT check, prepare, results dir."""
    calls: list = []
    prepared: list = []
    monkeypatch.setattr(compare, "our_run", FakeTrainer("ours", calls, [100, 120]))
    monkeypatch.setattr(compare, "peer_run", FakeTrainer("opennmt", calls, [80, 90]))
    monkeypatch.setattr(compare, "evaluate_runs", fake_evaluate)
    monkeypatch.setattr(compare, "need_onmt", lambda: None)
    monkeypatch.setattr(compare, "cmd_prepare", prepared.append)
    monkeypatch.setattr(compare, "machine_info", lambda: dict(MACHINE))
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    return {"calls": calls, "prepared": prepared, "results": tmp_path / "results"}


def test_the_compare_subcommand_takes_the_documented_flags(tmp_path: Path, wired: dict) -> None:
    argv = ["compare", str(tmp_path / "corpus-v2"), "--tokenizers", str(tmp_path / "tok"), "--minutes", "30",
            "--rounds", "2", "--threads", "2", "--ours-args=--dropout 0.3 --lr 0.002", "--max-sentences", "7",
            "--work", str(tmp_path / "work")]
    assert opennmt_compare.main(argv) == 0
    calls = wired["calls"]
    assert [(c["round"], c["who"]) for c in calls] == [(1, "ours"), (1, "opennmt"), (2, "opennmt"), (2, "ours")]
    assert all(c["minutes"] == 30 and c["threads"] == 2 for c in calls)
    assert {c["extra"] for c in calls if c["who"] == "ours"} == {("--dropout", "0.3", "--lr", "0.002")}
    assert {str(c["data"]) for c in calls if c["who"] == "opennmt"} == {str(tmp_path / "work" / "data")}
    assert [str(a.work) for a in wired["prepared"]] == [str(tmp_path / "work")]  # data was missing
    data = json.loads((wired["results"] / "opennmt_compare.json").read_text())
    assert data["smoke"] is True and data["plan"]["max_sentences"] == 7 and len(data["rounds"]) == 2
    reproduced = argv[:10] + ["--work", str(tmp_path / "work"), "--ours-args=--dropout 0.3 --lr 0.002",
                              "--max-sentences", "7"]
    assert shlex.split(data["command"])[2:] == reproduced
    assert "flags avx2, avx512_vnni" in (wired["results"] / "opennmt_compare.md").read_text()


def test_the_subcommand_reports_a_failed_run_and_writes_nothing(tmp_path: Path, wired: dict, monkeypatch) -> None:
    monkeypatch.setattr(compare, "peer_run", FakeTrainer("opennmt", wired["calls"], [80], fail_round=1))
    argv = ["compare", str(tmp_path / "c"), "--tokenizers", str(tmp_path / "t"), "--minutes", "3",
            "--work", str(tmp_path / "work")]
    with pytest.raises(SystemExit, match=r"compare: round 1: the OpenNMT-py run .*opennmt-r1 failed"):
        opennmt_compare.main(argv)
    assert not (wired["results"] / "opennmt_compare.json").exists()


def test_prepared_data_from_other_tokenizers_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(compare, "cmd_prepare", lambda args: pytest.fail("prepared again"))
    tok, data = tmp_path / "tok", tmp_path / "work" / "data"
    tok.mkdir()
    data.mkdir(parents=True)
    for name in ("source.model", "target.model"):
        (tok / name).write_bytes(name.encode())
    made = {name: common.sha256(tok / name) for name in ("source.model", "target.model")}
    (data / "prepare.json").write_text(json.dumps({"sha256": made}))
    args = type("Args", (), {"corpus": tmp_path / "c", "tokenizers": tok})
    compare.prepare_data(args, tmp_path / "work")  # the same models: kept
    (tok / "target.model").write_bytes(b"another model")
    with pytest.raises(SystemExit, match="made from other tokenizers .*target.model"):
        compare.prepare_data(args, tmp_path / "work")


def test_our_run_is_the_documented_nmt_train_command(tmp_path: Path, monkeypatch) -> None:
    """The command ``our_run`` builds goes through the real ``nmt train`` parser (training faked)."""
    from export import cli
    from export.train import training

    seen: dict = {}

    def fake_subprocess_run(cmd, **kwargs):
        seen["cmd"] = cmd
        run = Path(cmd[cmd.index("--output") + 1])
        (run / "best.pt").write_text("best")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(compare.subprocess, "run", fake_subprocess_run)
    monkeypatch.setattr(compare, "replay_our_run", lambda corpus, tok, last: {"steps": 3, "last": str(last)})
    stats = compare.our_run(tmp_path / "ours-r1", minutes=30, threads=2, corpus=tmp_path / "c",
                            tokenizers=tmp_path / "t", extra=("--dropout", "0.3"))
    assert stats["checkpoint"] == str(tmp_path / "ours-r1" / "best.pt")
    assert stats["last"] == str(tmp_path / "ours-r1" / "last.pt")
    cmd = seen["cmd"]
    assert Path(cmd[0]) == ROOT / ".venv" / "bin" / "nmt" and cmd[1] == "train"

    got: dict = {}
    monkeypatch.setattr(training, "train", lambda corpus, tok, out, **kw: got.update(kw, corpus=corpus) or out)
    assert cli.train_main(cmd[2:]) == 0
    cfg = got["config"]
    assert (cfg.minutes, cfg.max_steps, cfg.validate_steps, cfg.threads, cfg.init_uniform) == (30, 0, 200, 2, 0.1)
    assert got["model_config"] == {"attention": "bahdanau", "dropout": 0.3} and got["corpus"] == tmp_path / "c"


@pytest.mark.parametrize("form", [["--ours-args", "--dropout 0.3"], ["--ours-args=--dropout 0.3"]])
def test_ours_args_parse_in_both_spellings(form: list[str], monkeypatch) -> None:
    seen: list = []
    monkeypatch.setattr(compare, "cmd_compare", lambda args: seen.append(args) or 0)
    assert opennmt_compare.main(["compare", "c", "--tokenizers", "t", "--minutes", "30", *form]) == 0
    assert shlex.split(seen[0].ours_args) == ["--dropout", "0.3"] and seen[0].rounds == 1
