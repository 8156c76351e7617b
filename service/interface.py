"""The narrow interface between the scheduler and the decoding engine.

The scheduler (``service/scheduler.py``) only sees these types, so its tests
substitute a fake engine; the real one (``service/engine.py``) runs ONNX
Runtime. Everything here is plain data: protobuf exists only at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence

from service.options import DecodingOptions


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
    def work(self) -> int:
        """Estimated work (rows x steps) for admission control."""
        return self.rows * self.options.max_target_length(len(self.source_ids))


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
    extra: dict = field(default_factory=dict, compare=False)


class DecodeBatch(Protocol):
    """A running batch of decoder rows; many texts, each with its own options.

    Not thread-safe: one thread (the scheduler's engine thread) drives it.
    ``Key`` is any hashable the caller uses to tell texts apart.
    """

    def add(self, items: Sequence[tuple[Hashable, Prepared]]) -> None:
        """Encode these texts (one encoder run) and add their rows to the batch."""

    def step(self) -> list[tuple[Hashable, Translation]]:
        """One decoder step over all live rows; the texts that finished in it."""

    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop the rows of these texts (cancelled, deadline passed)."""

    def prefix(self, key: Hashable) -> str:
        """The text all live beams of ``key`` agree on so far (for streaming)."""

    @property
    def live_rows(self) -> int:
        """Rows the next step will run on."""

    @property
    def padded_tokens(self) -> tuple[int, int]:
        """(real source tokens, padded source tokens) of the live rows, for the padding ratio."""


class Engine(Protocol):
    """What the scheduler needs from an engine."""

    def prepare(self, text: str, options: DecodingOptions, index: int) -> Prepared:
        """Validate and tokenize one text (raises NmtError naming ``texts[index]``)."""

    def new_batch(self) -> DecodeBatch:
        """An empty running batch."""
