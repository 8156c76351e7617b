"""OpenNMT-py 3.5.1 RNN beside our trainer, on the same corpus, pieces and machine (issue 14).

Issue 14's acceptance: our trainer processes at least as many sentences per second as
OpenNMT-py at the same token budget, and the shipped default beats an OpenNMT-py RNN of
the same size trained for the same wall time (test split and long set, beam 5,
placeholders protected for both). This script is a measuring tool, not a project
dependency: OpenNMT-py lives in its own virtualenv, ``build/onmt-venv`` (build/ is
git-ignored), and everything else runs with the project's ``.venv``. Run it from the
repository root; on a shared machine put ``nice -n 19`` in front of every command.

Commands::

    P=".venv/bin/python loadtest/opennmt_compare.py"
    $P setup                                   # build/onmt-venv: torch 2.13.0 CPU + OpenNMT-py 3.5.1
    $P prepare build/corpus --tokenizers models/en-fr/1
    $P train build/corpus --minutes 60         # -> build/opennmt-compare/corpus/runs/onmt-60m/
    $P evaluate build/corpus --onmt build/opennmt-compare/corpus/runs/onmt-60m \\
        --ours models/en-fr/checkpoint-1.pt    # -> loadtest/results/opennmt_quality.{json,md}
    $P speed build/corpus --tokenizers models/en-fr/1 --minutes 3 --rounds 3
                                               # -> loadtest/results/opennmt_speed.md

``setup`` is the same as this shell snippet (pip must never change torch: any other torch
version than 2.13.0 pulls a multi-GB CUDA build; OpenNMT-py 3.5.1 asks for torch<2.3, so it
is installed with --no-deps and its light dependencies under a constraints file)::

    python3.11 -m venv build/onmt-venv
    echo torch==2.13.0 > build/onmt-constraints.txt
    build/onmt-venv/bin/pip install -c build/onmt-constraints.txt torch==2.13.0
    build/onmt-venv/bin/pip install --no-deps opennmt-py==3.5.1
    build/onmt-venv/bin/pip install -c build/onmt-constraints.txt numpy configargparse pyyaml \\
        sacrebleu six waitress flask rapidfuzz 'pyonmttok>=1.37,<2' sentencepiece pyahocorasick \\
        'ctranslate2>=4,<5' tensorboard spacy fasttext-wheel

OpenNMT-py 3.5.1 loads its checkpoints with ``torch.load`` without ``weights_only``, which
torch 2.13 refuses: every OpenNMT process gets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.

``prepare CORPUS --tokenizers DIR``
    Writes ``<work>/data/``: train/valid ``.src``/``.tgt`` files of SentencePiece pieces made
    with OUR models (source ids = ``tok.source.encode(src)``, target = ``tok.encode_target
    (tgt)``, as export/train.py's ``encode_pairs``, the same max_len filter of 100 pieces
    counting EOS), and ``src.vocab``/``tgt.vocab``: every piece of our models but the four
    specials, which OpenNMT adds itself (<unk> <blank> <s> </s>), so both vocabularies have
    exactly our sizes. ``<work>`` is ``build/opennmt-compare/<corpus dir name>``.

``train CORPUS --minutes M``
    OpenNMT-py trained for M minutes of wall clock. OpenNMT has no time limit, so the
    trainer runs in-process under a small wrapper (``_onmt-worker``, in the OpenNMT venv)
    that stops its batch iterator once the budget is spent; OpenNMT then saves its final
    checkpoint as at any end of training. The budget starts at the first batch (OpenNMT's
    reading of the first bucket is start-up, as our trainer's encoding of the corpus is), and
    it includes OpenNMT's validations, as ours includes its own. The wrapper counts the
    sentences and target tokens (EOS included, as ours) of every batch trained and writes
    ``stats.json`` beside ``train.log``, ``config.yaml`` and the checkpoints. For the
    acceptance, M is the training time of our checkpoint (``evaluate --ours`` prints it: its
    train_state's elapsed minutes).

    The model is ours in size (export/model.py ModelConfig defaults): brnn encoder, GRU,
    1 layer, 256 per direction (enc_hid_size 512), decoder 512, embeddings 256, global
    attention mlp (Bahdanau's additive), input feeding, dropout 0.2. Optimisation as ours
    (export/train.py TrainConfig): Adam (0.9, 0.999), lr 1e-3, token batches of 3000,
    loss normalised by target tokens, label smoothing 0.1, gradient norm clipped at 1.0.
    Learning rate: constant (decay_method none, learning_rate_decay 1.0, so OpenNMT's
    default halving from step 50000 never happens); ours halves it on a BLEU plateau (every
    5 minutes, patience 2), which only matters for runs of 20 minutes and more. Everything
    else is OpenNMT's default (uniform init 0.1, no source EOS, examples sorted by length in
    a bucket, batches shuffled), but the bucket is set to the corpus size, one epoch (the
    default, 262144 examples, holds 4-5 copies of a 57k-pair corpus and drops the copies that
    fall into one batch). CPU only, ``--threads`` (2) torch threads with
    OMP/MKL_NUM_THREADS set alike, ``num_workers 0`` (batches built in the training process,
    as ours: on 2 cores a loader process would take one from the model).

``speed CORPUS --tokenizers DIR --minutes M --rounds R``
    Both trainers for the same budget, alternating (ours first in odd rounds, OpenNMT first
    in even ones), from scratch, with no validation inside the budget. Ours runs as
    ``.venv/bin/nmt train`` (the project code untouched); its sentences and tokens are
    counted afterwards by replaying its batching (``make_batches`` with the run's seed and
    token budget, as recorded in last.pt) for the steps last.pt records, over the elapsed
    time it records (from after the corpus encoding to the last step). OpenNMT's come from
    the wrapper above. Writes the rounds and their medians to
    ``loadtest/results/opennmt_speed.md`` (and ``.json``).

``evaluate CORPUS --onmt RUN [--ours CHECKPOINT]``
    Translates the test split and ``long.jsonl`` (when the corpus has one) with
    ``onmt_translate`` (beam 5, length penalty avg: score / length as our beam search, CPU),
    sources protected and split by our tokenizer exactly as ``nmt evaluate`` does
    (``Tokenizer.encode(src_raw)``), the output pieces decoded by our target model and the
    placeholders restored by ``Tokenizer.decode``; scored by export/evaluate.py's
    ``scores`` (sacreBLEU, chrF, ... against tgt_raw). ``--ours`` decodes our checkpoint with
    export/evaluate.py's ``decode`` (beam 5) on the same sentences. Writes
    ``loadtest/results/opennmt_quality.json`` and ``.md``.

Figures from short budgets (under 10 minutes) or a ``--max-sentences`` subset are labelled
SMOKE in the result files: they prove the pipeline, they are not acceptance figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONMT_VENV = ROOT / "build" / "onmt-venv"
ONMT_PYTHON = ONMT_VENV / "bin" / "python"
CONSTRAINTS = ROOT / "build" / "onmt-constraints.txt"
RESULTS = ROOT / "loadtest" / "results"
WORK = ROOT / "build" / "opennmt-compare"
TORCH = "2.13.0"
OPENNMT = "3.5.1"
ONMT_DEPS = ["numpy", "configargparse", "pyyaml", "sacrebleu", "six", "waitress", "flask", "rapidfuzz",
             "pyonmttok>=1.37,<2", "sentencepiece", "pyahocorasick", "ctranslate2>=4,<5", "tensorboard",
             "spacy", "fasttext-wheel"]
ONMT_SPECIALS = ("<unk>", "<blank>", "<s>", "</s>")
MAX_LEN = 100  # export/train.py TrainConfig.max_len (pieces, EOS counted)
SMOKE_MINUTES = 10.0

# Our ModelConfig / TrainConfig defaults, in OpenNMT's words.
MODEL_OPTIONS = {
    "encoder_type": "brnn", "decoder_type": "rnn", "rnn_type": "GRU",
    "enc_layers": 1, "dec_layers": 1, "enc_hid_size": 512, "dec_hid_size": 512,
    "word_vec_size": 256, "global_attention": "mlp", "input_feed": 1, "bridge": False,
    "dropout": [0.2], "model_dtype": "fp32",
}
OPTIM_OPTIONS = {
    "optim": "adam", "adam_beta1": 0.9, "adam_beta2": 0.999, "learning_rate": 0.001,
    "decay_method": "none", "learning_rate_decay": 1.0, "max_grad_norm": 1.0,
    "label_smoothing": 0.1, "batch_type": "tokens", "batch_size": 3000, "valid_batch_size": 3000,
    "normalization": "tokens", "accum_count": [1], "seed": 1, "num_workers": 0,
    "world_size": 1, "train_steps": 100_000_000,
}


# ---------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[opennmt_compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def work_dir(corpus: Path, work: Path | None) -> Path:
    return work if work is not None else WORK / corpus.resolve().name


def onmt_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def need_onmt() -> None:
    if not ONMT_PYTHON.exists():
        raise SystemExit(f"{ONMT_PYTHON} missing: run `{sys.argv[0]} setup` first")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def yaml_value(v) -> str:
    """JSON scalars and flat lists are valid YAML."""
    return json.dumps(v)


def write_config(path: Path, options: dict, data: dict) -> None:
    lines = [f"{k}: {yaml_value(v)}" for k, v in options.items()]
    lines.append("data:")
    for name, d in data.items():
        lines.append(f"    {name}:")
        lines += [f"        {k}: {yaml_value(v)}" for k, v in d.items()]
    path.write_text("\n".join(lines) + "\n")


def is_smoke(minutes: float | None = None, max_sentences: int | None = None) -> bool:
    return (minutes is not None and minutes < SMOKE_MINUTES) or max_sentences is not None


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), load average {os.getloadavg()[0]:.2f} at the end"


# ---------------------------------------------------------------- setup


def cmd_setup(args) -> int:
    pip = [str(ONMT_VENV / "bin" / "pip"), "install", "--disable-pip-version-check"]
    if not ONMT_PYTHON.exists():
        log(f"creating {ONMT_VENV}")
        subprocess.run([args.python, "-m", "venv", str(ONMT_VENV)], check=True)
    CONSTRAINTS.write_text(f"torch=={TORCH}\n")
    constrained = pip + ["-c", str(CONSTRAINTS)]
    subprocess.run(constrained + [f"torch=={TORCH}"], check=True)
    subprocess.run(pip + ["--no-deps", f"opennmt-py=={OPENNMT}"], check=True)
    subprocess.run(constrained + ONMT_DEPS, check=True)
    probe = ("import torch, onmt, onmt.bin.train, onmt.bin.translate; "
             "print(torch.__version__, onmt.__version__)")
    out = subprocess.run([str(ONMT_PYTHON), "-c", probe], env=onmt_env(2), check=True,
                         capture_output=True, text=True).stdout.strip()
    log(f"onmt venv: torch {out.split()[0]}, OpenNMT-py {out.split()[1]}")
    if not out.startswith(TORCH):
        raise SystemExit(f"torch in {ONMT_VENV} is {out.split()[0]}, not {TORCH}")
    return 0


# ---------------------------------------------------------------- prepare


def cmd_prepare(args) -> int:
    from export.corpus import read_split
    from service.text.tokenizer import Tokenizer

    out = work_dir(args.corpus, args.work) / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("source.model", "target.model"):
        shutil.copyfile(args.tokenizers / name, out / name)
    tok = Tokenizer(out / "source.model", out / "target.model")
    counts = {}
    for split in ("train", "valid"):
        pairs = read_split(args.corpus / f"{split}.jsonl")
        kept = 0
        with (out / f"{split}.src").open("w", encoding="utf-8") as fs, \
                (out / f"{split}.tgt").open("w", encoding="utf-8") as ft:
            for p in pairs:  # export/train.py encode_pairs
                src = tok.source.encode(p.src) + [tok.special.eos]
                tgt = tok.encode_target(p.tgt)
                if len(src) <= MAX_LEN and len(tgt) <= MAX_LEN and len(src) > 1 and len(tgt) > 1:
                    fs.write(" ".join(tok.source.id_to_piece(i) for i in src[:-1]) + "\n")
                    ft.write(" ".join(tok.target.id_to_piece(i) for i in tgt[:-1]) + "\n")
                    kept += 1
        counts[split] = {"pairs": len(pairs), "kept": kept}
        log(f"{split}: {kept} of {len(pairs)} pairs within {MAX_LEN} pieces")
    vocab_sizes = {}
    for side, sp in (("src", tok.source), ("tgt", tok.target)):
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                  if not (sp.is_control(i) or sp.is_unknown(i))]
        bad = [p for p in pieces if p in ONMT_SPECIALS or any(c.isspace() or c == "\uffe8" for c in p)]
        if bad:
            raise SystemExit(f"{side}: pieces OpenNMT cannot take as tokens: {bad[:10]}")
        (out / f"{side}.vocab").write_text("".join(p + "\n" for p in pieces), encoding="utf-8")
        vocab_sizes[side] = {"ours": sp.get_piece_size(), "opennmt": len(pieces) + len(ONMT_SPECIALS)}
    manifest = {"corpus": str(args.corpus), "tokenizers": str(args.tokenizers), "max_len": MAX_LEN,
                "splits": counts, "vocab": vocab_sizes,
                "sha256": {n: sha256(out / n) for n in ("source.model", "target.model")}}
    (out / "prepare.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {out} (vocab {vocab_sizes})")
    return 0


# ---------------------------------------------------------------- train


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
    datasets = {"corpus_1": {"path_src": str(data / "train.src"), "path_tgt": str(data / "train.tgt")},
                "valid": {"path_src": str(data / "valid.src"), "path_tgt": str(data / "valid.tgt")}}
    write_config(run / "config.yaml", options, datasets)
    cmd = [str(ONMT_PYTHON), str(Path(__file__).resolve()), "_onmt-worker", "--config", str(run / "config.yaml"),
           "--minutes", str(minutes), "--threads", str(threads), "--stats", str(run / "stats.json")]
    log(f"OpenNMT training for {minutes} min in {run}")
    t0 = time.monotonic()
    with (run / "train.log").open("w") as logf:
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
    stats = json.loads((run / "stats.json").read_text())
    stats["process_s"] = round(time.monotonic() - t0, 1)
    stats["loadavg_end"] = round(os.getloadavg()[0], 2)
    stats["checkpoint"] = str(last_checkpoint(run)) if not speed_only else None
    (run / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    log(f"OpenNMT: {stats['steps']} steps, {stats['sents_per_s']:.1f} sents/s, "
        f"{stats['tgt_tokens_per_s']:.0f} tgt tok/s over {stats['train_s']:.0f} s")
    return stats


def last_checkpoint(run: Path) -> Path:
    ckpts = sorted(run.glob("model_step_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not ckpts:
        raise SystemExit(f"{run}: no model_step_*.pt checkpoint")
    return ckpts[-1]


def cmd_train(args) -> int:
    work = work_dir(args.corpus, args.work)
    run = args.run or work / "runs" / f"onmt-{args.minutes:g}m"
    stats = onmt_train(work / "data", run, minutes=args.minutes, threads=args.threads,
                       valid_steps=args.valid_steps, save_steps=args.save_steps, report_every=args.report_every)
    print(json.dumps(stats, indent=1))
    return 0


def cmd_onmt_worker(args) -> int:
    """Runs in the OpenNMT venv: onmt_train in-process, its batch iterator under a clock."""
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch

    torch.set_num_threads(args.threads)
    import onmt.trainer
    from onmt.bin.train import main as onmt_main

    budget = args.minutes * 60
    original = onmt.trainer.Trainer.train
    stats: dict = {"budget_s": budget, "threads": torch.get_num_threads(), "torch": torch.__version__}

    def write() -> None:
        Path(args.stats).write_text(json.dumps(stats, indent=1) + "\n")

    def train(self, train_iter, train_steps, **kwargs):
        entered = time.monotonic()
        pad = self.train_loss.padding_idx
        stats["parameters"] = sum(p.numel() for p in self.model.parameters())

        def clocked():
            first, sents, tokens = None, 0, 0
            for steps, (batch, bucket) in enumerate(train_iter, 1):
                if first is None:
                    first = time.monotonic()
                    stats["startup_s"] = round(first - entered, 2)
                yield batch, bucket
                now = time.monotonic()  # the batch is trained (and any validation after it done)
                sents += int(batch["tgt"].shape[0])
                tokens += int(batch["tgt"][:, 1:, 0].ne(pad).sum())  # EOS counted, BOS not
                if steps % 50 == 0 or now - first >= budget:
                    stats.update(steps=steps, sentences=sents, tgt_tokens=tokens, train_s=now - first,
                                 sents_per_s=sents / (now - first), tgt_tokens_per_s=tokens / (now - first))
                    write()
                if now - first >= budget:
                    return

        result = original(self, clocked(), train_steps, **kwargs)
        stats["saved_s"] = round(time.monotonic() - entered, 2)
        write()
        return result

    onmt.trainer.Trainer.train = train
    sys.argv = ["onmt_train", "-config", args.config]
    onmt_main()
    return 0


# ---------------------------------------------------------------- ours


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
    """Sentences and target tokens of the steps a run of export/train.py made: its batches
    are deterministic (seed, token budget and max_len from the checkpoint)."""
    import random

    from export.checkpoint import load_checkpoint
    from export.corpus import read_split
    from export.train import encode_pairs, make_batches
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


# ---------------------------------------------------------------- speed


def cmd_speed(args) -> int:
    work = work_dir(args.corpus, args.work)
    data = work / "data"
    rounds = []
    for r in range(1, args.rounds + 1):
        order = ("ours", "opennmt") if r % 2 else ("opennmt", "ours")
        row = {"round": r, "order": " then ".join(order)}
        for who in order:
            if who == "ours":
                row["ours"] = our_train(args.corpus, args.tokenizers, work / "speed" / f"ours-r{r}",
                                        minutes=args.minutes, threads=args.threads)
            else:
                row["opennmt"] = onmt_train(data, work / "speed" / f"onmt-r{r}", minutes=args.minutes,
                                            threads=args.threads, valid_steps=0, save_steps=0,
                                            report_every=50, speed_only=True)
        if not args.keep:
            for path in (work / "speed").glob(f"*-r{r}/*.pt"):
                path.unlink()
        rounds.append(row)
    med = {who: {k: statistics.median(r[who][k] for r in rounds) for k in ("sents_per_s", "tgt_tokens_per_s")}
           for who in ("ours", "opennmt")}
    smoke = is_smoke(args.minutes)
    result = {"smoke": smoke, "corpus": str(args.corpus), "tokenizers": str(args.tokenizers),
              "minutes": args.minutes, "rounds": rounds, "median": med, "threads": args.threads,
              "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "opennmt_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "opennmt_speed.md").write_text(speed_markdown(result))
    print(speed_markdown(result))
    return 0


def speed_markdown(res: dict) -> str:
    lines = ["# Training speed: our trainer beside OpenNMT-py " + OPENNMT, ""]
    if res["smoke"]:
        lines += [(f"**SMOKE figures** ({res['minutes']:g} min per run): they show the measurement works; "
                   f"issue 14's acceptance needs runs of {SMOKE_MINUTES:g} minutes and more."), ""]
    lines += [(f"Corpus {res['corpus']}, tokenizers {res['tokenizers']}; {res['minutes']:g} min of wall clock per "
              f"run, {len(res['rounds'])} round(s), alternating; token batches of 3000, {res['threads']} torch "
              f"threads, CPU; {res['machine']}; {res['date']}. Sentences and target tokens (EOS counted) of "
              "the batches trained, over the training time (after start-up: corpus encoding for ours, the "
              "first bucket for OpenNMT); no validation inside the budget. Sents/step tells how full each "
              "system packs its 3000-token batches. A load average over the CPU count means other processes "
              "shared the CPUs: such rounds do not compare the trainers."), "",
              ("| round | order | ours sents/s | OpenNMT sents/s | ours tgt tok/s | OpenNMT tgt tok/s "
               "| ours steps (sents/step) | OpenNMT steps (sents/step) | load avg after ours / OpenNMT "
               "| ours/OpenNMT (sents/s) |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rounds"]:
        o, n = r["ours"], r["opennmt"]
        lines.append(f"| {r['round']} | {r['order']} | {o['sents_per_s']:.1f} | {n['sents_per_s']:.1f} | "
                     f"{o['tgt_tokens_per_s']:.0f} | {n['tgt_tokens_per_s']:.0f} | "
                     f"{o['steps']} ({o['sentences'] / o['steps']:.0f}) | "
                     f"{n['steps']} ({n['sentences'] / n['steps']:.0f}) "
                     f"| {o.get('loadavg_end', '?')} / {n.get('loadavg_end', '?')} "
                     f"| {o['sents_per_s'] / n['sents_per_s']:.2f} |")
    m = res["median"]
    lines.append(f"| **median** | | **{m['ours']['sents_per_s']:.1f}** | **{m['opennmt']['sents_per_s']:.1f}** | "
                 f"**{m['ours']['tgt_tokens_per_s']:.0f}** | **{m['opennmt']['tgt_tokens_per_s']:.0f}** | | | | "
                 f"**{m['ours']['sents_per_s'] / m['opennmt']['sents_per_s']:.2f}** |")
    first = res["rounds"][0]
    lines += ["", f"Parameters: ours {first['ours']['parameters']:,}, OpenNMT {first['opennmt']['parameters']:,}.",
              "", "Made by `loadtest/opennmt_compare.py speed`."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- evaluate


def onmt_translate(model: Path, src: Path, out: Path, *, beam: int, threads: int, batch_size: int) -> float:
    need_onmt()
    code = (f"import sys, torch; torch.set_num_threads({threads}); from onmt.bin.translate import main; "
            "sys.argv = ['onmt_translate'] + sys.argv[1:]; main()")
    cmd = [str(ONMT_PYTHON), "-c", code, "-model", str(model), "-src", str(src), "-output", str(out),
           "-beam_size", str(beam), "-n_best", "1", "-gpu", "-1", "-batch_size", str(batch_size),
           "-batch_type", "sents", "-length_penalty", "avg", "-max_length", "250"]
    t0 = time.perf_counter()
    with out.with_suffix(".log").open("w") as logf:
        rc = subprocess.run(cmd, env=onmt_env(threads), stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                            check=False).returncode
    if rc != 0:
        tail = out.with_suffix(".log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"onmt_translate failed ({rc}):\n{tail}")
    return time.perf_counter() - t0


def cmd_evaluate(args) -> int:
    import torch

    from export.checkpoint import load_checkpoint
    from export.corpus import read_split
    from export.evaluate import Decoded, decode, letters, scores
    from service.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    work = work_dir(args.corpus, args.work)
    data = work / "data"
    tok = Tokenizer(data / "source.model", data / "target.model")
    run = args.onmt if args.onmt.is_dir() else args.onmt.parent
    model = last_checkpoint(args.onmt) if args.onmt.is_dir() else args.onmt
    run_stats = json.loads((run / "stats.json").read_text()) if (run / "stats.json").exists() else {}
    out_dir = work / "eval" / run.name
    out_dir.mkdir(parents=True, exist_ok=True)
    train_letters = {letters(p.src) for p in read_split(args.corpus / "train.jsonl")}

    ours = None
    if args.ours is not None:
        ckpt = load_checkpoint(args.ours)
        ours_dir = out_dir / "ours-tokenizers"
        ours_dir.mkdir(exist_ok=True)
        for name, blob in ckpt.tokenizers.items():
            (ours_dir / name).write_bytes(blob)
        same = all(sha256(ours_dir / n) == sha256(data / n) for n in ("source.model", "target.model"))
        if not same:
            log("warning: our checkpoint's SentencePiece models are not the ones OpenNMT was given")
        ours = {"checkpoint": str(args.ours), "model": ckpt.model(),
                "tok": Tokenizer(ours_dir / "source.model", ours_dir / "target.model"),
                "same_tokenizers": same, "train_state": ckpt.extra.get("train_state", {})}
        ours["parameters"] = ours["model"].num_parameters()

    splits = {}
    for split in args.splits:
        path = args.corpus / f"{split}.jsonl"
        if not path.exists():
            log(f"{path} absent: skipped")
            continue
        pairs = read_split(path)[:args.max_sentences]
        encoded = [tok.encode(p.src_raw) for p in pairs]  # as export/evaluate.py decode()
        src = out_dir / f"{split}.src"
        src.write_text("".join(" ".join(e.pieces[:-1]) + "\n" for e in encoded), encoding="utf-8")
        hyp = out_dir / f"{split}.onmt.pieces"
        log(f"{split}: onmt_translate of {len(pairs)} sentences (beam {args.beam})")
        seconds = onmt_translate(model, src, hyp, beam=args.beam, threads=args.threads, batch_size=args.batch_size)
        lines = hyp.read_text(encoding="utf-8").split("\n")[:len(pairs)]
        if len(lines) != len(pairs):
            raise SystemExit(f"{hyp}: {len(lines)} lines for {len(pairs)} sources")
        texts, normalized = [], []
        for line, e in zip(lines, encoded):
            ids = [tok.target.piece_to_id(p) for p in line.split(" ") if p]
            texts.append(tok.decode(ids, e.placeholders))
            normalized.append(tok.target.decode(ids))
        (out_dir / f"{split}.onmt.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        row = {"sentences": len(pairs),
               "opennmt": scores(Decoded(f"beam{args.beam}", texts, normalized, seconds), pairs, train_letters)}
        log(f"{split} OpenNMT: BLEU {row['opennmt']['bleu']} chrF {row['opennmt']['chrf']}")
        if ours is not None:
            d = decode(ours["model"], ours["tok"], [p.src_raw for p in pairs], beam_size=args.beam)
            (out_dir / f"{split}.ours.txt").write_text("\n".join(d.texts) + "\n", encoding="utf-8")
            row["ours"] = scores(d, pairs, train_letters)
            log(f"{split} ours: BLEU {row['ours']['bleu']} chrF {row['ours']['chrf']}")
        splits[split] = row

    result = {"smoke": is_smoke(run_stats.get("budget_s", 0) / 60 if run_stats else None, args.max_sentences),
              "corpus": str(args.corpus), "beam": args.beam, "max_sentences": args.max_sentences,
              "opennmt": {"checkpoint": str(model), "version": OPENNMT, "stats": run_stats,
                          "model_options": MODEL_OPTIONS, "optim_options": OPTIM_OPTIONS},
              "ours": None if ours is None else {k: ours[k] for k in ("checkpoint", "parameters", "same_tokenizers",
                                                                     "train_state")},
              "splits": splits, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "opennmt_quality.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    (RESULTS / "opennmt_quality.md").write_text(quality_markdown(result))
    print(quality_markdown(result))
    return 0


def quality_markdown(res: dict) -> str:
    st = res["opennmt"]["stats"]
    lines = ["# Translation quality: our model beside an OpenNMT-py " + OPENNMT + " RNN", ""]
    if res["smoke"]:
        lines += [("**SMOKE figures**: a short OpenNMT training and/or a subset of sentences; they show the "
                   "pipeline works, they are not issue 14's acceptance figures."), ""]
    train_min = st.get("train_s", 0) / 60
    lines += [(f"Corpus {res['corpus']}, beam {res['beam']}, placeholders protected for both (our tokenizer) "
               "and restored as `nmt evaluate` does; sacreBLEU and chrF against the catalog translations "
               "(tgt_raw), scored by export/evaluate.py `scores`."), "",
              (f"OpenNMT: `{res['opennmt']['checkpoint']}`, {st.get('parameters', 0):,} parameters, "
               f"{st.get('steps', '?')} steps, {train_min:.1f} min of training "
               f"({st.get('sents_per_s', 0):.1f} sents/s).")]
    if res["ours"]:
        o = res["ours"]
        ts = o["train_state"]
        lines.append(f"Ours: `{o['checkpoint']}`, {o['parameters']:,} parameters, {ts.get('step', '?')} steps, "
                     f"{ts.get('elapsed', 0) / 60:.1f} min of training"
                     f"{'' if o['same_tokenizers'] else ' (WARNING: other SentencePiece models)'}.")
        ours_min = ts.get("elapsed", 0) / 60
        if abs(ours_min - train_min) > 0.1 * max(ours_min, train_min):
            lines.append(f"**Not the same wall time** ({train_min:.1f} against {ours_min:.1f} min): this table "
                         "does not decide the acceptance.")
    lines += ["", ("| split | sentences | system | BLEU | chrF | BLEU w/o placeholders | BLEU unseen "
                   "| BLEU normalized | placeholders kept | seconds |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for split, row in res["splits"].items():
        for who, label in (("ours", "ours"), ("opennmt", "OpenNMT-py")):
            if who in row:
                r = row[who]
                lines.append(f"| {split} | {row['sentences']} | {label} | {r['bleu']} | {r['chrf']} | "
                             f"{r['bleu_without_placeholders']} | {r['bleu_unseen']} | {r['bleu_normalized']} | "
                             f"{r['placeholders_kept']:.2%} | {r['seconds']} |")
    lines += ["", "Made by `loadtest/opennmt_compare.py evaluate`."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("setup", help="build/onmt-venv with torch 2.13.0 CPU and OpenNMT-py 3.5.1")
    s.add_argument("--python", default="python3.11")
    s.set_defaults(func=cmd_setup)

    def corpus_args(s, tokenizers: bool = False):
        s.add_argument("corpus", type=Path, help="corpus directory (train/valid/test.jsonl, maybe long.jsonl)")
        s.add_argument("--work", type=Path, help="work directory (default build/opennmt-compare/<corpus name>)")
        if tokenizers:
            s.add_argument("--tokenizers", type=Path, required=True, help="directory with source.model, target.model")
        s.add_argument("--threads", type=int, default=2)

    s = sub.add_parser("prepare", help="piece files and vocabularies from our SentencePiece models")
    corpus_args(s, tokenizers=True)
    s.set_defaults(func=cmd_prepare)

    s = sub.add_parser("train", help="OpenNMT-py RNN of our size for a wall-clock budget")
    corpus_args(s)
    s.add_argument("--minutes", type=float, required=True)
    s.add_argument("--run", type=Path, help="run directory (default <work>/runs/onmt-<minutes>m)")
    s.add_argument("--valid-steps", type=int, default=2000)
    s.add_argument("--save-steps", type=int, default=1000)
    s.add_argument("--report-every", type=int, default=100)
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("speed", help="both trainers, same budget, alternating; median sents/s")
    corpus_args(s, tokenizers=True)
    s.add_argument("--minutes", type=float, default=3.0)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--keep", action="store_true", help="keep the runs' checkpoints")
    s.set_defaults(func=cmd_speed)

    s = sub.add_parser("evaluate", help="test split (and long set) with beam 5, both systems")
    corpus_args(s)
    s.add_argument("--onmt", type=Path, required=True, help="OpenNMT run directory (its last checkpoint) or .pt")
    s.add_argument("--ours", type=Path, help="our checkpoint (.pt) for the side-by-side table")
    s.add_argument("--splits", nargs="+", default=["test", "long"])
    s.add_argument("--beam", type=int, default=5)
    s.add_argument("--batch-size", type=int, default=32, help="onmt_translate sentences per batch")
    s.add_argument("--max-sentences", type=int, help="first N sentences of each split (smoke)")
    s.set_defaults(func=cmd_evaluate)

    s = sub.add_parser("_onmt-worker", help="internal: onmt_train under the clock (run by train, in build/onmt-venv)")
    s.add_argument("--config", required=True)
    s.add_argument("--minutes", type=float, required=True)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--stats", required=True)
    s.set_defaults(func=cmd_onmt_worker)

    args = p.parse_args(argv)
    if args.command != "_onmt-worker" and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
