"""Training batches: examples encoded, grouped by length within a token budget, padded as served."""

from __future__ import annotations

import random

import torch

from export.data.pairs import Pair
from service.decoding.layout import pad_sources
from service.text.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer


Example = tuple[list[int], list[int]]  # (source ids with EOS, target ids with EOS)


def encode_pairs(pairs: list[Pair], tok: Tokenizer, max_len: int) -> list[Example]:
    out = []
    for p in pairs:
        src = tok.source.encode(p.src) + [EOS_ID]
        tgt = tok.encode_target(p.tgt)
        if len(src) <= max_len and len(tgt) <= max_len:
            out.append((src, tgt))
    return out


def padded_length(example: Example) -> int:
    """What an example costs in the token budget: the longer of its source and target (+ BOS)."""
    return max(len(example[0]), len(example[1]) + 1)


def make_batches(data: list[Example], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by ``padded_length`` (with noise), each batch within the token budget.

    Grouped by what the budget counts, a batch is nearly all real tokens on both sides: grouped
    by source length alone, a batch's targets differ in length, the longest fills the budget
    and a batch held about 130 sentences instead of about 210 (corpus v2, 3,000 tokens)."""
    order = sorted(range(len(data)), key=lambda i: (padded_length(data[i]) + rng.random() * 2, len(data[i][1])))
    batches = pack_batches(data, order, batch_tokens)
    rng.shuffle(batches)
    return batches


def pack_batches(data: list[Example], order: list[int], batch_tokens: int) -> list[list[int]]:
    """``order`` cut into consecutive batches whose rows x longest ``padded_length`` stay within
    ``batch_tokens``."""
    batches, cur, longest = [], [], 0
    for i in order:
        n = padded_length(data[i])
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return batches + [cur] if cur else batches


def collate(examples: list[Example]) -> tuple[torch.Tensor, ...]:
    """-> src (batch, src_len), src_lengths (batch,), tgt_in, tgt_out (batch, tgt_len)."""
    src, lengths = pad_sources([s for s, _ in examples], PAD_ID)  # the serving batch's padding
    tgt_len = max(len(t) for _, t in examples)
    tgt_in = torch.full((len(examples), tgt_len), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((len(examples), tgt_len), PAD_ID, dtype=torch.long)
    for b, (_, t) in enumerate(examples):
        tgt_in[b, : len(t)] = torch.tensor([BOS_ID] + t[:-1])
        tgt_out[b, : len(t)] = torch.tensor(t)
    return torch.from_numpy(src), torch.from_numpy(lengths), tgt_in, tgt_out
