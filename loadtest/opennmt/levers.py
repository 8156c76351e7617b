"""``levers``: the recipe's levers one at a time against the baseline, at equal time (issue 30).

Every lever is a run of our trainer (``compare.our_run``: en-fr/3's recipe, from scratch) with a
few more ``nmt train`` words; the baseline is the same command without them. A run is given the
same wall time (``--minutes``), or the same number of updates (``--steps``: for levers that do not
change the updates per minute, so that other load on the machine cannot change the comparison).
Of each run the checkpoints a recipe could ship are scored alike (beam 5, ``evaluate``'s
``decode`` and ``scores``, the first ``--max-sentences`` of the test and long splits): ``best.pt``,
``last.pt``, ``ema.pt`` (``--ema-decay``) and the average of the last ``--average`` kept
checkpoints (``--keep-checkpoints``). Writes ``loadtest/results/<--results>.{json,md}``
(``opennmt_levers`` unless named).

The command can be run again: a lever whose run directory already holds a finished run of the same
``nmt train`` settings (``finished_run``) is not trained again, and a checkpoint already scored with
the same sentences is not scored again (``scores-<label>.json`` beside it). ``last`` is scored only
where it is not also ``best``.

Trainer, reuse check and scorer are injected (``run_levers``), so the orchestration is tested
without training.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Callable

from .common import log, work_dir, write_results

SPLITS = ("test", "long")
BEAM = 5


def parse_lever(text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=ARGS`` (``"lr2e-3=--lr 0.002 --warmup-steps 100"``) -> (name, argument words)."""
    name, sep, args = text.partition("=")
    if not sep or not name.strip() or not args.strip():
        raise SystemExit(f"levers: --lever takes NAME=ARGS (the words `nmt train` adds), got {text!r}")
    return name.strip(), tuple(shlex.split(args))


