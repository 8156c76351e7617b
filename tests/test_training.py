"""Training: loss goes down, 20 pairs are memorised, the digit-reversal sanity task."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_SENTENCES, make_corpus
from export.data import tokenizers
from export.data.pairs import read_split
from export.train import training as train
from export.train.checkpoint import load_checkpoint
from export.train.search import greedy
from export.train.training import collate
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


def test_step_budget_and_a_run_killed_and_resumed_is_the_same_run(tiny_corpus: Path, tiny_tokenizers: Path,
                                                                  tmp_path: Path) -> None:
    """A budget of updates stops at that update; a run stopped at a validation (a kill leaves the
    last.pt of its last validation) and resumed gives the same weights, bit for bit, as one never
    stopped: the same batches in the same order (the epoch in progress continues where it was) and
    the same dropout masks."""
    sizes = dict(SMALL, dropout=0.3)

    def run(name: str, steps: int, resume: bool = False) -> tuple[dict, list[str]]:
        logs: list[str] = []
        out = tmp_path / name
        train.train(tiny_corpus, tiny_tokenizers, out, model_config=None if resume else sizes,
                    config=train.TrainConfig(minutes=5, max_epochs=100, max_steps=steps, batch_tokens=300,
                                             validate_steps=3), resume=out / "last.pt" if resume else None,
                    log=logs.append)
        ckpt = load_checkpoint(out / "last.pt")
        return ckpt.weights | {"_state": ckpt.extra["train_state"]}, logs

    whole, logs = run("whole", 10)
    assert whole["_state"]["step"] == 10 and whole["_state"]["epoch"] >= 2  # crosses epochs
    assert [line.split()[1] for line in logs if line.startswith("step ")] == ["3", "6", "9", "10"]
    run("cut", 6)  # stopped at its validation of update 6, in the middle of an epoch
    resumed, _ = run("cut", 10, resume=True)
    assert resumed["_state"]["step"] == 10 and resumed["_state"]["epoch"] == whole["_state"]["epoch"]
    for name, tensor in whole.items():
        if name != "_state":
            assert torch.equal(tensor, resumed[name]), name


def _reversal_figures(checkpoint: Path, corpus: Path) -> tuple[float, float, dict[int, float]]:
    """(exact share, share of attention argmaxes on the anti-diagonal (within one word) of the
    exact ones, exact share by string length) on the unseen test strings."""
    tok_dir = corpus.parent / "reversal_tokenizers"
    tok = Tokenizer(tok_dir / "source.model", tok_dir / "target.model")
    test = read_split(corpus / "test.jsonl")
    train_sources = {p.src for p in read_split(corpus / "train.jsonl")}
    unseen = [p for p in test if p.src not in train_sources]
    assert len(unseen) > 200
    enc, hyps = _decode_all(checkpoint, tok, [p.src_raw for p in unseen])
    right = [tok.decode(h.tokens, ()) == p.tgt_raw for p, h in zip(unseen, hyps)]
    near = total = 0
    by_length: dict[int, list[bool]] = {}
    for e, h, p, ok in zip(enc, hyps, unseen, right):
        n_words = len(p.src_raw.split())
        by_length.setdefault(n_words, []).append(ok)
        if not ok:
            continue
        src_word = _word_of_piece(e.pieces)
        tgt_word = _word_of_piece(tok.target_pieces(h.tokens))
        for i, row in enumerate(h.attention[:-1]):  # the EOS step has no word
            argmax = int(torch.tensor(row).argmax())
            if argmax >= len(src_word):
                continue  # attended to EOS
            near += abs(src_word[argmax] - (n_words - 1 - tgt_word[i])) <= 1
            total += 1
    return (sum(right) / len(right), near / total if total else 0.0,
            {n: sum(v) / len(v) for n, v in sorted(by_length.items())})


@pytest.fixture(scope="module", params=["bahdanau", "luong-general", "luong-dot", "none"])
def reversal_of_kind(request: pytest.FixtureRequest, reversal_checkpoint: Path, reversal_corpus: Path
                     ) -> tuple[str, Path]:
    """The sanity task learnt by each kind (RNNsearch's is the shared fixture)."""
    from conftest import REVERSAL_MODEL, REVERSAL_TRAINING

    kind = request.param
    if kind == "bahdanau":
        return kind, reversal_checkpoint
    config = dict(REVERSAL_MODEL, attention=kind)
    if kind == "luong-dot":
        config["dec_hidden_size"] = 2 * config["enc_hidden_size"]  # h_t . h_j
    # the dot score with a 64-unit decoder stayed near 98 % exact; without attention 8 passes
    # show the same as 12
    settings = train.TrainConfig(**dict(REVERSAL_TRAINING, max_epochs=8 if kind == "none" else 12))
    tok_dir = reversal_corpus.parent / "reversal_tokenizers"  # made by reversal_checkpoint
    return kind, train.train(reversal_corpus, tok_dir, reversal_corpus.parent / f"reversal_run_{kind}",
                             model_config=config, config=settings, log=lambda *_: None)


def test_every_kind_learns_the_reversal_task(reversal_of_kind: tuple[str, Path], reversal_corpus: Path) -> None:
    """The sanity task: reverse digit strings; with attention, it must follow the anti-diagonal.
    RNNencdec (``none``) reads one fixed summary: it reverses short strings and fails long ones,
    the seeds' central result (figures in the README)."""
    kind, checkpoint = reversal_of_kind
    exact, near, by_length = _reversal_figures(checkpoint, reversal_corpus)
    print(f"{kind}: exact {exact:.3f}, anti-diagonal {near:.3f}, by length {by_length}")
    if kind == "none":
        short = np.mean([by_length[n] for n in by_length if n <= 5])
        long = np.mean([by_length[n] for n in by_length if n >= 10])
        assert short >= 0.9 and long <= short - 0.3, by_length
        assert near < 0.9  # its attention output is zeros: argmax 0, not the anti-diagonal
    else:
        assert exact >= 0.98, by_length
        assert near >= 0.95


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


def test_init_uniform_draws_a_new_models_weights_in_its_range(tiny_tokenizers: Path) -> None:
    tok = Tokenizer(tiny_tokenizers / "source.model", tiny_tokenizers / "target.model")
    default, *_ = train._start(tok, SMALL, train.TrainConfig(), None)
    uniform, *_ = train._start(tok, SMALL, train.TrainConfig(init_uniform=0.05), None)
    assert max(p.abs().max().item() for p in default.parameters()) > 0.5  # PyTorch's embeddings: N(0, 1)
    for p in uniform.parameters():
        assert p.abs().max().item() <= 0.05 and p.std().item() > 0.01  # every tensor drawn, biases too
