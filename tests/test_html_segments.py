"""``format: html``: the text between tags is what gets translated, inline tags ride along as
placeholders, block tags, comments and script content stay as they are."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.text import html_segments, language_id, placeholders


def test_inline_tags_stay_in_their_sentence_and_blocks_split() -> None:
    doc = html_segments.split('<p>Click <a href="/x?a=1&amp;b=2">here</a> to <b>save</b></p>'
                              '<ul><li>Open &amp; close</li><li> </li></ul><script>var s = "<b>x</b>";</script>')
    assert doc.segments == ['Click <a href="/x?a=1&amp;b=2">here</a> to <b>save</b>', "Open & close"]
    assert placeholders.find(doc.segments[0]) == ['<a href="/x?a=1&amp;b=2">', "</a>", "<b>", "</b>"]
    joined = doc.join(['Cliquez <a href="/x?a=1&amp;b=2">ici</a> pour <b>enregistrer</b>', "Ouvrir & fermer"])
    assert joined == ('<p>Cliquez <a href="/x?a=1&amp;b=2">ici</a> pour <b>enregistrer</b></p>'
                      '<ul><li>Ouvrir &amp; fermer</li><li> </li></ul><script>var s = "<b>x</b>";</script>')


def test_a_translation_that_writes_markup_is_escaped() -> None:
    doc = html_segments.split("<div>a</div>")
    assert doc.join(["<img src=x onerror=alert(1)>"]) == "<div>&lt;img src=x onerror=alert(1)&gt;</div>"


def test_too_many_tags_for_one_message_go_piece_by_piece() -> None:
    fragment = "".join(f"<b>w{i}</b> " for i in range(placeholders.MAX_PLACEHOLDERS))
    doc = html_segments.split(fragment)
    assert doc.segments == [f"w{i}" for i in range(placeholders.MAX_PLACEHOLDERS)]
    assert doc.join(doc.segments) == fragment


WORDS = st.sampled_from(["Open", "the", "file", "now", "%s", "{name}", "  ", "é"])
TAGS = st.sampled_from(["<b>", "</b>", '<a href="/x">', "</a>", "<p>", "</p>", "<br/>", "<li>", "<!-- c -->"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(WORDS, TAGS), max_size=30))
def test_joining_the_untranslated_segments_gives_the_fragment_back(parts: list[str]) -> None:
    fragment = " ".join(parts)
    doc = html_segments.split(fragment)
    assert doc.join(doc.segments) == fragment


def test_language_id_ranks_the_served_languages_only() -> None:
    assert language_id.rank("Delete the selected files from the disk", ["en", "fr"])[0].language == "en"
    assert language_id.rank("Supprimer les fichiers du disque", ["en", "fr"])[0].language == "fr"
    assert language_id.rank("Привет, как дела у тебя сегодня", ["en", "fr"]) == []
    tie = language_id.rank("OK", ["fr", "en"])  # nothing to go on: the first served language
    assert tie[0].language == "fr" and abs(sum(g.confidence for g in tie) - 100) < 0.2
