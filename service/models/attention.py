"""The attention kinds of the model family, and the graph widths each one gives. Torch-free.

One definition for both sides: ``export.train.model`` builds the modules of a kind,
``service.models.config.ModelConfig`` gives each kind's widths (``state_size``,
``key_size``) and the manifest checks the graphs against them, and the server
knows from it whether a model can answer ``return_attention``.

========================  ================================  ===================================
kind                      ``state`` (the step's carry)      ``keys`` (from the encoder)
========================  ================================  ===================================
``bahdanau`` (default)    s_i (dec_hidden)                  U h_j + b (attn_size)
``luong-general``         [h_t; h~_t] (2 x dec_hidden)      W_a h_j (dec_hidden)
``luong-dot``             [h_t; h~_t] (2 x dec_hidden)      none: width 0 (h_j are the keys)
``none`` (RNNencdec)      [s_i; c] (dec_hidden + ctx)       none: width 0
========================  ================================  ===================================

The step graph's inputs and outputs are the same for every kind; a graph that
does not read an input (``none`` reads neither ``annotations`` nor ``keys``)
still declares it. A ``none`` model's ``attention`` output is all zeros, and
the server refuses ``return_attention`` for it.
"""

from __future__ import annotations

from typing import Any

KINDS = ("bahdanau", "luong-general", "luong-dot", "none")
DEFAULT = "bahdanau"


def check_kind(value: Any, where: str = "attention") -> str:
    """``value`` if it is a known kind, else a one-line ValueError naming it and the choices."""
    if value not in KINDS:
        raise ValueError(f"{where} must be one of {', '.join(KINDS)}; got {value!r}")
    return value


def has_attention(kind: str) -> bool:
    return check_kind(kind) != "none"
