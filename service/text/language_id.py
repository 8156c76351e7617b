"""Which served source language a text is in: LibreTranslate's ``source: auto`` and ``/detect``.

langid.py's model (``py3langid``, shipped inside its wheel: nothing is downloaded) scores the
text over its 97 languages. A text whose probability mass on the served source languages is
below ``NO_MATCH`` is in none of them (Cyrillic or Japanese text on an en/fr server): the
caller refuses it naming the languages served. Otherwise the served languages are ranked by
their share of that mass; ties (a text with nothing to go on: ``OK``, ``12345``) go to the
language listed first (the default model's source). On our test split, restricted to en/fr,
it is right for 96.6 % of messages (90.8 % of those of 1-3 words), as lingua-language-detector
(96.3 %), at 0.06 ms a text (``loadtest/language_id.py``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Sequence

NO_MATCH = 1e-3
"""Below this share of the detector's probability, a text is in none of the served languages."""

_lock = threading.Lock()
_identifier = None


def _model():
    """The langid.py identifier, loaded once (0.7 s) on first use."""
    global _identifier
    with _lock:
        if _identifier is None:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
            _identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _identifier


@dataclass(frozen=True)
class Guess:
    language: str
    confidence: float  # 0..100, LibreTranslate's scale: the language's share among the served ones


def rank(text: str, languages: Sequence[str]) -> list[Guess]:
    """The served ``languages`` ranked for ``text``, best first; empty when the text is in none."""
    if not languages:
        return []
    scores = dict(_model().rank(text))
    mass = {code: float(scores.get(code, 0.0)) for code in languages}
    total = sum(mass.values())
    if total < NO_MATCH:
        return []
    order = sorted(languages, key=lambda c: (-round(mass[c] / total, 3), languages.index(c)))
    return [Guess(c, round(100 * mass[c] / total, 1)) for c in order]


async def load() -> None:
    """The model in memory: its first load (0.7 s) runs in a thread, off the caller's event loop;
    once loaded, this returns at once (no thread hop per request)."""
    if _identifier is None:
        await asyncio.to_thread(_model)
