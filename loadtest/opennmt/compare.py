"""``compare``: both trainers for the same wall time on one machine, both models scored alike (issue 30).

``run_compare`` is the orchestration. Its trainers and evaluator are plain callables, so the
order, the budgets, the medians and the error reporting are tested without training anything:

- a trainer is ``train(run_dir, *, minutes, threads) -> stats``; the stats hold at least
  ``STATS_KEYS`` (as ``speed`` and ``train`` count them) and the ``checkpoint`` to evaluate;
- the evaluator is ``evaluate(ours_checkpoint, peer_checkpoint, out_dir) -> {split: row}``, a row as
  ``evaluate.evaluate_split`` returns it (``sentences``, ``ours`` and ``opennmt`` scores).

The real ones (``our_run``, ``peer_run``, ``evaluate_runs``) reuse ``speed``, ``train`` and
``evaluate``. Only the standard library is imported at module level (see ``__init__``).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from .common import OPENNMT, ROOT, is_smoke, log, need_onmt, sha256, work_dir, write_results
from .evaluate import Setting, evaluate_split, load_ours
from .prepare import cmd_prepare
from .report import LABELS, SYSTEMS, compare_markdown
from .speed import replay_our_run
from .train import onmt_continue, onmt_train

STATS_KEYS = ("steps", "sentences", "tgt_tokens", "train_s", "sents_per_s", "tgt_tokens_per_s", "checkpoint")
SPLITS = ("test", "long")
BEAM = 5
Trainer = Callable[..., dict]


class CompareError(RuntimeError):
    """A run or an evaluation of the comparison failed; the message names it."""


@dataclass(frozen=True)
class Plan:
    """What the comparison runs; saved whole in the result file."""

    corpus: Path
    tokenizers: Path
    work: Path  # runs under <work>/compare/
    minutes: float  # wall clock of every training run
    rounds: int
    threads: int
    ours_args: tuple[str, ...] = ()  # extra `nmt train` arguments (a recipe lever)
    max_sentences: int | None = None  # first N sentences of each split (smoke)
    command: str = ""  # the command line that reproduces the comparison
    continued: tuple[str, str] | None = None  # (ours, peer) runs trained on to ``minutes`` in all


def order_of(round_no: int) -> tuple[str, str]:
    """Ours first in odd rounds, the peer first in even ones."""
    return SYSTEMS if round_no % 2 else SYSTEMS[::-1]


def trained(who: str, train: Trainer, run: Path, plan: Plan, round_no: int) -> dict:
    """One training run with the load average around it; a failure is re-raised naming the run."""
    before = os.getloadavg()
    try:
        stats = dict(train(run, minutes=plan.minutes, threads=plan.threads))
    except (Exception, SystemExit) as e:  # SystemExit: the stages report their failures with it
        raise CompareError(f"round {round_no}: the {LABELS[who]} run {run} failed: {e}") from e
    missing = [k for k in STATS_KEYS if k not in stats]
    if missing:
        raise CompareError(f"round {round_no}: the {LABELS[who]} run {run} reported no {', '.join(missing)}")
    stats.update(run=str(run), minutes=plan.minutes, minutes_used=round(stats["train_s"] / 60, 2),
                 loadavg_before=[round(x, 2) for x in before],
                 loadavg_after=[round(x, 2) for x in os.getloadavg()])
    return stats


def compare_round(plan: Plan, round_no: int, trainers: dict[str, Trainer], evaluate: Callable) -> dict:
    runs_dir = plan.work / "compare"
    order = order_of(round_no)
    runs = {who: trained(who, trainers[who], runs_dir / f"{who}-r{round_no}", plan, round_no) for who in order}
    out_dir = runs_dir / f"eval-r{round_no}"
    try:
        splits = evaluate(Path(runs["ours"]["checkpoint"]), Path(runs["opennmt"]["checkpoint"]), out_dir)
    except (Exception, SystemExit) as e:
        raise CompareError(f"round {round_no}: evaluating {out_dir} failed: {e}") from e
    differences = {split: {k: round(row["ours"][k] - row["opennmt"][k], 2) for k in ("bleu", "chrf")}
                   for split, row in splits.items()}
    return {"round": round_no, "order": list(order), "runs": runs, "splits": splits, "differences": differences}


def medians(rounds: list[dict]) -> dict:
    """Medians over rounds of each system's figures, and of the per-round differences ours - peer."""
    def med(values) -> float:
        return round(statistics.median(values), 2)

    splits = [s for s in rounds[0]["splits"] if all(s in r["splits"] for r in rounds)]
    out: dict = {}
    for who in SYSTEMS:
        out[who] = {k: med(r["runs"][who][k] for r in rounds)
                    for k in ("steps", "sents_per_s", "tgt_tokens_per_s", "minutes_used")}
        out[who].update({f"{s}_{k}": med(r["splits"][s][who][k] for r in rounds)
                         for s in splits for k in ("bleu", "chrf")})
    out["differences"] = {s: {k: med(r["differences"][s][k] for r in rounds) for k in ("bleu", "chrf")}
                          for s in splits}
    return out


