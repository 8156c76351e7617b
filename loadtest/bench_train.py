"""Training throughput of ``nmt train``'s update, before and after, on the same sentences.

    python loadtest/bench_train.py --corpus build/corpus-v2 --tokenizers models/en-fr/1 \
        [--attention bahdanau ...] [--rounds 5] [--sentences 1200]

Each round draws ``--sentences`` random training examples, and every way
trains one optimizer step per batch of them (``--batch-tokens`` padded
tokens), in alternating order:

- ``before``: the trainer of en-fr/1. Batches grouped by source length
  (about 130 sentences of 3,000 tokens: the longest target fills the budget),
  teacher forcing over the whole padded (rows x steps) grid
  (``RNNSearch.forward``) and the loss with ``ignore_index``: decoder steps and
  the output layer run on padding too (43 % of the positions);
- ``real only``: the same batches, through ``RNNSearch.token_logits`` (rows
  longest target first, each leaving the recurrence after its last token, the
  output layer on real positions only);
- ``after``: the trainer now: ``token_logits`` on batches grouped by
  ``export.train.padded_length`` (what the budget counts: about 210 sentences).

Reports the median sentences/s and target tokens/s of the rounds (the same
sentences each way) and writes ``loadtest/results/train_speed.md``.
Validation is not included (the trainer validates every
``--validate-minutes``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from export.data.pairs import read_split
from export.train.model import RNNSearch
from export.train.training import TrainConfig, collate, encode_pairs, make_batches, pack_batches
from service.models.config import ModelConfig
from service.text.tokenizer import PAD_ID, Tokenizer

RESULTS = Path(__file__).parent / "results" / "train_speed.md"


def padded_loss(model: RNNSearch, batch) -> tuple[torch.Tensor, int]:
    src, lengths, tgt_in, tgt_out = batch
    logits, _ = model(src, lengths, tgt_in)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID,
                           label_smoothing=0.1, reduction="sum")
    return loss, int((tgt_out != PAD_ID).sum())


def real_loss(model: RNNSearch, batch) -> tuple[torch.Tensor, int]:
    logits, targets = model.token_logits(*batch)
    return F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="sum"), len(targets)


def source_batches(data: list, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """The batching of en-fr/1's trainer: grouped by source length (with noise)."""
    order = sorted(range(len(data)), key=lambda i: (len(data[i][0]) + rng.random() * 2, len(data[i][1])))
    return pack_batches(data, order, batch_tokens)


WAYS = {"before": (source_batches, "padded"), "real only": (source_batches, "real"),
        "after": (make_batches, "real")}


def run(model: RNNSearch, opt: torch.optim.Optimizer, batches: list, loss_fn) -> tuple[float, int, int]:
    """Seconds, sentences and target tokens of one optimizer step per batch."""
    start, sentences, tokens = time.perf_counter(), 0, 0
    for batch in batches:
        loss, n = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sentences += batch[0].shape[0]
        tokens += n
    return time.perf_counter() - start, sentences, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--tokenizers", type=Path, required=True)
    p.add_argument("--attention", action="append", help="kinds to measure (default: bahdanau)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sentences", type=int, default=1200, help="training examples per round (each way)")
    p.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok = Tokenizer(args.tokenizers / "source.model", args.tokenizers / "target.model")
    data = encode_pairs(read_split(args.corpus / "train.jsonl"), tok, TrainConfig.max_len)
    rng = random.Random(1)
    losses = {"padded": padded_loss, "real": real_loss}
    lines = [f"Training throughput, {args.threads} threads, batches of {args.batch_tokens} padded tokens "
             f"from `{args.corpus}` (`python loadtest/bench_train.py`, {args.rounds} rounds of the same "
             f"{args.sentences} random sentences each way, alternating order, medians):", "",
             "| attention | way | sentences/batch | sentences/s | target tokens/s | ratio |",
             "|---|---|---|---|---|---|"]
    for kind in args.attention or ["bahdanau"]:
        torch.manual_seed(0)
        model = RNNSearch(ModelConfig(src_vocab_size=tok.source.get_piece_size(),
                                      tgt_vocab_size=tok.target.get_piece_size(), attention=kind)).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        figures: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
        warm = rng.sample(data, 300)
        run(model, opt, [collate([warm[i] for i in b]) for b in make_batches(warm, args.batch_tokens, rng)],
            real_loss)
        for r in range(args.rounds):
            drawn = rng.sample(data, args.sentences)
            for way in (list(WAYS) if r % 2 == 0 else list(reversed(WAYS))):
                batching, loss = WAYS[way]
                batches = [collate([drawn[i] for i in b]) for b in batching(drawn, args.batch_tokens, random.Random(r))]
                seconds, sentences, tokens = run(model, opt, batches, losses[loss])
                figures[way].append((sentences / len(batches), sentences / seconds, tokens / seconds))
                print(f"{kind} round {r} {way}: {sentences / seconds:.1f} sentences/s", flush=True)
        med = {w: [statistics.median(x[k] for x in f) for k in range(3)] for w, f in figures.items()}
        for way in WAYS:
            lines.append(f"| {kind} | {way} | {med[way][0]:.0f} | {med[way][1]:.1f} | {med[way][2]:.0f} | "
                         f"{med[way][1] / med['before'][1]:.2f} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
