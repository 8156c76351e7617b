"""Training: loss goes down, 20 pairs are memorised, the digit-reversal sanity task."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_SENTENCES, make_corpus
from export import tokenizers, train
from export.checkpoint import load_checkpoint
from export.corpus import read_split
from export.search import greedy
from export.train import collate
from service.text.tokenizer import Tokenizer

SMALL = {"emb_size": 32, "enc_hidden_size": 32, "dec_hidden_size": 48, "attn_size": 32,
         "out_size": 32, "dropout": 0.0}
TWENTY = (TINY_SENTENCES + [(f"Step {w}", f"Étape {w}") for w in ("one", "two", "three", "four", "five", "six")])[:20]


def _decode_all(ckpt_path: Path, tok: Tokenizer, sources: list[str]):
    model = load_checkpoint(ckpt_path).model()
    enc = [tok.encode(s) for s in sources]
    src, lengths, _, _ = collate([(e.ids, [tok.target.eos_id()]) for e in enc])
    return enc, greedy(model, src, lengths)


def test_overfits_twenty_pairs(tmp_path: Path) -> None:
    assert len(TWENTY) == 20
    corpus_dir = make_corpus(tmp_path / "c", TWENTY, TWENTY)
    tokenizers.train(corpus_dir, tmp_path / "tok", src_vocab_size=70, tgt_vocab_size=70)
    logs: list[str] = []
    best = train.train(corpus_dir, tmp_path / "tok", tmp_path / "run", model_config=SMALL,
                       config=train.TrainConfig(minutes=15, max_epochs=120, batch_tokens=400, lr=5e-3,
                                                label_smoothing=0.0, validate_minutes=1.0, threads=1),
                       log=logs.append)
    tok = Tokenizer(tmp_path / "tok" / "source.model", tmp_path / "tok" / "target.model")
    enc, hyps = _decode_all(best, tok, [s for s, _ in TWENTY])
    outputs = [tok.decode(h.tokens, e.placeholders) for e, h in zip(enc, hyps)]
    assert outputs == [t for _, t in TWENTY]  # placeholders restored exactly, too
    losses = [float(line.split("valid loss ")[1].split()[0]) for line in logs if "valid loss" in line]
    assert losses[-1] < 0.1  # from about ln(vocab) = 4.2 untrained


def test_resume_continues_from_checkpoint(tiny_corpus: Path, tiny_tokenizers: Path, tmp_path: Path) -> None:
    cfg = train.TrainConfig(minutes=5, max_epochs=2, batch_tokens=300, validate_minutes=0.0)
    run = tmp_path / "run"
    train.train(tiny_corpus, tiny_tokenizers, run, model_config=SMALL, config=cfg, log=lambda *_: None)
    first = load_checkpoint(run / "last.pt")
    steps = first.extra["train_state"]["step"]
    assert steps > 0
    cfg4 = train.TrainConfig(minutes=5, max_epochs=4, batch_tokens=300, validate_minutes=0.0)
    train.train(tiny_corpus, tiny_tokenizers, run, config=cfg4, resume=run / "last.pt", log=lambda *_: None)
    second = load_checkpoint(run / "last.pt")
    assert second.extra["train_state"]["epoch"] >= 3
    assert second.extra["train_state"]["step"] > steps
    assert second.config == first.config


def test_reversal_model_learns_the_anti_diagonal(reversal_checkpoint: Path, reversal_corpus: Path) -> None:
    """The sanity task: reverse digit strings; attention must follow the anti-diagonal."""
    tok_dir = reversal_corpus.parent / "reversal_tokenizers"
    tok = Tokenizer(tok_dir / "source.model", tok_dir / "target.model")
    test = read_split(reversal_corpus / "test.jsonl")
    train_sources = {p.src for p in read_split(reversal_corpus / "train.jsonl")}
    unseen = [p for p in test if p.src not in train_sources]
    assert len(unseen) > 200
    enc, hyps = _decode_all(reversal_checkpoint, tok, [p.src_raw for p in unseen])
    exact = sum(tok.decode(h.tokens, ()) == p.tgt_raw for p, h in zip(unseen, hyps)) / len(unseen)
    assert exact >= 0.98
    near = total = 0
    for e, h, p in zip(enc, hyps, unseen):
        src_word = _word_of_piece(e.pieces)
        tgt_word = _word_of_piece(tok.target_pieces(h.tokens))
        n_words = len(p.src_raw.split())
        if tok.decode(h.tokens, ()) != p.tgt_raw:
            continue
        for i, row in enumerate(h.attention[:-1]):  # the EOS step has no word
            argmax = int(torch.tensor(row).argmax())
            if argmax >= len(src_word):
                continue  # attended to EOS
            near += abs(src_word[argmax] - (n_words - 1 - tgt_word[i])) <= 1
            total += 1
    assert total > 0 and near / total >= 0.95


def _word_of_piece(pieces: list[str]) -> list[int]:
    """Word index of each SentencePiece piece (a new word starts with '▁')."""
    out, word = [], -1
    for piece in pieces:
        if piece.startswith("▁") or word < 0:
            word += 1
        out.append(word)
    return out


def test_empty_training_split_is_an_error(tmp_path: Path, tiny_tokenizers: Path) -> None:
    corpus_dir = make_corpus(tmp_path / "c", [], TINY_SENTENCES[:2])
    with pytest.raises(ValueError, match="train.jsonl: no usable training pairs"):
        train.train(corpus_dir, tiny_tokenizers, tmp_path / "run", config=train.TrainConfig(minutes=0.01))
