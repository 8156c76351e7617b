"""Decoding options, named once (proto, Python, docs), and the one request validation.

``validate_request`` is called once per request by the front door
(``service.api.frontend``), whichever transport it came by; everything after it trusts
the options. The maximum target
length has one rule, ``max_target_length``, used by the service and by the
PyTorch reference search (``export.search``).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Sequence

from service.errors import invalid

INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zs", "Zl", "Zp"})
"""Control, format (U+200B, U+FEFF, bidi marks), surrogate, unassigned and separator
characters: a text of only these has nothing to translate, like a whitespace-only one."""


@dataclass(frozen=True)
class Limits:
    """Server-side limits on what one request may ask for."""

    max_beam_size: int = 16
    max_decoding_length: int = 512  # target tokens, hard cap
    max_length_ratio: float = 10.0  # cap on DecodingOptions.max_length_ratio
    max_source_tokens: int = 200  # source pieces per text (the model's maximum input)
    max_text_chars: int = 2000  # characters per text, checked before tokenizing
    max_texts: int = 64  # texts per request


def max_target_length(source_length: int, *, max_decoding_length: int, max_length_ratio: float) -> int:
    """Target tokens (EOS excluded) allowed for a source of ``source_length`` pieces
    (EOS included): ``min(max_decoding_length, int(ratio * source_length) + 5)``, at least 1."""
    return max(1, min(max_decoding_length, int(max_length_ratio * source_length) + 5))


@dataclass(frozen=True)
class DecodingOptions:
    """Per-request decoding options (the proto's ``DecodingOptions``)."""

    beam_size: int = 1  # 1 = greedy
    num_hypotheses: int = 1  # returned per text, <= beam_size
    length_penalty: float = 1.0  # rank by score / length ** length_penalty (0 = raw sum)
    max_decoding_length: int = 256  # target tokens, EOS excluded
    max_length_ratio: float = 3.0  # target tokens <= ratio * source tokens + 5
    return_scores: bool = True
    return_attention: bool = False

    def max_target_length(self, source_length: int) -> int:
        """Target tokens allowed for a source of ``source_length`` pieces."""
        return max_target_length(source_length, max_decoding_length=self.max_decoding_length,
                                 max_length_ratio=self.max_length_ratio)


def validate_request(texts: Sequence[str], options: DecodingOptions, limits: Limits) -> DecodingOptions:
    """Check a request's texts and options against ``limits``, in field order; return the
    options. Raises INVALID_ARGUMENT naming the field, the limit and the value."""
    if not texts:
        raise invalid("texts", "at least one text", 0)
    if len(texts) > limits.max_texts:
        raise invalid("texts", f"at most {limits.max_texts} texts", len(texts))
    for index, text in enumerate(texts):
        _check_text(text, index, limits)
    _check_options(options, limits)
    return options


def is_blank(text: str) -> bool:
    """Nothing visible: empty, or only whitespace and invisible characters."""
    return all(c.isspace() or unicodedata.category(c) in INVISIBLE_CATEGORIES for c in text)


def _check_text(text: str, index: int, limits: Limits) -> None:
    """Reject an empty, blank (whitespace or invisible characters only) or oversized text
    (before tokenizing; the placeholder limit is the text layer's: ``placeholders.check_count``)."""
    field = f"texts[{index}]"
    if len(text) > limits.max_text_chars:  # first: the checks below read the whole text
        raise invalid(f"{field} length", f"at most {limits.max_text_chars} characters", len(text))
    if is_blank(text):
        # invisible characters count as whitespace: the message is the same, and repr()
        # shows them ('\u200b')
        raise invalid(field, "a non-empty, non-whitespace string", text)


def _check_options(options: DecodingOptions, limits: Limits) -> None:
    if not 1 <= options.beam_size <= limits.max_beam_size:
        raise invalid("options.beam_size", f"between 1 and {limits.max_beam_size}", options.beam_size)
    if not 1 <= options.num_hypotheses <= options.beam_size:
        raise invalid("options.num_hypotheses", f"between 1 and beam_size ({options.beam_size})",
                      options.num_hypotheses)
    if not 0.0 <= options.length_penalty <= 10.0:
        raise invalid("options.length_penalty", "between 0 and 10", options.length_penalty)
    if not 1 <= options.max_decoding_length <= limits.max_decoding_length:
        raise invalid("options.max_decoding_length", f"between 1 and {limits.max_decoding_length}",
                      options.max_decoding_length)
    if not 0.0 < options.max_length_ratio <= limits.max_length_ratio:
        raise invalid("options.max_length_ratio", f"in (0, {limits.max_length_ratio}]",
                      options.max_length_ratio)
