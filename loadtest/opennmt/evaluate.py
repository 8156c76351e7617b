"""``evaluate``: OpenNMT-py's output (and ours) on the test split and the long set, scored alike."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .common import (MODEL_OPTIONS, ONMT_PYTHON, OPENNMT, OPTIM_OPTIONS, ROOT, is_smoke, last_checkpoint, log,
                     machine, need_onmt, onmt_env, sha256, work_dir, write_results)
from .report import quality_markdown


@dataclass
class Setting:
    """What every split is scored with."""

    tok: object  # service.text.tokenizer.Tokenizer of the pieces OpenNMT was trained on
    model: Path  # OpenNMT checkpoint
    out_dir: Path
    train_letters: set
    ours: dict | None  # our checkpoint, its model and tokenizer (``load_ours``)


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


def load_ours(checkpoint: Path, data: Path, out_dir: Path) -> dict:
    """Our checkpoint with its own SentencePiece models (warned about if not OpenNMT's)."""
    from export.train.checkpoint import load_checkpoint
    from service.text.tokenizer import Tokenizer

    ckpt = load_checkpoint(checkpoint)
    ours_dir = out_dir / "ours-tokenizers"
    ours_dir.mkdir(exist_ok=True)
    for name, blob in ckpt.tokenizers.items():
        (ours_dir / name).write_bytes(blob)
    same = all(sha256(ours_dir / n) == sha256(data / n) for n in ("source.model", "target.model"))
    if not same:
        log("warning: our checkpoint's SentencePiece models are not the ones OpenNMT was given")
    ours = {"checkpoint": str(checkpoint), "model": ckpt.model(),
            "tok": Tokenizer(ours_dir / "source.model", ours_dir / "target.model"),
            "same_tokenizers": same, "train_state": ckpt.extra.get("train_state", {})}
    ours["parameters"] = ours["model"].num_parameters()
    return ours


def onmt_texts(setting: Setting, pairs: list, split: str, args) -> tuple[list[str], list[str], float]:
    """OpenNMT's translations of ``pairs``: sources protected and split by our tokenizer as
    ``nmt evaluate`` does, output pieces decoded and placeholders restored by it too."""
    tok, out_dir = setting.tok, setting.out_dir
    encoded = [tok.encode(p.src_raw) for p in pairs]  # as export/evaluate/evaluate.py decode()
    src = out_dir / f"{split}.src"
    src.write_text("".join(" ".join(e.pieces[:-1]) + "\n" for e in encoded), encoding="utf-8")
    hyp = out_dir / f"{split}.onmt.pieces"
    log(f"{split}: onmt_translate of {len(pairs)} sentences (beam {args.beam})")
    seconds = onmt_translate(setting.model, src, hyp, beam=args.beam, threads=args.threads,
                             batch_size=args.batch_size)
    lines = hyp.read_text(encoding="utf-8").split("\n")[:len(pairs)]
    if len(lines) != len(pairs):
        raise SystemExit(f"{hyp}: {len(lines)} lines for {len(pairs)} sources")
    texts, normalized = [], []
    for line, e in zip(lines, encoded):
        ids = [tok.target.piece_to_id(p) for p in line.split(" ") if p]
        texts.append(tok.decode(ids, e.placeholders))
        normalized.append(tok.target.decode(ids))
    return texts, normalized, seconds


def evaluate_split(setting: Setting, split: str, args) -> dict | None:
    """One split's scores for OpenNMT (and ours); None when the corpus has no such split."""
    from export.data.pairs import read_split
    from export.evaluate.evaluate import Decoded, decode, scores, unknown_runs

    path = args.corpus / f"{split}.jsonl"
    if not path.exists():
        log(f"{path} absent: skipped")
        return None
    pairs = read_split(path)[:args.max_sentences]
    texts, normalized, seconds = onmt_texts(setting, pairs, split, args)
    (setting.out_dir / f"{split}.onmt.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    decoded = Decoded(f"beam{args.beam}", texts, normalized, seconds,
                      unknown=tuple(unknown_runs(setting.tok, p.src_raw) for p in pairs))
    row = {"sentences": len(pairs), "opennmt": scores(decoded, pairs, setting.train_letters)}
    log(f"{split} OpenNMT: BLEU {row['opennmt']['bleu']} chrF {row['opennmt']['chrf']}")
    if setting.ours is not None:
        ours = setting.ours
        d = decode(ours["model"], ours["tok"], [p.src_raw for p in pairs], beam_size=args.beam)
        (setting.out_dir / f"{split}.ours.txt").write_text("\n".join(d.texts) + "\n", encoding="utf-8")
        row["ours"] = scores(d, pairs, setting.train_letters)
        log(f"{split} ours: BLEU {row['ours']['bleu']} chrF {row['ours']['chrf']}")
    return row


def cmd_evaluate(args) -> int:
    import torch

    from export.data.pairs import read_split
    from export.evaluate.evaluate import letters
    from service.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    data = work_dir(args.corpus, args.work) / "data"
    run = args.onmt if args.onmt.is_dir() else args.onmt.parent
    model = last_checkpoint(args.onmt) if args.onmt.is_dir() else args.onmt
    run_stats = json.loads((run / "stats.json").read_text()) if (run / "stats.json").exists() else {}
    out_dir = work_dir(args.corpus, args.work) / "eval" / run.name
    out_dir.mkdir(parents=True, exist_ok=True)
    setting = Setting(tok=Tokenizer(data / "source.model", data / "target.model"), model=model, out_dir=out_dir,
                      train_letters={letters(p.src) for p in read_split(args.corpus / "train.jsonl")},
                      ours=None if args.ours is None else load_ours(args.ours, data, out_dir))
    splits = {split: row for split in args.splits if (row := evaluate_split(setting, split, args)) is not None}
    ours = setting.ours
    result = {"smoke": is_smoke(run_stats.get("budget_s", 0) / 60 if run_stats else None, args.max_sentences),
              "corpus": str(args.corpus), "beam": args.beam, "max_sentences": args.max_sentences,
              "opennmt": {"checkpoint": str(model), "version": OPENNMT, "stats": run_stats,
                          "model_options": MODEL_OPTIONS, "optim_options": OPTIM_OPTIONS},
              "ours": None if ours is None else {k: ours[k] for k in ("checkpoint", "parameters", "same_tokenizers",
                                                                     "train_state")},
              "splits": splits, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    write_results("opennmt_quality", result, quality_markdown(result), ensure_ascii=False)
    return 0
