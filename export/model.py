"""RNNsearch (Bahdanau, Cho & Bengio, ICLR 2015) in PyTorch.

Encoder: embedding + bidirectional GRU over packed (padded) batches; the
annotation h_j concatenates both directions. Decoder: s_0 = tanh(W_s · backward
h_1); additive attention scored with the previous state,
e_ij = v^T tanh(W s_{i-1} + U h_j + b), where ``U h_j + b`` (the attention
keys) is computed once by the encoder; a GRU cell on [E y_{i-1}; c_i]; a deep
output (maxout) layer over (s_i, E y_{i-1}, c_i) to log-probabilities.

The encoder and one decoder step are the two graphs exported to ONNX.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from service.text.tokenizer import TRAINED_WITH

NEG_LARGE = -1e9
"""Score of a padding position: finite, so an all-padding row gives no NaN."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of an RNNsearch model; stored in the checkpoint and the manifest."""

    src_vocab_size: int
    tgt_vocab_size: int
    emb_size: int = 256  # source and target embeddings
    enc_hidden_size: int = 256  # per direction; annotations are twice this
    dec_hidden_size: int = 512
    attn_size: int = 512  # width of the additive attention's hidden layer
    out_size: int = 256  # maxout units of the deep output layer
    dropout: float = 0.2
    pad_id: int = TRAINED_WITH.pad  # the tokenizers' special ids (service.text.tokenizer)
    bos_id: int = TRAINED_WITH.bos
    eos_id: int = TRAINED_WITH.eos

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "emb_size", "enc_hidden_size",
                     "dec_hidden_size", "attn_size", "out_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ctx_size(self) -> int:
        return 2 * self.enc_hidden_size

    def to_dict(self) -> dict:
        return asdict(self)


class Encoder(nn.Module):
    """Source ids -> (annotations, attention keys, initial decoder state)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.src_vocab_size, config.emb_size, padding_idx=config.pad_id)
        self.rnn = nn.GRU(config.emb_size, config.enc_hidden_size, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(config.enc_hidden_size, config.dec_hidden_size)  # W_s
        self.keys = nn.Linear(config.ctx_size, config.attn_size)  # U, b
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, src: torch.Tensor, src_lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # src: (batch, src_len) int64, src_lengths: (batch,) int64
        emb = self.dropout(self.embed(src))  # (batch, src_len, emb_size)
        packed = pack_padded_sequence(emb, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        annotations, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        # annotations: (batch, src_len, ctx_size); backward h_1 is the second half at j = 0
        backward_first = annotations[:, 0, self.rnn.hidden_size:]  # (batch, enc_hidden_size)
        state = torch.tanh(self.init_state(backward_first))  # (batch, dec_hidden_size)
        keys = self.keys(annotations)  # (batch, src_len, attn_size)
        return annotations, keys, state


class Attention(nn.Module):
    """Additive attention with precomputed keys, scored with s_{i-1}."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.query = nn.Linear(config.dec_hidden_size, config.attn_size, bias=False)  # W
        self.v = nn.Linear(config.attn_size, 1, bias=False)

    def forward(self, state: torch.Tensor, annotations: torch.Tensor, keys: torch.Tensor,
                src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # state: (batch, dec_hidden_size); keys: (batch, src_len, attn_size)
        # src_mask: (batch, src_len) bool, True on real tokens
        energy = self.v(torch.tanh(keys + self.query(state).unsqueeze(1))).squeeze(2)
        energy = energy.masked_fill(~src_mask, NEG_LARGE)  # (batch, src_len)
        alpha = torch.softmax(energy, dim=1)
        context = torch.bmm(alpha.unsqueeze(1), annotations).squeeze(1)  # (batch, ctx_size)
        return context, alpha


class Decoder(nn.Module):
    """One step: (y_{i-1}, s_{i-1}) -> (s_i, c_i, alpha_i); plus the deep output."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.tgt_vocab_size, config.emb_size, padding_idx=config.pad_id)
        self.attention = Attention(config)
        self.cell = nn.GRUCell(config.emb_size + config.ctx_size, config.dec_hidden_size)
        self.pre_output = nn.Linear(config.dec_hidden_size + config.emb_size + config.ctx_size,
                                    2 * config.out_size)
        self.output = nn.Linear(config.out_size, config.tgt_vocab_size)
        self.dropout = nn.Dropout(config.dropout)

    def step(self, prev_emb: torch.Tensor, state: torch.Tensor, annotations: torch.Tensor,
             keys: torch.Tensor, src_mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # prev_emb: (batch, emb_size), state: (batch, dec_hidden_size)
        context, alpha = self.attention(state, annotations, keys, src_mask)
        state = self.cell(torch.cat([prev_emb, context], dim=1), state)
        return state, context, alpha

    def logits(self, state: torch.Tensor, prev_emb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        # any leading shape (..., features) -> (..., tgt_vocab_size)
        t = self.pre_output(self.dropout(torch.cat([state, prev_emb, context], dim=-1)))
        t = t.unflatten(-1, (-1, 2)).amax(dim=-1)  # maxout over pairs: (..., out_size)
        return self.output(self.dropout(t))


class RNNSearch(nn.Module):
    """The whole model, for training (teacher forcing) and reference decoding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, src: torch.Tensor, src_lengths: torch.Tensor, tgt_in: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing. tgt_in: (batch, tgt_len) starting with BOS.

        Returns logits (batch, tgt_len, tgt_vocab_size) and attention
        (batch, tgt_len, src_len).
        """
        annotations, keys, state = self.encoder(src, src_lengths)
        src_mask = src != self.config.pad_id
        emb = self.decoder.dropout(self.decoder.embed(tgt_in))  # (batch, tgt_len, emb_size)
        states, contexts, alphas = [], [], []
        for i in range(tgt_in.shape[1]):
            state, context, alpha = self.decoder.step(emb[:, i], state, annotations, keys, src_mask)
            states.append(state)
            contexts.append(context)
            alphas.append(alpha)
        # the output layer runs once over all steps: one large matrix product
        logits = self.decoder.logits(torch.stack(states, 1), emb, torch.stack(contexts, 1))
        return logits, torch.stack(alphas, 1)

    def step_log_probs(self, prev_tokens: torch.Tensor, state: torch.Tensor,
                       annotations: torch.Tensor, keys: torch.Tensor, src_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder step as exported: (log_probs, next_state, attention)."""
        prev_emb = self.decoder.embed(prev_tokens)
        state, context, alpha = self.decoder.step(prev_emb, state, annotations, keys, src_mask)
        log_probs = F.log_softmax(self.decoder.logits(state, prev_emb, context), dim=-1)
        return log_probs, state, alpha

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
