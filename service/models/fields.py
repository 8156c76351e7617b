"""The manifest's descriptive fields, each checked by type and range when the manifest loads.

``manifest._parse`` checks the fields the engine is built from (``model_config``, graphs,
files, ...); this checks the rest the server reads later (``limits``, ``languages``,
``quality``, ``shortlist``), so that a mistyped one is refused with the version, never
found by ``ListModels`` or a request (a ``"languages": 5`` once answered INTERNAL there).
Each check raises ValueError naming the field, what it must be and the value.
"""

from __future__ import annotations

import math
from typing import Any, Callable

MAX_SOURCE_TOKENS = 100_000  # a sanity bound on ``limits.max_source_tokens``, far above any model's
DEFAULT_MAX_SOURCE_TOKENS = 200
MAX_DEPTH = 8  # ``quality`` and ``shortlist.bleu`` are trees of numbers this deep at most


def _shown(value: Any) -> str:
    return repr(value)[:80]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _object(raw: dict[str, Any], name: str) -> dict[str, Any] | None:
    """``raw[name]``: absent (None) or an object."""
    value = raw.get(name)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {_shown(value)}")
    return value


def _tree(value: Any, where: str, depth: int = 0) -> None:
    """Objects and lists whose leaves are strings, booleans or finite numbers (``quality``)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_DEPTH} deep")
    if isinstance(value, dict):
        for key, item in value.items():
            _tree(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _tree(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {_shown(value)}")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise ValueError(f"{where} must be an object, a string or a number, got {_shown(value)}")


def check_limits(raw: dict[str, Any]) -> int:
    """``limits.max_source_tokens``: an integer in 1 .. MAX_SOURCE_TOKENS (absent: 200)."""
    limits = _object(raw, "limits") or {}
    value = limits.get("max_source_tokens", DEFAULT_MAX_SOURCE_TOKENS)
    if not (_is_int(value) and 1 <= value <= MAX_SOURCE_TOKENS):
        raise ValueError(f"limits.max_source_tokens must be an integer from 1 to {MAX_SOURCE_TOKENS}, "
                         f"got {_shown(value)}")
    return value


def check_languages(raw: dict[str, Any]) -> None:
    """``languages``: {"source": code, "target": code}, or a list of codes."""
    value = raw.get("languages")
    if value is None:
        return
    if isinstance(value, dict):
        ok = all(isinstance(value.get(side, ""), str) for side in ("source", "target"))
    else:
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
    if not ok:
        raise ValueError('languages must be an object {"source": code, "target": code} or a list of '
                         f"codes, got {_shown(value)}")


def check_quality(raw: dict[str, Any]) -> None:
    """``quality``: a tree of numbers; ``quality.engine.<precision>.<search>.bleu`` a number
    (``Manifest.default_precision`` compares them)."""
    quality = _object(raw, "quality")
    if quality is None:
        return
    _tree(quality, "quality")
    engine = quality.get("engine")
    if engine is None:
        return
    _nested(engine, "quality.engine", lambda search, where: _bleu(search, where, "bleu"))


def check_shortlist(raw: dict[str, Any]) -> str | None:
    """``shortlist``: {"file": path, "bleu": {split: {search: {"full": n, "shortlist": n}}}};
    the file (checked inside the repository by the caller), or None."""
    shortlist = _object(raw, "shortlist")
    if shortlist is None:
        return None
    file = shortlist.get("file")
    if not isinstance(file, str) or not file:
        raise ValueError(f"shortlist.file must be a file name, got {_shown(file)}")
    if shortlist.get("bleu") is not None:
        _nested(shortlist["bleu"], "shortlist.bleu",
                lambda pair, where: [_bleu(pair, where, k) for k in ("full", "shortlist")])
    return file


def _nested(tree: Any, where: str, leaf: Callable[[Any, str], Any]) -> None:
    """``tree``: {a: {b: leaf}}, each level an object."""
    if not isinstance(tree, dict):
        raise ValueError(f"{where} must be an object, got {_shown(tree)}")
    for a, level in tree.items():
        if not isinstance(level, dict):
            raise ValueError(f"{where}.{a} must be an object, got {_shown(level)}")
        for b, item in level.items():
            if not isinstance(item, dict):
                raise ValueError(f"{where}.{a}.{b} must be an object, got {_shown(item)}")
            leaf(item, f"{where}.{a}.{b}")


def _bleu(item: dict[str, Any], where: str, key: str) -> None:
    if key in item and not _is_number(item[key]):
        raise ValueError(f"{where}.{key} must be a finite number, got {_shown(item[key])}")


def check(raw: dict[str, Any]) -> None:
    """Every descriptive field of a manifest; ValueError naming the first bad one."""
    check_limits(raw)
    check_languages(raw)
    check_quality(raw)
    check_shortlist(raw)