def run_compare(plan: Plan, *, trainers: dict[str, Trainer], evaluate: Callable, machine: Callable[[], dict]) -> dict:
    """Every round, then the medians; the result file's content."""
    load_start = round(os.getloadavg()[0], 2)
    rounds = [compare_round(plan, r, trainers, evaluate) for r in range(1, plan.rounds + 1)]
    box = dict(machine(), load_start=load_start, load_end=round(os.getloadavg()[0], 2))
    plan_record = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(plan).items()}
    return {"smoke": is_smoke(plan.minutes, plan.max_sentences), "plan": plan_record, "beam": BEAM,
            "opennmt_version": OPENNMT, "rounds": rounds, "median": medians(rounds), "machine": box,
            "command": plan.command, "date": time.strftime("%Y-%m-%d %H:%M")}


def our_words(run: Path, minutes: float, threads: int, corpus: Path, tokenizers: Path,
              extra: tuple[str, ...] = ()) -> list[str]:
    """The ``nmt train`` words of ``our_run``: en-fr/3's recipe, then ``extra`` (a later flag wins)."""
    return [str(corpus), "--tokenizers", str(tokenizers), "--output", str(run), "--attention", "bahdanau",
            "--max-steps", "0", "--minutes", str(minutes), "--validate-steps", "200", "--threads", str(threads),
            "--init-uniform", "0.1", *extra]


def our_run(run: Path, *, minutes: float, threads: int, corpus: Path, tokenizers: Path,
            extra: tuple[str, ...] = (), previous: Path | None = None) -> dict:
    """``nmt train`` with en-fr/3's recipe (plus ``extra``) for ``minutes``; counted as ``speed`` counts.
    With ``previous`` (a finished run of the same words), ``run`` starts as a copy of it and
    ``nmt train --resume`` trains on until ``minutes`` of training in all."""
    import shutil

    if run.exists():
        shutil.rmtree(run)
    if previous is not None:
        shutil.copytree(previous, run)
        extra = (*extra, "--resume", str(run / "last.pt"))
    else:
        run.mkdir(parents=True)
    cmd = [str(ROOT / ".venv" / "bin" / "nmt"), "train", *our_words(run, minutes, threads, corpus, tokenizers, extra)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log(f"our trainer for {minutes} min in {run}: {shlex.join(cmd)}")
    t0 = time.monotonic()
    with (run / "train.log").open("a") as logf:
        rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                            timeout=minutes * 60 + 900).returncode
    if rc != 0 or not (run / "best.pt").exists():
        tail = (run / "train.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"nmt train failed ({rc}); {run / 'train.log'} ends:\n{tail}")
    stats = replay_our_run(corpus, tokenizers, run / "last.pt")
    stats.update(process_s=round(time.monotonic() - t0, 1), checkpoint=str(run / "best.pt"), command=shlex.join(cmd))
    if previous is not None:
        stats["continued_from"] = str(previous)
    return stats


def continuable(previous: Path, *, threads: int, corpus: Path, tokenizers: Path, extra: tuple[str, ...]) -> None:
    """Refuses to continue ``previous`` unless it is a finished run of ``our_run`` with these words."""
    from export.train.checkpoint import load_checkpoint

    from .levers import finished_run

    if not (previous / "last.pt").exists():
        raise SystemExit(f"--continue-ours {previous}: no last.pt")
    minutes = load_checkpoint(previous / "last.pt").extra.get("train_config", {}).get("minutes")
    if minutes is None or not finished_run(previous, our_words(previous, minutes, threads, corpus, tokenizers, extra)):
        raise SystemExit(f"--continue-ours {previous}: not a finished run of our recipe with the words "
                         f"{shlex.join(extra) or '(none)'}; pass the --ours-args it was trained with")


def peer_run(run: Path, *, minutes: float, threads: int, data: Path, previous: Path | None = None) -> dict:
    """OpenNMT-py as ``train`` runs it (its default validation, save and report steps); with
    ``previous``, that run continued until ``minutes`` in all (``train.onmt_continue``)."""
    if previous is not None:
        return onmt_continue(data, previous, run, minutes=minutes, threads=threads, valid_steps=2000,
                             save_steps=1000, report_every=100)
    return onmt_train(data, run, minutes=minutes, threads=threads, valid_steps=2000, save_steps=1000,
                      report_every=100)


def evaluate_runs(ours: Path, peer: Path, out_dir: Path, *, corpus: Path, data: Path, threads: int,
                  max_sentences: int | None) -> dict:
    """Both checkpoints on the test and long splits, beam 5, by ``evaluate``'s own code (as ``cmd_evaluate``)."""
    import torch

    from export.data.pairs import read_split
    from export.evaluate.evaluate import letters
    from service.text.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    setting = Setting(tok=Tokenizer(data / "source.model", data / "target.model"), model=peer, out_dir=out_dir,
                      train_letters={letters(p.src) for p in read_split(corpus / "train.jsonl")},
                      ours=load_ours(ours, data, out_dir))
    args = SimpleNamespace(corpus=corpus, max_sentences=max_sentences, beam=BEAM, threads=threads, batch_size=32)
    return {split: row for split in SPLITS if (row := evaluate_split(setting, split, args)) is not None}


def machine_info() -> dict:
    """The CPU's model name (/proc/cpuinfo), the flags every benchmark names, the core count."""
    from service.decoding.int8_form import reported_flags

    cpu = "?"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "?")
    except OSError:
        pass
    return {"cpu": cpu, "flags": reported_flags(), "cores": os.cpu_count()}


