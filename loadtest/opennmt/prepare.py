"""``setup`` (OpenNMT-py's own virtualenv) and ``prepare`` (our pieces, in OpenNMT's files)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .common import (CONSTRAINTS, MAX_LEN, ONMT_DEPS, ONMT_PYTHON, ONMT_SPECIALS, ONMT_VENV, OPENNMT, TORCH,
                     log, onmt_env, sha256, work_dir)


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


def write_pieces(tok, pairs: list, out: Path, split: str) -> int:
    """``<split>.src`` / ``.tgt``: one pair per line as our pieces, the pairs export/train/training.py's
    ``encode_pairs`` keeps (at most MAX_LEN pieces with EOS); returns how many were kept."""
    kept = 0
    with (out / f"{split}.src").open("w", encoding="utf-8") as fs, \
            (out / f"{split}.tgt").open("w", encoding="utf-8") as ft:
        for p in pairs:
            src = tok.source.encode(p.src) + [tok.special.eos]
            tgt = tok.encode_target(p.tgt)
            if len(src) <= MAX_LEN and len(tgt) <= MAX_LEN and len(src) > 1 and len(tgt) > 1:
                fs.write(" ".join(tok.source.id_to_piece(i) for i in src[:-1]) + "\n")
                ft.write(" ".join(tok.target.id_to_piece(i) for i in tgt[:-1]) + "\n")
                kept += 1
    return kept


def write_vocab(sp, path: Path, side: str) -> dict:
    """Every piece of a SentencePiece model but its specials, which OpenNMT adds itself."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i))]
    bad = [p for p in pieces if p in ONMT_SPECIALS or any(c.isspace() or c == "\uffe8" for c in p)]
    if bad:
        raise SystemExit(f"{side}: pieces OpenNMT cannot take as tokens: {bad[:10]}")
    path.write_text("".join(p + "\n" for p in pieces), encoding="utf-8")
    return {"ours": sp.get_piece_size(), "opennmt": len(pieces) + len(ONMT_SPECIALS)}


def cmd_prepare(args) -> int:
    from export.data.pairs import read_split
    from service.text.tokenizer import Tokenizer

    out = work_dir(args.corpus, args.work) / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("source.model", "target.model"):
        shutil.copyfile(args.tokenizers / name, out / name)
    tok = Tokenizer(out / "source.model", out / "target.model")
    counts = {}
    for split in ("train", "valid"):
        pairs = read_split(args.corpus / f"{split}.jsonl")
        kept = write_pieces(tok, pairs, out, split)
        counts[split] = {"pairs": len(pairs), "kept": kept}
        log(f"{split}: {kept} of {len(pairs)} pairs within {MAX_LEN} pieces")
    vocab_sizes = {side: write_vocab(sp, out / f"{side}.vocab", side)
                   for side, sp in (("src", tok.source), ("tgt", tok.target))}
    manifest = {"corpus": str(args.corpus), "tokenizers": str(args.tokenizers), "max_len": MAX_LEN,
                "splits": counts, "vocab": vocab_sizes,
                "sha256": {n: sha256(out / n) for n in ("source.model", "target.model")}}
    (out / "prepare.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {out} (vocab {vocab_sizes})")
    return 0
