"""``train``: OpenNMT-py under a wall-clock budget, and the worker that holds the clock.

The worker (``cmd_onmt_worker``) runs inside OpenNMT-py's virtualenv: this module imports
only the standard library and ``.common`` at module level.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import (ENTRY, MAX_LEN, MODEL_OPTIONS, OPTIM_OPTIONS, ONMT_PYTHON, ROOT, last_checkpoint, log,
                     need_onmt, onmt_env, work_dir, write_config)


def onmt_options(data: Path, run: Path, *, train_lines: int, valid_steps: int, save_steps: int,
                 report_every: int, speed_only: bool) -> dict:
    """OpenNMT-py's options: our model and recipe (``common``), this run's files and schedule."""
    options = dict(MODEL_OPTIONS, **OPTIM_OPTIONS)
    options.update(
        src_vocab=str(data / "src.vocab"), tgt_vocab=str(data / "tgt.vocab"),
        src_vocab_size=100_000, tgt_vocab_size=100_000, vocab_size_multiple=1,
        src_words_min_frequency=0, tgt_words_min_frequency=0,
        src_seq_length=MAX_LEN + 10, tgt_seq_length=MAX_LEN + 10,
        save_model=str(run / "model"), save_checkpoint_steps=10**9 if speed_only else save_steps,
        keep_checkpoint=2, valid_steps=10**9 if speed_only else valid_steps,
        report_every=report_every, log_file=str(run / "onmt.log"), overwrite=True,
        # one bucket = one pass over the corpus: OpenNMT's default (262144 examples) would fill each
        # bucket with 4-5 copies of a small corpus, and drop the copies that meet in one batch
        bucket_size=train_lines, bucket_size_init=-1, bucket_size_increment=0)
    return options


def run_worker(run: Path, *, minutes: float, threads: int, skip: int = 0) -> None:
    """The clocked worker in OpenNMT-py's virtualenv; its output in ``run/train.log``."""
    cmd = [str(ONMT_PYTHON), str(ENTRY), "_onmt-worker", "--config", str(run / "config.yaml"),
           "--minutes", str(minutes), "--threads", str(threads), "--stats", str(run / "stats.json"),
           "--skip-batches", str(skip)]
    with (run / "train.log").open("a") as logf:
        proc = subprocess.Popen(cmd, env=onmt_env(threads), stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            rc = proc.wait(timeout=minutes * 60 + 900)  # start-up, last batch, final save
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(30)
            rc = "timeout"
    if rc != 0 or not (run / "stats.json").exists():
        tail = (run / "train.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"OpenNMT training failed ({rc}); {run / 'train.log'} ends:\n{tail}")


def onmt_train(data: Path, run: Path, *, minutes: float, threads: int, valid_steps: int,
               save_steps: int, report_every: int, speed_only: bool = False) -> dict:
    """One OpenNMT training in ``run``; returns its stats.json."""
    need_onmt()
    if not (data / "train.src").exists():
        raise SystemExit(f"{data}/train.src missing: run `prepare` first")
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    with (data / "train.src").open("rb") as f:
        train_lines = sum(1 for _ in f)
    options = onmt_options(data, run, train_lines=train_lines, valid_steps=valid_steps, save_steps=save_steps,
                           report_every=report_every, speed_only=speed_only)
    datasets = {"corpus_1": {"path_src": str(data / "train.src"), "path_tgt": str(data / "train.tgt")},
                "valid": {"path_src": str(data / "valid.src"), "path_tgt": str(data / "valid.tgt")}}
    write_config(run / "config.yaml", options, datasets)
    log(f"OpenNMT training for {minutes} min in {run}")
    t0 = time.monotonic()
    run_worker(run, minutes=minutes, threads=threads)
    stats = json.loads((run / "stats.json").read_text())
    stats["process_s"] = round(time.monotonic() - t0, 1)
    stats["loadavg_end"] = round(os.getloadavg()[0], 2)
    stats["checkpoint"] = str(last_checkpoint(run)) if not speed_only else None
    (run / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    log(f"OpenNMT: {stats['steps']} steps, {stats['sents_per_s']:.1f} sents/s, "
        f"{stats['tgt_tokens_per_s']:.0f} tgt tok/s over {stats['train_s']:.0f} s")
    return stats


def onmt_continue(data: Path, previous: Path, run: Path, *, minutes: float, threads: int, valid_steps: int,
                  save_steps: int, report_every: int) -> dict:
    """OpenNMT's run ``previous`` (a ``train`` run) continued in ``run`` until ``minutes`` of training in
    all: a copy of it, trained on from its last checkpoint with its optimizer (``train_from``,
    ``reset_optim none``). OpenNMT does not resume its data where it stopped; its batches are
    deterministic (seed 1), so the worker replays and skips the batches the previous run trained
    (as ``nmt train --resume`` does) and checks that they hold the sentences and target tokens it
    counted. Returns the stats of the whole run (both parts), with the part's own under ``part``."""
    need_onmt()
    before = json.loads((previous / "stats.json").read_text())
    left = minutes - before["train_s"] / 60
    if left <= 0:
        raise SystemExit(f"{previous} already trained {before['train_s'] / 60:.2f} min (asked for {minutes})")
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(previous, run)
    with (data / "train.src").open("rb") as f:
        train_lines = sum(1 for _ in f)
    options = onmt_options(data, run, train_lines=train_lines, valid_steps=valid_steps, save_steps=save_steps,
                           report_every=report_every, speed_only=False)
    options.update(train_from=str(last_checkpoint(run)), reset_optim="none")
    datasets = {"corpus_1": {"path_src": str(data / "train.src"), "path_tgt": str(data / "train.tgt")},
                "valid": {"path_src": str(data / "valid.src"), "path_tgt": str(data / "valid.tgt")}}
    write_config(run / "config.yaml", options, datasets)
    (run / "stats.json").unlink()
    log(f"OpenNMT: {previous} continued for {left:.2f} min in {run} (skipping its {before['steps']} batches)")
    t0 = time.monotonic()
    run_worker(run, minutes=left, threads=threads, skip=before["steps"])
    part = json.loads((run / "stats.json").read_text())
    replayed = (part.get("skipped_batches"), part.get("skipped_sentences"), part.get("skipped_tgt_tokens"))
    if replayed != (before["steps"], before["sentences"], before["tgt_tokens"]):
        raise SystemExit(f"OpenNMT's batches replayed in {run} are not the ones {previous} trained: "
                         f"(batches, sentences, target tokens) {replayed} against "
                         f"{(before['steps'], before['sentences'], before['tgt_tokens'])}")
    stats = merged_stats(before, part)
    stats.update(process_s=round(time.monotonic() - t0, 1), loadavg_end=round(os.getloadavg()[0], 2),
                 checkpoint=str(last_checkpoint(run)), continued_from=str(previous))
    (run / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    log(f"OpenNMT: {stats['steps']} steps in all, {stats['sents_per_s']:.1f} sents/s over {stats['train_s']:.0f} s")
    return stats


def merged_stats(before: dict, part: dict) -> dict:
    """The counts of a run trained in two parts, as one run's (``part``: the second part's own)."""
    out = {k: before[k] + part[k] for k in ("steps", "sentences", "tgt_tokens", "train_s")}
    out.update(sents_per_s=out["sentences"] / out["train_s"], tgt_tokens_per_s=out["tgt_tokens"] / out["train_s"],
               budget_s=before["budget_s"] + part["budget_s"], threads=part["threads"], torch=part["torch"],
               parameters=part.get("parameters"), part=part)
    return out


def cmd_train(args) -> int:
    work = work_dir(args.corpus, args.work)
    run = args.run or work / "runs" / f"onmt-{args.minutes:g}m"
    stats = onmt_train(work / "data", run, minutes=args.minutes, threads=args.threads,
                       valid_steps=args.valid_steps, save_steps=args.save_steps, report_every=args.report_every)
    print(json.dumps(stats, indent=1))
    return 0


def clocked_train(original, stats: dict, budget: float, write, skip: int = 0):
    """OpenNMT's ``Trainer.train`` with its batch iterator stopped once ``budget`` s are spent,
    counting the sentences and target tokens of every batch trained into ``stats``. The first
    ``skip`` batches are read and counted (``skipped_*``) but not trained, and not timed: a run
    continued from a checkpoint (``onmt_continue``)."""

    def train(self, train_iter, train_steps, **kwargs):
        entered = time.monotonic()
        pad = self.train_loss.padding_idx
        stats["parameters"] = sum(p.numel() for p in self.model.parameters())

        def clocked():
            first, sents, tokens = None, 0, 0
            batches = iter(train_iter)
            if skip:
                stats.update(skipped_batches=0, skipped_sentences=0, skipped_tgt_tokens=0)
                for batch, _ in batches:
                    stats["skipped_batches"] += 1
                    stats["skipped_sentences"] += int(batch["tgt"].shape[0])
                    stats["skipped_tgt_tokens"] += int(batch["tgt"][:, 1:, 0].ne(pad).sum())
                    if stats["skipped_batches"] == skip:
                        break
                write()
            for steps, (batch, bucket) in enumerate(batches, 1):
                if first is None:
                    first = time.monotonic()
                    stats["startup_s"] = round(first - entered, 2)
                yield batch, bucket
                now = time.monotonic()  # the batch is trained (and any validation after it done)
                sents += int(batch["tgt"].shape[0])
                tokens += int(batch["tgt"][:, 1:, 0].ne(pad).sum())  # EOS counted, BOS not
                stats.update(steps=steps, sentences=sents, tgt_tokens=tokens, train_s=now - first,
                             sents_per_s=sents / max(now - first, 1e-9), tgt_tokens_per_s=tokens / max(now - first, 1e-9))
                if steps % 50 == 0 or now - first >= budget:
                    write()
                if now - first >= budget:
                    return

        result = original(self, clocked(), train_steps, **kwargs)
        stats["saved_s"] = round(time.monotonic() - entered, 2)
        write()
        return result

    return train


def cmd_onmt_worker(args) -> int:
    """Runs in the OpenNMT venv: onmt_train in-process, its batch iterator under a clock."""
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch

    torch.set_num_threads(args.threads)
    import onmt.trainer
    from onmt.bin.train import main as onmt_main

    budget = args.minutes * 60
    stats: dict = {"budget_s": budget, "threads": torch.get_num_threads(), "torch": torch.__version__}

    def write() -> None:
        Path(args.stats).write_text(json.dumps(stats, indent=1) + "\n")

    onmt.trainer.Trainer.train = clocked_train(onmt.trainer.Trainer.train, stats, budget, write,
                                               skip=args.skip_batches)
    sys.argv = ["onmt_train", "-config", args.config]
    onmt_main()
    return 0