def prepare_data(args, work: Path) -> None:
    """The peer's piece files, made with ``prepare`` when missing; refused if made from other tokenizers."""
    manifest = work / "data" / "prepare.json"
    if not manifest.exists():
        log(f"{manifest} missing: preparing the peer's data")
        cmd_prepare(SimpleNamespace(corpus=args.corpus, work=work, tokenizers=args.tokenizers))
        return
    made = json.loads(manifest.read_text())["sha256"]
    for name in ("source.model", "target.model"):
        if sha256(args.tokenizers / name) != made[name]:
            raise SystemExit(f"{manifest}: made from other tokenizers than {args.tokenizers} ({name}); "
                             "run `prepare` again or pass another --work")


def command_line(args) -> str:
    parts = [".venv/bin/python", "loadtest/opennmt_compare.py", "compare", str(args.corpus),
             "--tokenizers", str(args.tokenizers), "--minutes", f"{args.minutes:g}", "--rounds", str(args.rounds),
             "--threads", str(args.threads)]
    if args.work is not None:
        parts += ["--work", str(args.work)]
    if args.ours_args:
        parts.append(f"--ours-args={args.ours_args}")
    if args.max_sentences is not None:
        parts += ["--max-sentences", str(args.max_sentences)]
    if args.continue_ours is not None:
        parts += ["--continue-ours", str(args.continue_ours), "--continue-peer", str(args.continue_peer)]
    return shlex.join(parts)


def cmd_compare(args) -> int:
    if args.minutes <= 0 or args.rounds < 1:
        raise SystemExit(f"compare: --minutes must be > 0 and --rounds >= 1 (got {args.minutes}, {args.rounds})")
    work = work_dir(args.corpus, args.work)
    ours_args = tuple(shlex.split(args.ours_args or ""))
    continued = None
    if (args.continue_ours is None) != (args.continue_peer is None):
        raise SystemExit("compare: --continue-ours and --continue-peer go together")
    if args.continue_ours is not None:
        if args.rounds != 1:
            raise SystemExit(f"compare: continued runs make one round (got --rounds {args.rounds})")
        continuable(args.continue_ours, threads=args.threads, corpus=args.corpus, tokenizers=args.tokenizers,
                    extra=ours_args)
        if not (args.continue_peer / "stats.json").exists():
            raise SystemExit(f"--continue-peer {args.continue_peer}: no stats.json (not a `train` run)")
        continued = (str(args.continue_ours), str(args.continue_peer))
        work = work / f"continued-{args.minutes:g}m"  # the runs continued stay as they are
    need_onmt()  # before an hour of training, not after
    prepare_data(args, work_dir(args.corpus, args.work))
    plan = Plan(corpus=args.corpus, tokenizers=args.tokenizers, work=work, minutes=args.minutes,
                rounds=args.rounds, threads=args.threads, ours_args=ours_args,
                max_sentences=args.max_sentences, command=command_line(args), continued=continued)
    data = work_dir(args.corpus, args.work) / "data"
    trainers = {"ours": partial(our_run, corpus=plan.corpus, tokenizers=plan.tokenizers, extra=plan.ours_args,
                                previous=args.continue_ours),
                "opennmt": partial(peer_run, data=data, previous=args.continue_peer)}
    evaluate = partial(evaluate_runs, corpus=plan.corpus, data=data, threads=plan.threads,
                       max_sentences=plan.max_sentences)
    try:
        result = run_compare(plan, trainers=trainers, evaluate=evaluate, machine=machine_info)
    except CompareError as e:
        raise SystemExit(f"compare: {e}") from e
    name = "opennmt_compare" if continued is None else f"opennmt_compare_{args.minutes:g}min"
    write_results(name, result, compare_markdown(result), ensure_ascii=False)
    return 0
