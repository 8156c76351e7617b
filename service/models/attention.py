"""The attention kinds of the model family, and the graph widths each one gives. Torch-free.

One definition for both sides: ``export.model`` builds the modules of a kind,
the manifest checks its graphs' widths against the same rules, and the server
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


def ctx_size(config: dict[str, Any]) -> int:
    """Width of an annotation h_j: both encoder directions."""
    return 2 * config["enc_hidden_size"]


def state_size(config: dict[str, Any]) -> int:
    """Width of the decoder's carried state for ``config``'s kind."""
    kind = check_kind(config["attention"], "model_config.attention")
    if kind == "bahdanau":
        return config["dec_hidden_size"]
    if kind.startswith("luong"):
        return 2 * config["dec_hidden_size"]
    return config["dec_hidden_size"] + ctx_size(config)


def key_size(config: dict[str, Any]) -> int:
    """Width of the encoder's attention keys for ``config``'s kind (0: no keys)."""
    kind = check_kind(config["attention"], "model_config.attention")
    if kind == "bahdanau":
        return config["attn_size"]
    if kind == "luong-general":
        return config["dec_hidden_size"]
    return 0


def check_sizes(config: dict[str, Any]) -> None:
    """Widths a kind needs to agree: ``luong-dot`` scores h_t . h_j."""
    if config["attention"] == "luong-dot" and config["dec_hidden_size"] != ctx_size(config):
        raise ValueError(f"attention luong-dot needs dec_hidden_size == 2 x enc_hidden_size "
                         f"(h_t . h_j), got {config['dec_hidden_size']} and {config['enc_hidden_size']}")
