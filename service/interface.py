"""The types every layer shares, and the narrow interface between scheduler and engine.

The scheduler (``service.scheduling``) only sees these types, so its tests
substitute a fake engine; the real one (``service.decoding.engine``) runs ONNX
Runtime. Everything here is plain data: protobuf exists only at the edge
(``service.api``).

The path of one text: the front door (``service.api.frontend.Frontend.admit_request``)
validates the request (``service.options``) and has the engine turn each text into a
``Prepared`` (``Engine.prepare_text``); the scheduler feeds it to a
``DecodeBatch``, which works in token ids and hands back a ``Decoded``; the
engine renders that as a ``Translation`` (``service.text.render``). A stream
sees ``Partial`` events, then one ``Final``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Union

import numpy as np

from service.options import DecodingOptions

Key = tuple[int, int]
"""(request id, text index): one text of one request, in the scheduler and the batch."""


@dataclass(frozen=True)
class SpecialIds:
    """Special token ids, parsed once from the manifest (``special_ids``)."""

    pad: int = 0
    unk: int = 1
    bos: int = 2
    eos: int = 3


@dataclass(frozen=True)
class Prepared:
    """One text, validated and tokenized, ready to be encoded."""

    text: str  # as the client sent it
    source_ids: tuple[int, ...]  # source piece ids, EOS last
    source_pieces: tuple[str, ...]  # the pieces of source_ids (for alignments)
    placeholders: tuple[str, ...]  # restored into the translation
    options: DecodingOptions  # validated

    @property
    def rows(self) -> int:
        """Decoder rows this text occupies while it decodes."""
        return self.options.beam_size

    @property
    def max_length(self) -> int:
        """Target tokens this text may decode (EOS excluded)."""
        return self.options.max_target_length(len(self.source_ids))

    @property
    def work(self) -> int:
        """Estimated work (rows x steps) for admission control."""
        return self.rows * self.max_length


@dataclass(frozen=True)
class Finished:
    """One finished hypothesis, in token ids."""

    tokens: tuple[int, ...]  # target ids, EOS excluded
    score: float  # sum of log-probabilities (EOS included when it ended with EOS)
    length: int  # tokens + 1 with EOS, tokens without (length limit)
    normalized: float  # score / length ** length_penalty
    attention: np.ndarray | None = None  # (length, src_len), with return_attention


@dataclass(frozen=True)
class Decoded:
    """What a batch hands back for one text: its best hypotheses, best first."""

    hypotheses: tuple[Finished, ...]  # num_hypotheses of them
    steps: int  # decoder steps this text took


@dataclass(frozen=True)
class Alignment:
    """Where one target token attended."""

    target_index: int  # position in Hypothesis.tokens (EOS excluded)
    source_index: int  # argmax of the attention row, a position in source pieces
    source_token: str  # the source piece at source_index
    weights: tuple[float, ...] = ()  # the whole attention row (only with return_attention)


@dataclass(frozen=True)
class Hypothesis:
    """One translation of a text."""

    text: str  # detokenized, placeholders restored
    score: float  # sum of token log-probabilities (EOS included)
    tokens: tuple[str, ...]  # target pieces, EOS excluded
    alignments: tuple[Alignment, ...] = ()  # one per token, with return_attention


@dataclass(frozen=True)
class Translation:
    """All hypotheses of one text, best first."""

    hypotheses: tuple[Hypothesis, ...]
    source_tokens: tuple[str, ...]  # source pieces (EOS excluded)
    steps: int = 0  # decoder steps this text took


@dataclass(frozen=True)
class Partial:
    """A streaming update: per text of the request, the text all its live beams agree on
    (a finished text: its best translation)."""

    texts: tuple[str, ...]


@dataclass(frozen=True)
class Final:
    """The end of a request: its translations, in request order."""

    translations: tuple[Translation, ...]


Event = Union[Partial, Final]


class DecodeBatch(Protocol):
    """A running batch of decoder rows; many texts, each with its own options.

    Not thread-safe: one thread (the scheduler's engine thread) drives it.
    """

    def add(self, items: Sequence[tuple[Key, Prepared]]) -> None:
        """Encode these texts (one encoder run) and add their rows to the batch."""

    def step(self) -> list[tuple[Key, Decoded]]:
        """One decoder step over all live rows; the texts that finished in it."""

    def remove(self, keys: Sequence[Key]) -> None:
        """Drop the rows of these texts (cancelled, deadline passed)."""

    def prefix(self, key: Key) -> list[int]:
        """The target ids all live beams of ``key`` agree on so far (for streaming)."""

    @property
    def live_rows(self) -> int:
        """Rows the next step will run on."""

    @property
    def padded_tokens(self) -> tuple[int, int]:
        """(real source tokens, padded source tokens) of the live rows, for the padding ratio."""


class Engine(Protocol):
    """What the scheduler needs from an engine."""

    precision: str  # the graphs it runs: "fp32" or "int8"

    def prepare_text(self, text: str, options: DecodingOptions, index: int) -> Prepared:
        """Tokenize one text of a validated request (raises NmtError naming ``texts[index]``)."""

    def new_batch(self) -> DecodeBatch:
        """An empty running batch."""

    def translation(self, prepared: Prepared, decoded: Decoded) -> Translation:
        """The text of a decoded text's hypotheses."""

    def partial_text(self, prepared: Prepared, ids: Sequence[int]) -> str:
        """The text of an unfinished prefix (streaming)."""
