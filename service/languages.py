"""Language codes: what a served model translates, and routing a request by its languages.

A manifest names its direction (``"languages": {"source": "en", "target": "fr"}``, or
a list ``["en", "fr"]``); ``pair`` reads it. A request may name languages instead of a
model (``TranslateRequest.source_language``/``target_language``, LibreTranslate's
``source``/``target``): ``normalize`` makes ``"FR"``, ``"fr-FR"`` and ``"fr_FR"`` one
code, ``route`` picks the served model of that direction.
"""

from __future__ import annotations

import re
from typing import Any, Sequence, TypeVar

NAMES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian",
         "pt": "Portuguese", "nl": "Dutch", "pl": "Polish", "ru": "Russian", "ja": "Japanese",
         "zh": "Chinese", "ko": "Korean", "ar": "Arabic", "sv": "Swedish", "cs": "Czech"}
"""English names of the codes a page or a LibreTranslate client shows (others: the code itself)."""

_CODE = re.compile(r"^([A-Za-z]{2,3})(?:[-_][A-Za-z0-9]{1,8})*$")


def normalize(code: str) -> str:
    """``"fr"``, ``"FR"``, ``"fr-FR"``, ``"fr_FR"`` -> ``"fr"``; anything else unchanged but lower case
    (it then matches no model, and the refusal names what is served)."""
    m = _CODE.match(code.strip())
    return m.group(1).lower() if m else code.strip().lower()


def name(code: str) -> str:
    return NAMES.get(code, code)


def pair(raw_manifest: dict[str, Any]) -> tuple[str, str]:
    """(source, target) codes of a manifest's ``languages`` ("" where it names none)."""
    value = raw_manifest.get("languages") or {}
    if isinstance(value, dict):
        return normalize(str(value.get("source", ""))), normalize(str(value.get("target", "")))
    codes = [normalize(str(x)) for x in value] + ["", ""]
    return codes[0], codes[1]


M = TypeVar("M")


def route(models: Sequence[M], pairs: Sequence[tuple[str, str]], source: str, target: str) -> M | None:
    """The first model (``models`` come default-first) whose pair has ``source`` and ``target``
    (an empty one matches any), or None."""
    source, target = normalize(source) if source else "", normalize(target) if target else ""
    for model, (s, t) in zip(models, pairs):
        if (not source or s == source) and (not target or t == target):
            return model
    return None


def served_pairs(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """``["en-fr", "en-de"]``, without repeats, in order."""
    return list(dict.fromkeys(f"{s}-{t}" for s, t in pairs if s and t))
