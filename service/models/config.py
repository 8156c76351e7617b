"""The model's sizes and kind: one frozen config for both sides. Torch-free.

``export/`` builds the PyTorch modules from it, stores it in the checkpoint
(``config``) and writes it into the manifest (``model_config``); the server
reads it back from the manifest and takes the graphs' widths from it
(``ctx_size``, ``state_size``, ``key_size``: ``service.models.attention``'s
table). The JSON form is ``to_dict``'s: one key per field, as written since the
first repository; a manifest without ``attention`` predates the kinds and is
RNNsearch (``bahdanau``). ``tie_embeddings`` (the output layer's weights are the
target embeddings) is written only where it is true, so that configs of untied
models read and write as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from service.interface import SpecialIds
from service.models import attention as kinds

_TRAINED_WITH = SpecialIds()  # the special ids the tokenizers are trained with (export.data.tokenizers)
SIZE_FIELDS = ("src_vocab_size", "tgt_vocab_size", "emb_size", "enc_hidden_size", "dec_hidden_size",
               "attn_size", "out_size")
ID_FIELDS = ("pad_id", "bos_id", "eos_id")
OPTIONAL = {"attention": kinds.DEFAULT, "tie_embeddings": False}  # may be absent from a dict: older repositories


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and kind of a model; stored in the checkpoint and the manifest."""

    src_vocab_size: int
    tgt_vocab_size: int
    emb_size: int = 256  # source and target embeddings
    enc_hidden_size: int = 256  # per direction; annotations are twice this
    dec_hidden_size: int = 512
    attn_size: int = 512  # width of the additive attention's hidden layer (bahdanau)
    out_size: int = 256  # maxout units of the deep output layer (bahdanau, none)
    dropout: float = 0.2
    pad_id: int = _TRAINED_WITH.pad  # the tokenizers' special ids
    bos_id: int = _TRAINED_WITH.bos
    eos_id: int = _TRAINED_WITH.eos
    attention: str = kinds.DEFAULT  # one of service.models.attention.KINDS
    tie_embeddings: bool = False  # the output layer's weight matrix is the target embeddings

    def __post_init__(self) -> None:
        check(asdict(self), "ModelConfig")
        object.__setattr__(self, "dropout", float(self.dropout))  # 0 from JSON is 0.0

    @property
    def ctx_size(self) -> int:
        """Width of an annotation h_j: both encoder directions."""
        return 2 * self.enc_hidden_size

    @property
    def state_size(self) -> int:
        """Width of the decoder's carried state: s_i; [h_t; h~_t]; [s_i; c]."""
        if self.attention == "bahdanau":
            return self.dec_hidden_size
        if self.attention.startswith("luong"):
            return 2 * self.dec_hidden_size
        return self.dec_hidden_size + self.ctx_size

    @property
    def key_size(self) -> int:
        """Width of the encoder's attention keys: U h_j + b; W_a h_j; 0 (no keys)."""
        if self.attention == "bahdanau":
            return self.attn_size
        if self.attention == "luong-general":
            return self.dec_hidden_size
        return 0

    @property
    def has_attention(self) -> bool:
        return kinds.has_attention(self.attention)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (checkpoint ``config``, manifest ``model_config``)."""
        values = asdict(self)
        if not self.tie_embeddings:
            del values["tie_embeddings"]
        return values

    @classmethod
    def from_dict(cls, raw: Any, *, where: str = "model_config") -> ModelConfig:
        """The config ``raw`` describes; a ValueError naming ``where.<field>`` for a missing,
        unknown or mistyped field or an impossible value (a bool is not an integer, a string
        not a number)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object, got {str(raw)[:80]!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(names))
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown} (known: {', '.join(names)})")
        check_types(raw, where)
        missing = [n for n in names if n not in raw and n not in OPTIONAL]
        if missing:
            raise ValueError(f"{where}.{missing[0]} is missing")
        values = {**OPTIONAL, **raw}
        check(values, where)
        return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_types(values: Mapping[str, Any], where: str) -> None:
    """Each field given has its type: integers, a number for ``dropout``, a string for
    ``attention``, a bool for ``tie_embeddings``; else ValueError naming ``where.<field>`` and the value."""
    for name, value in values.items():
        if name in SIZE_FIELDS or name in ID_FIELDS:
            ok, expected = _is_int(value), "an integer"
        elif name == "dropout":
            ok, expected = _is_int(value) or isinstance(value, float), "a number"
        elif name == "tie_embeddings":
            ok, expected = isinstance(value, bool), "true or false"
        else:
            ok, expected = isinstance(value, str), "a string"
        if not ok:
            raise ValueError(f"{where}.{name} must be {expected}, got {value!r}")


def check(values: Mapping[str, Any], where: str) -> None:
    """Every field of a whole config: its type, its range, the kind, and the widths the kind
    needs to agree (``luong-dot`` scores h_t . h_j); else ValueError naming ``where.<field>``."""
    check_types(values, where)
    for name in SIZE_FIELDS:
        if values[name] <= 0:
            raise ValueError(f"{where}.{name} must be > 0, got {values[name]}")
    vocab = min(values["src_vocab_size"], values["tgt_vocab_size"])
    for name in ID_FIELDS:
        if not 0 <= values[name] < vocab:
            raise ValueError(f"{where}.{name} must be a token id of both vocabularies (0 to {vocab - 1}), "
                             f"got {values[name]}")
    if not 0.0 <= values["dropout"] < 1.0:
        raise ValueError(f"{where}.dropout must be in [0, 1), got {values['dropout']}")
    kinds.check_kind(values["attention"], f"{where}.attention")
    if values["attention"] == "luong-dot" and values["dec_hidden_size"] != 2 * values["enc_hidden_size"]:
        raise ValueError(f"{where}: attention luong-dot needs dec_hidden_size == 2 x enc_hidden_size "
                         f"(h_t . h_j), got {values['dec_hidden_size']} and {values['enc_hidden_size']}")
    output = "dec_hidden_size" if values["attention"].startswith("luong") else "out_size"
    if values["tie_embeddings"] and values[output] != values["emb_size"]:
        raise ValueError(f"{where}: tie_embeddings needs {output} == emb_size (the output layer's input is "
                         f"an embedding's width), got {values[output]} and {values['emb_size']}")