def candidates(run: Path, average: int, averager: Callable[[list[Path], Path], None],
               same: Callable[[Path, Path], bool] = lambda a, b: False) -> dict[str, Path]:
    """The checkpoints of a finished run a recipe could ship, by label (``last`` unless ``same``
    says it is ``best``'s weights)."""
    out = {"best": run / "best.pt"}
    if not same(run / "best.pt", run / "last.pt"):
        out["last"] = run / "last.pt"
    if (run / "ema.pt").exists():
        out["ema"] = run / "ema.pt"
    kept = sorted((run / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if average > 1 and len(kept) >= average:
        out[f"avg{average}"] = avg = run / f"avg{average}.pt"
        if not avg.exists() or avg.stat().st_mtime_ns < max(p.stat().st_mtime_ns for p in kept):
            averager(kept[-average:], avg)
    return out


def run_levers(levers: list[tuple[str, tuple[str, ...]]], *, base: tuple[str, ...], runs_dir: Path, average: int,
               train: Callable[..., dict], score: Callable[[Path], dict],
               averager: Callable[[list[Path], Path], None],
               reuse: Callable[[Path, tuple[str, ...]], dict | None] = lambda run, extra: None,
               same: Callable[[Path, Path], bool] = lambda a, b: False) -> list[dict]:
    """Every lever's run (or the finished one ``reuse`` finds) and the scores of its candidates;
    the baseline is ``levers[0]``."""
    rows = []
    for name, words in levers:
        run, extra = runs_dir / name, (*base, *words)
        stats = reuse(run, extra)
        if stats is None:
            stats = train(run, extra=extra)
        else:
            log(f"{name}: {run} holds a finished run of these settings; not trained again")
        for label, checkpoint in candidates(run, average, averager, same).items():
            rows.append({"lever": name, "args": list(words), "checkpoint": label,
                         "steps": stats["steps"], "sents_per_s": round(stats["sents_per_s"], 1),
                         "minutes_used": round(stats["train_s"] / 60, 2), "scores": score(checkpoint)})
            log(f"{name} {label}: " + ", ".join(f"{s} BLEU {v['bleu']}" for s, v in rows[-1]["scores"].items()))
    return rows


def levers_markdown(res: dict) -> str:
    rows = res["rows"]
    base = next(r for r in rows if r["lever"] == rows[0]["lever"] and r["checkpoint"] == "best")
    budget = f"{res['steps']} updates each" if res["steps"] else f"{res['minutes']:g} minutes of wall clock each"
    lines = ["# The recipe's levers, one at a time, at equal time", "",
             f"Corpus {res['corpus']}; {budget}, {res['threads']} threads; every run from scratch with "
             f"`compare`'s recipe for ours plus `{' '.join(res['base'])}` plus the lever's words. Beam {BEAM}, "
             f"the first {res['max_sentences']} sentences of each split, scored by `evaluate`'s code. "
             f"Machine: {res['machine']}; {res['date']}.", "",
             "| lever | `nmt train` words | checkpoint | updates | sentences/s | minutes |"
             + "".join(f" {s} BLEU | {s} chrF | Δ {s} BLEU |" for s in SPLITS),
             "|---" * (6 + 3 * len(SPLITS)) + "|"]
    for r in rows:
        lines.append(f"| {r['lever']} | `{' '.join(r['args'])}` | {r['checkpoint']} | {r['steps']} | "
                     f"{r['sents_per_s']} | {r['minutes_used']} |"
                     + "".join(f" {r['scores'][s]['bleu']} | {r['scores'][s]['chrf']} | "
                               f"{r['scores'][s]['bleu'] - base['scores'][s]['bleu']:+.2f} |" for s in SPLITS))
    lines += ["", "Δ: against the baseline's best.pt.", "", f"Reproduce: `{res['command']}`"]
    return "\n".join(lines) + "\n"


def finished_run(run: Path, words: list[str]) -> bool:
    """Whether ``run`` holds a finished run of exactly these ``nmt train`` words: its last.pt records
    the same training settings (a setting it predates counts as its default) and model config, and
    reached its step or time budget."""
    if not ((run / "last.pt").exists() and (run / "best.pt").exists()):
        return False
    from export.cli import train_parser, train_settings
    from export.train.checkpoint import load_checkpoint
    from export.train.training import TrainConfig

    model_config, config = train_settings(train_parser().parse_args(words))
    ckpt = load_checkpoint(run / "last.pt")
    if {**asdict(TrainConfig()), **ckpt.extra.get("train_config", {})} != asdict(config):
        return False
    if any(getattr(ckpt.config, k) != v for k, v in model_config.items()):
        return False
    state = ckpt.extra.get("train_state", {})
    return 0 < config.max_steps <= state.get("step", 0) or state.get("elapsed", 0) >= config.minutes * 60


def same_weights(a: Path, b: Path) -> bool:
    """Two checkpoints of one run saved at the same update (best.pt is last.pt's weights)."""
    from export.train.checkpoint import load_checkpoint

    return a.exists() and b.exists() and load_checkpoint(a).extra.get("train_state", {}).get("step") == \
        load_checkpoint(b).extra.get("train_state", {}).get("step")


def cached(score: Callable[[Path], dict], max_sentences: int) -> Callable[[Path], dict]:
    """``score``, remembered in ``<checkpoint dir>/scores-<stem>.json`` for the same file and sentences."""
    def scored(checkpoint: Path) -> dict:
        key = {"size": checkpoint.stat().st_size, "mtime_ns": checkpoint.stat().st_mtime_ns,
               "max_sentences": max_sentences, "beam": BEAM}
        memo = checkpoint.with_name(f"scores-{checkpoint.stem}.json")
        if memo.exists() and json.loads(memo.read_text()).get("key") == key:
            return json.loads(memo.read_text())["scores"]
        result = score(checkpoint)
        memo.write_text(json.dumps({"key": key, "scores": result}))
        return result
    return scored


def score_checkpoint(checkpoint: Path, *, corpus: Path, max_sentences: int, threads: int) -> dict:
    import torch

    from export.data.pairs import read_split
    from export.evaluate.evaluate import decode, letters, scores
    from export.train.checkpoint import load_checkpoint
    from service.text.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    ckpt = load_checkpoint(checkpoint)
    tok_dir = checkpoint.parent / f"{checkpoint.stem}-tokenizers"
    tok_dir.mkdir(exist_ok=True)
    for name, blob in ckpt.tokenizers.items():
        (tok_dir / name).write_bytes(blob)
    tok, model = Tokenizer(tok_dir / "source.model", tok_dir / "target.model"), ckpt.model()
    train_letters = {letters(p.src) for p in read_split(corpus / "train.jsonl")}
    out = {}
    for split in SPLITS:
        pairs = read_split(corpus / f"{split}.jsonl")[:max_sentences]
        decoded = decode(model, tok, [p.src_raw for p in pairs], beam_size=BEAM)
        out[split] = {k: v for k, v in scores(decoded, pairs, train_letters).items() if k in ("bleu", "chrf")}
    return out


def cmd_levers(args) -> int:
    from export.train.checkpoint import release

    from .compare import machine_info, our_run, our_words
    from .speed import replay_our_run

    levers = [("baseline", ())] + [parse_lever(t) for t in args.lever]
    base = tuple(shlex.split(args.base_args or ""))
    minutes = args.minutes if not args.steps else 600.0  # a step budget: the clock only guards
    if args.steps:
        base += ("--max-steps", str(args.steps))
    train = partial(our_run, minutes=minutes, threads=args.threads, corpus=args.corpus, tokenizers=args.tokenizers)
    score = cached(partial(score_checkpoint, corpus=args.corpus, max_sentences=args.max_sentences,
                           threads=args.threads), args.max_sentences)

    def reuse(run: Path, extra: tuple[str, ...]) -> dict | None:
        if not finished_run(run, our_words(run, minutes, args.threads, args.corpus, args.tokenizers, extra)):
            return None
        return replay_our_run(args.corpus, args.tokenizers, run / "last.pt")

    rows = run_levers(levers, base=base, runs_dir=work_dir(args.corpus, args.work) / "levers", average=args.average,
                      train=train, score=score, averager=lambda kept, out: release(kept[-1], out, average=kept[:-1]),
                      reuse=reuse, same=same_weights)
    box = machine_info()
    res = {"corpus": str(args.corpus), "minutes": args.minutes, "steps": args.steps, "threads": args.threads,
           "base": list(base), "max_sentences": args.max_sentences, "rows": rows,
           "machine": f"{box['cores']} CPUs ({box['cpu']}), flags {', '.join(box['flags']) or 'none'}",
           "date": time.strftime("%Y-%m-%d %H:%M"), "command": shlex.join(args.argv)}
    write_results(args.results, res, levers_markdown(res), ensure_ascii=False)
    return 0


def add_levers(sub) -> None:
    s = sub.add_parser("levers", help="the recipe's levers one at a time against the baseline, at equal time")
    s.add_argument("corpus", type=Path)
    s.add_argument("--work", type=Path, help="work directory (default build/opennmt-compare/<corpus name>)")
    s.add_argument("--tokenizers", type=Path, required=True)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--minutes", type=float, default=10.0, help="wall clock of every run")
    s.add_argument("--steps", type=int, default=0, help="updates of every run instead of minutes")
    s.add_argument("--lever", action="append", default=[], metavar="NAME=ARGS",
                   help='a lever: its name and the `nmt train` words it adds (repeatable), e.g. '
                        '--lever "rsqrt=--lr 0.002 --warmup-steps 100 --lr-schedule rsqrt"')
    s.add_argument("--base-args", help="words every run adds (e.g. --keep-checkpoints --ema-decay 0.995)")
    s.add_argument("--average", type=int, default=3, help="also score the average of the last N kept checkpoints")
    s.add_argument("--max-sentences", type=int, default=1500, help="first N sentences of each split")
    s.add_argument("--results", default="opennmt_levers",
                   help="name of the results files in loadtest/results (default opennmt_levers)")
    s.set_defaults(func=cmd_levers)
