"""``speed``: both trainers for the same budget, alternating; ours counted by replaying its batches."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from .common import ROOT, is_smoke, log, machine, work_dir, write_results
from .report import speed_markdown
from .train import onmt_train


def our_train(corpus: Path, tokenizers: Path, run: Path, *, minutes: float, threads: int) -> dict:
    """``nmt train`` for ``minutes``, no validation inside the budget; counts replayed from last.pt."""
    if run.exists():
        shutil.rmtree(run)
    nmt = ROOT / ".venv" / "bin" / "nmt"
    cmd = [str(nmt), "train", str(corpus), "--tokenizers", str(tokenizers), "--output", str(run),
           "--minutes", str(minutes), "--validate-minutes", "1000000", "--threads", str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log(f"our trainer for {minutes} min in {run}")
    run.mkdir(parents=True)
    t0 = time.monotonic()
    with (run / "train.log").open("w") as logf:
        rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                            timeout=minutes * 60 + 900).returncode
    if rc != 0:
        raise SystemExit(f"nmt train failed ({rc}); see {run / 'train.log'}")
    stats = replay_our_run(corpus, tokenizers, run / "last.pt")
    stats["process_s"] = round(time.monotonic() - t0, 1)
    stats["loadavg_end"] = round(os.getloadavg()[0], 2)
    log(f"ours: {stats['steps']} steps, {stats['sents_per_s']:.1f} sents/s, "
        f"{stats['tgt_tokens_per_s']:.0f} tgt tok/s over {stats['train_s']:.0f} s")
    return stats


def replay_our_run(corpus: Path, tokenizers: Path, last: Path) -> dict:
    """Sentences and target tokens of the steps a run of export/train/training.py made: its batches
    are deterministic (seed, token budget and max_len from the checkpoint)."""
    import random

    from export.train.checkpoint import load_checkpoint
    from export.data.pairs import read_split
    from export.train.training import encode_pairs, make_batches
    from service.text.tokenizer import Tokenizer

    ckpt = load_checkpoint(last)
    state, cfg = ckpt.extra["train_state"], ckpt.extra["train_config"]
    tok = Tokenizer(tokenizers / "source.model", tokenizers / "target.model")
    data = encode_pairs(read_split(corpus / "train.jsonl"), tok, cfg["max_len"])
    rng = random.Random(cfg["seed"])  # a fresh run: Random(seed + epoch 0)
    left, sents, tokens = state["step"], 0, 0
    while left > 0:
        for idx in make_batches(data, cfg["batch_tokens"], rng):
            sents += len(idx)
            tokens += sum(len(data[i][1]) for i in idx)
            left -= 1
            if left == 0:
                break
    elapsed = state["elapsed"]
    return {"steps": state["step"], "epochs_done": state["epoch"], "sentences": sents, "tgt_tokens": tokens,
            "train_s": elapsed, "sents_per_s": sents / elapsed, "tgt_tokens_per_s": tokens / elapsed,
            "parameters": ckpt.model().num_parameters(), "threads": cfg["threads"]}


def speed_round(args, work: Path, r: int) -> dict:
    """Round ``r``: ours first in odd rounds, OpenNMT first in even ones."""
    order = ("ours", "opennmt") if r % 2 else ("opennmt", "ours")
    row = {"round": r, "order": " then ".join(order)}
    for who in order:
        if who == "ours":
            row["ours"] = our_train(args.corpus, args.tokenizers, work / "speed" / f"ours-r{r}",
                                    minutes=args.minutes, threads=args.threads)
        else:
            row["opennmt"] = onmt_train(work / "data", work / "speed" / f"onmt-r{r}", minutes=args.minutes,
                                        threads=args.threads, valid_steps=0, save_steps=0,
                                        report_every=50, speed_only=True)
    if not args.keep:
        for path in (work / "speed").glob(f"*-r{r}/*.pt"):
            path.unlink()
    return row


def cmd_speed(args) -> int:
    work = work_dir(args.corpus, args.work)
    rounds = [speed_round(args, work, r) for r in range(1, args.rounds + 1)]
    med = {who: {k: statistics.median(r[who][k] for r in rounds) for k in ("sents_per_s", "tgt_tokens_per_s")}
           for who in ("ours", "opennmt")}
    result = {"smoke": is_smoke(args.minutes), "corpus": str(args.corpus), "tokenizers": str(args.tokenizers),
              "minutes": args.minutes, "rounds": rounds, "median": med, "threads": args.threads,
              "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    write_results("opennmt_speed", result, speed_markdown(result))
    return 0
