"""Format directives of gettext's format flags (``c-format``, ``python-format``,
``python-brace-format``): a translation must keep its source's directives."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable


FORMAT_FLAGS = ("c-format", "python-format", "python-brace-format")
# Plural-Forms of the GNU gettext manual ("Plural forms"), for targets whose header lacks one.
_C = re.compile(r"%%|%(\d+\$)?[-+ #0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|Z|t)?"
                r"[diouxXeEfFgGaAcspnm]")
_PYTHON = re.compile(r"%%|%(\([^)]*\))?[-+ #0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?[hlL]?[diouxXeEfFgGcrsa]")
_BRACE = re.compile(r"\{\{|\}\}|\{([^{}!:]*)(?:![rsa])?(?::[^{}]*)?\}")


def directives(flag: str, text: str) -> list[tuple[str, bool]]:
    """The directives of ``text`` under ``flag``: (directive, may it move). C ``%1$s``,
    Python ``%(x)s`` and ``{name}``/``{0}`` name their argument, so they may reorder;
    ``%s`` and ``{}`` take the next argument, so their order is the arguments' order."""
    pattern = {"c-format": _C, "python-format": _PYTHON, "python-brace-format": _BRACE}[flag]
    found = []
    for m in pattern.finditer(text):
        if m.group(0) in ("%%", "{{", "}}"):
            continue
        found.append((m.group(0), bool(m.group(1))))
    return found


def format_problem(flags: Iterable[str], source: str, translation: str) -> tuple[str, str] | None:
    """Why ``translation`` would break one of the entry's format flags: (reason, details), or None."""
    for flag in (f for f in FORMAT_FLAGS if f in flags):
        want, got = directives(flag, source), directives(flag, translation)
        lost, invented = Counter(want) - Counter(got), Counter(got) - Counter(want)
        if lost or invented:
            changes = [f"{what} {_show(c)}" for what, c in (("loses", lost), ("invents", invented)) if c]
            return f"would break {flag}", f"would break {flag}: it {' and '.join(changes)}"
        if [d for d, free in want if not free] != [d for d, free in got if not free]:
            return f"would break {flag}", f"would break {flag}: it reorders {_show(Counter(want))}"
    return None


def _show(counts: Counter[tuple[str, bool]]) -> str:
    return ", ".join(d if n == 1 else f"{d} ({n} times)" for (d, _), n in counts.items())


# ---- lines: what is sent, and how the answers are put back ----
