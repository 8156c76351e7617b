"""Placeholder protection for software messages.

Format directives (``%s``, ``%-7ld``, ``%(name)s``, ``{0}``, ``{name}``,
``$VAR``, ``<tag>``) must survive translation byte for byte. Before the model
sees a message each one is replaced by a reserved token ``｟k｠`` (k = order of
appearance in the source); after translation the tokens are put back. The
reserved tokens are user-defined symbols of the SentencePiece models, so they
are never split, and the model learns to move them as units.

Shared by the corpus builder (offline) and the server (online): torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from service.errors import invalid

MAX_PLACEHOLDERS = 16
"""Reserved tokens ``｟0｠`` .. ``｟15｠``. The server refuses a text with more placeholders
(``service.options``): past the limit a placeholder would be ordinary text, which the model
may drop or rewrite. The corpus builder drops such pairs."""

_OPEN, _CLOSE = "\uff5f", "\uff60"  # ｟ ｠: never seen in real messages

# Order matters: the first alternative that matches at a position wins.
# A literal reserved-token character in a message (``｟0｠``, a lone ``｠``) is a placeholder
# itself: left as it is, the tokenizer would read it as a reserved token, and restore() drops
# the tokens the source does not have, so the character would vanish.
_PATTERN = re.compile(
    r"""
      \uff5f[^\uff5f\uff60]{0,20}\uff60 | [\uff5f\uff60]   # ｟...｠, a lone ｟ or ｠: kept verbatim
    | %%                                            # literal percent
    | %\([A-Za-z_][\w.]*\)[-+#0]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]  # %(name)s
    | %(?:\d+\$)?[-+#0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|Z|t|I64|I32|I)?[diouxXeEfFgGcrsSpaAnm]
    | \{\{|\}\}                                     # escaped braces
    | \{[A-Za-z_0-9][\w.\[\]]*(?:![rsa])?(?::[^{}]*)?\}   # {0} {name} {x.attr!r:>10}
    | \$\{[A-Za-z_]\w*\}|\$[A-Za-z_]\w*             # ${VAR} $VAR
    | </?[A-Za-z][\w:.-]*(?:\s+[^<>]*?)?/?>         # <b> </a> <a href="..."> <br/>
    """,
    re.VERBOSE,
)
_TOKEN = re.compile(re.escape(_OPEN) + r"(\d+)" + re.escape(_CLOSE))


def token(index: int) -> str:
    """The reserved token for the placeholder at ``index``."""
    return f"{_OPEN}{index}{_CLOSE}"


def reserved_tokens() -> list[str]:
    """Every reserved token, for SentencePiece's ``user_defined_symbols``."""
    return [token(i) for i in range(MAX_PLACEHOLDERS)]


def find(text: str) -> list[str]:
    """The placeholders of ``text``, in order of appearance."""
    return [m.group(0) for m in _PATTERN.finditer(text)]


def check_count(text: str, field: str) -> None:
    """INVALID_ARGUMENT when ``text`` has more placeholders than there are reserved tokens:
    past them a placeholder would be ordinary text that the model may drop or rewrite, which
    breaks the promise that none is lost or invented. The client can split the message."""
    count = len(find(text))
    if count > MAX_PLACEHOLDERS:
        raise invalid(f"{field} placeholders", f"at most {MAX_PLACEHOLDERS} format placeholders "
                      "(the model's reserved tokens; split the message)", count)


@dataclass(frozen=True)
class Protected:
    """A message with its placeholders replaced by reserved tokens."""

    text: str  # the message with ``｟k｠`` in place of each placeholder
    placeholders: tuple[str, ...]  # placeholder k, verbatim from the source


def protect(text: str, unknown: Callable[[str], bool] | None = None) -> Protected:
    """Replace each placeholder of a source message by ``｟k｠``; with ``unknown`` (is this
    character one the source vocabulary has no piece for?), each run of such characters too
    (an emoji with its modifiers, a flag, a rare symbol), so that it survives translation in
    place instead of vanishing as ``<unk>``.

    Messages with more than ``MAX_PLACEHOLDERS`` placeholders keep the ones past
    the limit verbatim (they are then ordinary text): the server refuses such texts
    (``service.options``), the corpus builder drops them.
    """
    found: list[str] = []

    def repl(value: str) -> str:
        if len(found) >= MAX_PLACEHOLDERS:
            return value
        found.append(value)
        return token(len(found) - 1)

    out, at = [], 0
    for m in _PATTERN.finditer(text):
        out += [_unknown_runs(text[at:m.start()], unknown, repl), repl(m.group(0))]
        at = m.end()
    out.append(_unknown_runs(text[at:], unknown, repl))
    return Protected(text="".join(out), placeholders=tuple(found))


_JOINERS = re.compile("[\u200d\ufe0e\ufe0f\U0001f3fb-\U0001f3ff\U000e0020-\U000e007f]")
"""Characters that belong to the one before them (zero-width joiner, variation selectors, skin
tones, tag characters): kept in the same run as an unknown character."""


def _unknown_runs(segment: str, unknown: Callable[[str], bool] | None, repl: Callable[[str], str]) -> str:
    """``segment`` with each run of unknown characters (and their joiners) replaced by ``repl``."""
    if unknown is None or not segment:
        return segment
    out, run = [], ""
    for ch in segment:
        if run and _JOINERS.match(ch):
            run += ch
        elif not ch.isspace() and unknown(ch):
            run += ch
        else:
            if run:
                out.append(repl(run))
                run = ""
            out.append(ch)
    if run:
        out.append(repl(run))
    return "".join(out)


def protect_target(text: str, placeholders: tuple[str, ...]) -> str | None:
    """Replace a reference translation's placeholders with the source's tokens.

    The i-th occurrence of a placeholder string in the target takes the token of
    its i-th occurrence in the source. Returns None when the target's
    placeholders are not exactly the source's (as a multiset): such a pair
    would teach the model to drop or invent one.
    """
    used: set[int] = set()
    ok = True

    def repl(m: re.Match[str]) -> str:
        nonlocal ok
        for i, p in enumerate(placeholders):
            if p == m.group(0) and i not in used:
                used.add(i)
                return token(i)
        ok = False
        return m.group(0)

    out = _PATTERN.sub(repl, text)
    if not ok or len(used) != len(placeholders):
        return None
    return out


def restore(text: str, placeholders: tuple[str, ...], *, complete: bool = True) -> str:
    """Put the source's placeholders back in place of the reserved tokens.

    A token the source does not have is dropped (the model invented it), and
    so is a copy the model spelled out in pieces (``%`` then ``i``) of a source
    placeholder whose token it also wrote; spelled out in place of a token that
    never came, it stands for that placeholder where it is. Other text that
    looks like a placeholder (``5 $US``) is the model's French and is kept. With
    ``complete`` (a finished translation), a placeholder the output lost is
    appended at the end, so a translation never loses or invents a placeholder.
    Without it (an unfinished streaming prefix), the missing ones may still come.
    """
    parts = _TOKEN.split(text)  # text, token index, text, ...: no match spans a token
    present = {int(k) for k in parts[1::2]}
    seen: set[int] = set()
    invented = False

    def spelled(m: re.Match[str]) -> str:
        nonlocal invented
        same = [i for i, p in enumerate(placeholders) if p == m.group(0)]
        free = [i for i in same if i not in present and i not in seen]
        if not same or free:
            seen.update(free[:1])
            return m.group(0)
        invented = True
        return ""

    pieces = []
    for n, part in enumerate(parts):
        if n % 2 == 0:
            pieces.append(_PATTERN.sub(spelled, part))
        elif (k := int(part)) >= len(placeholders) or k in seen:
            invented = True
        else:
            seen.add(k)
            pieces.append(placeholders[k])
    out = "".join(pieces)
    if invented:
        out = re.sub(r"  +", " ", out).strip()
    missing = [p for k, p in enumerate(placeholders) if k not in seen]
    if missing and complete:
        out = " ".join([out.rstrip(), *missing])
    return out
