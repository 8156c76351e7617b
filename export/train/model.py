"""The seeds' model family in PyTorch: RNNsearch, Luong attention, RNNencdec.

Every kind shares the encoder: embedding + bidirectional GRU over packed
(padded) batches; the annotation h_j concatenates both directions. They
differ in how the decoder reads it (``ModelConfig.attention``, the kinds of
``service.models.attention``; the config is ``service.models.config``'s, the
server's too):

``bahdanau`` (RNNsearch, Bahdanau, Cho & Bengio, ICLR 2015; the default)
    s_0 = tanh(W_s · backward h_1); additive attention scored with the
    *previous* state, e_ij = v^T tanh(W s_{i-1} + U h_j + b), where
    ``U h_j + b`` (the keys) is computed once by the encoder; a GRU cell on
    [E y_{i-1}; c_i]; a deep output (maxout) layer over (s_i, E y_{i-1}, c_i).
    Departs from the paper in sizes only (and the GRU is PyTorch's, reset gate
    applied after the hidden product).

``luong-general`` and ``luong-dot`` (Luong, Pham & Manning, EMNLP 2015, global attention)
    The paper's order: the GRU cell first, h_t = GRU([E y_{t-1}; h~_{t-1}],
    h_{t-1}) (input feeding, h~_0 = 0); then attend from the *current* h_t,
    score(h_t, h_j) = h_t^T W_a h_j (general; ``W_a h_j`` is the encoder's
    keys) or h_t^T h_j (dot: needs dec_hidden = 2 x enc_hidden); a_t =
    softmax; c_t = sum_j a_tj h_j; the attentional state h~_t = tanh(W_c [c_t;
    h_t]) (no bias, as in the paper) feeds the output layer p(y_t) =
    softmax(W_s h~_t + b) and the next step. The carried state is [h_t; h~_t].
    Departs from the paper: GRU instead of a 4-layer LSTM, a bidirectional
    encoder (the paper's is unidirectional, its decoder starts from the
    encoder's last state; here h_0 = tanh(W_s · backward h_1), as RNNsearch),
    dropout on h~_t (as OpenNMT), no local attention. The seed's
    ``LuongAttention`` module scores only; the order above is the paper's.

``none`` (RNNencdec, Cho et al. 2014, the baseline Bahdanau et al. measured against)
    One fixed summary of the source, c = [forward h_T; backward h_1] (the
    last state of each direction; Cho's encoder is unidirectional with c =
    tanh(V h_T)); s_0 = tanh(W_s c); every step reads the same c: a GRU cell on
    [E y_{i-1}; c] and the deep output over (s_i, E y_{i-1}, c), RNNsearch's
    decoder with c_i = c. The carried state is [s_i; c]; ``attention`` is zeros.

Padding masks in every kind: a padded position scores ``NEG_LARGE`` (finite,
so an all-padding row gives no NaN), and the encoder packs the batch. The
encoder and one decoder step are the two graphs exported to ONNX; their
inputs and outputs are the same for every kind (``service.models.manifest``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from service.models.config import ModelConfig

NEG_LARGE = -1e9
"""Score of a padding position: finite, so an all-padding row gives no NaN."""


class Encoder(nn.Module):
    """Source ids -> (annotations, attention keys, initial decoder state)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.kind = config.attention
        self.embed = nn.Embedding(config.src_vocab_size, config.emb_size, padding_idx=config.pad_id)
        self.rnn = nn.GRU(config.emb_size, config.enc_hidden_size, batch_first=True, bidirectional=True)
        # W_s: from backward h_1, or (none) from the summary c
        self.init_state = nn.Linear(config.ctx_size if self.kind == "none" else config.enc_hidden_size,
                                    config.dec_hidden_size)
        self.keys: nn.Module | None = None
        if self.kind == "bahdanau":
            self.keys = nn.Linear(config.ctx_size, config.attn_size)  # U, b
        elif self.kind == "luong-general":
            self.keys = nn.Linear(config.ctx_size, config.dec_hidden_size, bias=False)  # W_a
        self.dec_hidden_size = config.dec_hidden_size
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, src: torch.Tensor, src_lengths: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # src: (batch, src_len) int64, src_lengths: (batch,) int64
        emb = self.dropout(self.embed(src))  # (batch, src_len, emb_size)
        packed = pack_padded_sequence(emb, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        annotations, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        # annotations: (batch, src_len, ctx_size); backward h_1 is the second half at j = 0
        half = self.rnn.hidden_size
        backward_first = annotations[:, 0, half:]  # (batch, enc_hidden_size)
        if self.kind == "none":
            last = (src_lengths - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, annotations.shape[2])
            forward_last = annotations.gather(1, last).squeeze(1)[:, :half]  # forward h_T
            summary = torch.cat([forward_last, backward_first], dim=1)  # c: (batch, ctx_size)
            state = torch.cat([torch.tanh(self.init_state(summary)), summary], dim=1)
        else:
            state = torch.tanh(self.init_state(backward_first))  # (batch, dec_hidden_size)
            if self.kind != "bahdanau":  # [h_0; h~_0 = 0]
                state = torch.cat([state, torch.zeros_like(state)], dim=1)
        # keys: (batch, src_len, key_size); width 0 where the kind has none
        keys = self.keys(annotations) if self.keys is not None else annotations[:, :, :0]
        return annotations, keys, state


def tie(output: nn.Linear, embed: nn.Embedding, config: ModelConfig) -> None:
    """With ``tie_embeddings``, the output layer's weights (vocabulary x width) are the target
    embeddings: one parameter, trained by both uses (Press and Wolf 2017)."""
    if config.tie_embeddings:
        output.weight = embed.weight


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
        return _attend(energy, annotations, src_mask)


def _attend(energy: torch.Tensor, annotations: torch.Tensor, src_mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax of (batch, src_len) scores -> (context (batch, ctx_size), alpha)."""
    alpha = torch.softmax(energy.masked_fill(~src_mask, NEG_LARGE), dim=1)
    return torch.bmm(alpha.unsqueeze(1), annotations).squeeze(1), alpha


class Decoder(nn.Module):
    """RNNsearch's decoder (``bahdanau``) and, without attention, RNNencdec's (``none``).

    ``step``: (E y_{i-1}, carried state) -> (next state, output features, alpha);
    ``logits``: the deep output over the features [s_i; E y_{i-1}; c_i].
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hidden = config.dec_hidden_size
        self.embed = nn.Embedding(config.tgt_vocab_size, config.emb_size, padding_idx=config.pad_id)
        self.attention = Attention(config) if config.attention == "bahdanau" else None
        self.cell = nn.GRUCell(config.emb_size + config.ctx_size, config.dec_hidden_size)
        self.pre_output = nn.Linear(config.dec_hidden_size + config.emb_size + config.ctx_size,
                                    2 * config.out_size)
        self.output = nn.Linear(config.out_size, config.tgt_vocab_size)
        tie(self.output, self.embed, config)
        self.dropout = nn.Dropout(config.dropout)

    def step(self, prev_emb: torch.Tensor, state: torch.Tensor, annotations: torch.Tensor,
             keys: torch.Tensor, src_mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # prev_emb: (batch, emb_size)
        if self.attention is not None:  # state: s_{i-1}
            context, alpha = self.attention(state, annotations, keys, src_mask)
            state = self.cell(torch.cat([prev_emb, context], dim=1), state)
            return state, torch.cat([state, prev_emb, context], dim=1), alpha
        s, context = state[:, :self.hidden], state[:, self.hidden:]  # [s_{i-1}; c]
        s = self.cell(torch.cat([prev_emb, context], dim=1), s)
        alpha = torch.zeros(src_mask.shape, dtype=context.dtype)  # no attention
        return torch.cat([s, context], dim=1), torch.cat([s, prev_emb, context], dim=1), alpha

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        # any leading shape (..., features) -> (..., tgt_vocab_size)
        t = self.pre_output(self.dropout(features))
        t = t.unflatten(-1, (-1, 2)).amax(dim=-1)  # maxout over pairs: (..., out_size)
        return self.output(self.dropout(t))


class LuongDecoder(nn.Module):
    """Luong's global attention with input feeding (``luong-general``, ``luong-dot``).

    ``step``: ([h_{t-1}; h~_{t-1}]) -> ([h_t; h~_t], h~_t, a_t); ``logits``: W_s h~_t + b.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hidden = config.dec_hidden_size
        self.general = config.attention == "luong-general"  # the keys are W_a h_j, else h_j
        self.embed = nn.Embedding(config.tgt_vocab_size, config.emb_size, padding_idx=config.pad_id)
        self.cell = nn.GRUCell(config.emb_size + config.dec_hidden_size, config.dec_hidden_size)
        self.combine = nn.Linear(config.ctx_size + config.dec_hidden_size, config.dec_hidden_size,
                                 bias=False)  # W_c
        self.output = nn.Linear(config.dec_hidden_size, config.tgt_vocab_size)  # W_s
        tie(self.output, self.embed, config)
        self.dropout = nn.Dropout(config.dropout)

    def step(self, prev_emb: torch.Tensor, state: torch.Tensor, annotations: torch.Tensor,
             keys: torch.Tensor, src_mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, fed = state[:, :self.hidden], state[:, self.hidden:]
        h = self.cell(torch.cat([prev_emb, fed], dim=1), h)  # h_t
        scored = keys if self.general else annotations  # (batch, src_len, dec_hidden)
        # h_t^T W_a h_j: (batch, src_len), as a product and a sum over the last axis: a batched
        # MatMul's result for a position depends on src_len in ONNX Runtime (the last bit)
        energy = (scored * h.unsqueeze(1)).sum(dim=2)
        context, alpha = _attend(energy, annotations, src_mask)
        attentional = self.dropout(torch.tanh(self.combine(torch.cat([context, h], dim=1))))  # h~_t
        return torch.cat([h, attentional], dim=1), attentional, alpha

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.output(features)


class RNNSearch(nn.Module):
    """The whole model of any kind, for training (teacher forcing) and reference decoding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = LuongDecoder(config) if config.attention.startswith("luong") else Decoder(config)

    def forward(self, src: torch.Tensor, src_lengths: torch.Tensor, tgt_in: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing. tgt_in: (batch, tgt_len) starting with BOS.

        Returns logits (batch, tgt_len, tgt_vocab_size) and attention
        (batch, tgt_len, src_len).
        """
        annotations, keys, state = self.encoder(src, src_lengths)
        src_mask = src != self.config.pad_id
        emb = self.decoder.dropout(self.decoder.embed(tgt_in))  # (batch, tgt_len, emb_size)
        features, alphas = [], []
        for i in range(tgt_in.shape[1]):
            state, feature, alpha = self.decoder.step(emb[:, i], state, annotations, keys, src_mask)
            features.append(feature)
            alphas.append(alpha)
        # the output layer runs once over all steps: one large matrix product
        return self.decoder.logits(torch.stack(features, 1)), torch.stack(alphas, 1)

    def token_logits(self, src: torch.Tensor, src_lengths: torch.Tensor, tgt_in: torch.Tensor,
                     tgt_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing on the real target positions only, for training: (logits (tokens,
        tgt_vocab_size), their targets (tokens,)), step-major.

        The rows run longest target first and leave the recurrence after their last token,
        so padding costs neither decoder steps nor output-layer products (in length-bucketed
        batches of the corpus, 43 % of the (row, step) positions are padding). The same
        computation as ``forward`` on every real position.
        """
        tgt_lengths = (tgt_out != self.config.pad_id).sum(1)
        order = torch.argsort(tgt_lengths, descending=True, stable=True)
        src, src_lengths, tgt_in, tgt_out = src[order], src_lengths[order], tgt_in[order], tgt_out[order]
        annotations, keys, state = self.encoder(src, src_lengths)
        src_mask = src != self.config.pad_id
        emb = self.decoder.dropout(self.decoder.embed(tgt_in))  # (batch, tgt_len, emb_size)
        # rows still inside their target at each step: a prefix, since the rows are sorted
        alive = (tgt_lengths[order].unsqueeze(1) > torch.arange(tgt_in.shape[1])).sum(0).tolist()
        features, targets = [], []
        for i, n in enumerate(alive):
            if n == 0:
                break
            state, feature, _ = self.decoder.step(emb[:n, i], state[:n], annotations[:n], keys[:n], src_mask[:n])
            features.append(feature)
            targets.append(tgt_out[:n, i])
        # the output layer runs once over all real positions: one large matrix product
        return self.decoder.logits(torch.cat(features)), torch.cat(targets)

    def step_log_probs(self, prev_tokens: torch.Tensor, state: torch.Tensor,
                       annotations: torch.Tensor, keys: torch.Tensor, src_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder step as exported: (log_probs, next_state, attention)."""
        prev_emb = self.decoder.embed(prev_tokens)
        state, feature, alpha = self.decoder.step(prev_emb, state, annotations, keys, src_mask)
        return F.log_softmax(self.decoder.logits(feature), dim=-1), state, alpha

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
