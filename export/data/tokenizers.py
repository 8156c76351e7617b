"""Train the source and target SentencePiece models on the train split."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from export.data.pairs import read_split
from service.text import placeholders
from service.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def train_one(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    """One unigram model; reserved placeholder tokens are user-defined symbols."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        user_defined_symbols=placeholders.reserved_tokens(),
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        hard_vocab_limit=False,  # tiny test corpora cannot fill a large vocabulary
        num_threads=2,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def train(corpus_dir: Path, out_dir: Path, *, src_vocab_size: int = 8000,
          tgt_vocab_size: int = 8000) -> tuple[Path, Path]:
    """source.model and target.model in ``out_dir`` from ``corpus_dir/train.jsonl``."""
    pairs = read_split(corpus_dir / "train.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = train_one([p.src for p in pairs], out_dir / "source", src_vocab_size)
    tgt = train_one([p.tgt for p in pairs], out_dir / "target", tgt_vocab_size)
    return src, tgt
