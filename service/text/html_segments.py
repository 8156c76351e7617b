"""HTML in, HTML out: the text between tags translated, tags and attributes kept (LibreTranslate's
``format: html``).

``split`` parses a fragment (``html.parser``, forgiving) into runs of text and *inline* tags
(``<b>``, ``<a href=...>``, ``<code>``...) between *block* boundaries (``<p>``, ``<li>``,
``<br>``, comments, ``<script>``/``<style>`` content, which is never translated). A run with
words is one segment: a message whose inline tags the placeholder machinery
(``service.text.placeholders``) carries through translation verbatim, attributes included, so
``Click <a href="/x">here</a> now`` is translated as one sentence. A run with more placeholders
than the model has reserved tokens is translated piece by piece instead. ``Document.join``
puts the translations back, escaping the text (``&``, ``<``, ``>``) and nothing else.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from html.parser import HTMLParser

from service.text import placeholders

INLINE = frozenset("a abbr b bdi bdo cite code data dfn em font i kbd mark q s samp small span strong sub sup "
                   "time tt u var".split())
RAW_TEXT = frozenset({"script", "style", "textarea", "pre"})  # content kept as it is


@dataclass
class Document:
    """A parsed fragment: ``parts`` are markup (kept) or ``None`` slots, one per segment."""

    parts: list[str | None] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)  # the texts to translate, stripped
    edges: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # (lead, trail, tags)

    def join(self, translations: list[str]) -> str:
        """The fragment with segment ``k`` replaced by ``translations[k]``."""
        out, k = [], 0
        for part in self.parts:
            if part is not None:
                out.append(part)
                continue
            lead, trail, tags = self.edges[k]
            out.append(lead + _escape_text(translations[k], tags) + trail)
            k += 1
        return "".join(out)


def _escape_text(text: str, tags: tuple[str, ...]) -> str:
    """Escape ``text`` except the inline tags it carried (restored verbatim by the model)."""
    out, i = [], 0
    while i < len(text):
        hit = min(((text.find(t, i), t) for t in tags if text.find(t, i) >= 0), default=None)
        if hit is None:
            out.append(html.escape(text[i:], quote=False))
            break
        at, tag = hit
        out.append(html.escape(text[i:at], quote=False) + tag)
        i = at + len(tag)
    return "".join(out)


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.doc = Document()
        self.run: list[tuple[str, str]] = []  # ("text", unescaped) or ("tag", raw inline tag)
        self.raw_depth = 0

    def _flush(self) -> None:
        run, self.run = self.run, []
        text = "".join(value for _, value in run)
        tags = tuple(v for kind, v in run if kind == "tag")
        if not any(kind == "text" and value.strip() for kind, value in run):
            self.doc.parts.append(_escape_text(text, tags))
        elif len(placeholders.find(text)) >= placeholders.MAX_PLACEHOLDERS and len(run) > 1:
            for kind, value in run:  # too many for one message: piece by piece
                self.run = [(kind, value)]
                self._flush()
        else:
            stripped = text.strip()
            lead, trail = text[:len(text) - len(text.lstrip())], text[len(text.rstrip()):]
            self.doc.parts.append(None)
            self.doc.segments.append(stripped)
            self.doc.edges.append((_escape_text(lead, ()), _escape_text(trail, ()), tags))

    def _markup(self, raw: str) -> None:
        self._flush()
        self.doc.parts.append(raw)

    def handle_starttag(self, tag: str, attrs) -> None:
        raw = self.get_starttag_text() or f"<{tag}>"
        if tag in RAW_TEXT:
            self.raw_depth += 1
        if tag in INLINE and not self.raw_depth:
            self.run.append(("tag", raw))
        else:
            self._markup(raw)

    def handle_startendtag(self, tag: str, attrs) -> None:
        self._markup(self.get_starttag_text() or f"<{tag}/>")

    def handle_endtag(self, tag: str) -> None:
        if tag in RAW_TEXT and self.raw_depth:
            self.raw_depth -= 1
        if tag in INLINE and not self.raw_depth:
            self.run.append(("tag", f"</{tag}>"))
        else:
            self._markup(f"</{tag}>")

    def handle_data(self, data: str) -> None:
        if self.raw_depth:
            self._markup(data if self.cdata_elem else html.escape(data, quote=False))
        else:
            self.run.append(("text", data))

    def handle_comment(self, data: str) -> None:
        self._markup(f"<!--{data}-->")

    def handle_decl(self, decl: str) -> None:
        self._markup(f"<!{decl}>")

    def handle_pi(self, data: str) -> None:
        self._markup(f"<?{data}>")

    def unknown_decl(self, data: str) -> None:
        self._markup(f"<![{data}]>")


def split(fragment: str) -> Document:
    """Parse ``fragment`` into markup and the segments to translate."""
    parser = _Parser()
    parser.feed(fragment)
    parser.close()
    parser._flush()
    return parser.doc
