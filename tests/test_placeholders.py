"""Placeholder protection: every kind survives a round trip; nothing lost or invented."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.text import placeholders as ph


@pytest.mark.parametrize("text, found", [
    ("Delete %s files?", ["%s"]),
    ("size %-7ld bytes", ["%-7ld"]),
    ("Hello %(name)s, 100%% done", ["%(name)s", "%%"]),
    ("{0} of {count:>3}", ["{0}", "{count:>3}"]),
    ("Set $HOME or ${PATH}", ["$HOME", "${PATH}"]),
    ('Click <a href="%(url)s">here</a><br/>', ['<a href="%(url)s">', "</a>", "<br/>"]),
    ("%1$s and %2$d", ["%1$s", "%2$d"]),
    ("50% done, a < b > c", []),
])
def test_find_and_round_trip(text: str, found: list[str]) -> None:
    assert ph.find(text) == found
    prot = ph.protect(text)
    assert list(prot.placeholders) == found
    assert all(p not in prot.text for p in found if p != "%%")
    assert ph.restore(prot.text, prot.placeholders) == text


def test_target_uses_the_sources_tokens_in_any_order() -> None:
    prot = ph.protect("From %s to %d")
    assert ph.protect_target("Vers %d depuis %s", prot.placeholders) == "Vers ｟1｠ depuis ｟0｠"
    assert ph.protect_target("Depuis %s", prot.placeholders) is None  # lost one
    assert ph.protect_target("De %s à %d %x", prot.placeholders) is None  # invented one


def test_restore_never_loses_or_invents() -> None:
    values = ("%s", "{name}")
    assert ph.restore("a ｟1｠ b", values) == "a {name} b %s"  # lost ｟0｠: appended
    assert ph.restore("a ｟0｠ ｟7｠ ｟1｠", values) == "a %s {name}"  # invented ｟7｠: dropped
    assert ph.restore("｟0｠ ｟0｠ ｟1｠", values) == "%s {name}"  # duplicated: kept once
    # spelled out in pieces instead of a token (en-fr/3, beam 5, on '@i %i has @I @a value @i %N.')
    assert ph.restore("L'@i ｟0｠ a un @i @a %i %N.", ("%i",)) == "L'@i %i a un @i @a %N."
    assert ph.restore("Supprimer %s fichiers ?", ("%s",)) == "Supprimer %s fichiers ?"  # for the token: in place
    assert ph.restore("｟0｠ et %s", ("%s", "%s")) == "%s et %s"  # the second %s's token never came
    assert ph.restore("Il coûte 5 $US, {{ et }}", ()) == "Il coûte 5 $US, {{ et }}"  # not the source's: French
    # text around tokens that would read as one placeholder with them (en-fr/3 on a weechat help text)
    assert ph.restore("{if:$｟0｠==b=｟1｠:[｟2｠]}", ("{a}", "${b}", "${c}")) == "{if:${a}==b=${b}:[${c}]}"
    assert ph.restore("<b ｟0｠ c>", ("%s",)) == "<b %s c>"


def test_reserved_tokens_are_distinct() -> None:
    tokens = ph.reserved_tokens()
    assert len(set(tokens)) == ph.MAX_PLACEHOLDERS
    many = " ".join(f"%{i}$s" for i in range(1, ph.MAX_PLACEHOLDERS + 3))
    prot = ph.protect(many)
    assert len(prot.placeholders) == ph.MAX_PLACEHOLDERS
    assert ph.restore(prot.text, prot.placeholders) == many


def test_characters_the_vocabulary_lacks_are_protected_like_placeholders() -> None:
    unknown = {"😀", "👍", "🇫", "🇷", "☃"}.__contains__
    protected = ph.protect("Delete 😀 files 👍🏽 now 🇫🇷 and %s ☃", unknown)
    assert protected.text == "Delete ｟0｠ files ｟1｠ now ｟2｠ and ｟3｠ ｟4｠"
    assert protected.placeholders == ("😀", "👍🏽", "🇫🇷", "%s", "☃")  # the skin tone rides with its emoji
    assert ph.restore("Supprimer ｟0｠ fichiers ｟1｠ maintenant ｟2｠ et ｟3｠ ｟4｠", protected.placeholders) == (
        "Supprimer 😀 fichiers 👍🏽 maintenant 🇫🇷 et %s ☃")
    assert ph.protect("Delete 😀", None).text == "Delete 😀"  # without a vocabulary: as before


def test_the_engine_keeps_characters_it_has_no_piece_for(reversal_engine) -> None:
    translation = reversal_engine.translate(["1 😀 2 👍🏽 3"])[0]
    assert "｟0｠" in translation.source_tokens and "<unk>" not in translation.source_tokens
    text = translation.hypotheses[0].text
    assert "😀" in text and "👍🏽" in text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(alphabet="12 3\t\n%s{}<b>😀👍🏽é☃abc", max_size=20), min_size=1, max_size=4))
def test_the_tokenizer_looks_for_unknown_characters_unless_it_knows_them_all(reversal_engine, texts) -> None:
    """``Tokenizer.encode`` skips the per-character scan for texts of characters it has seen read by
    the model: the same ids, pieces and placeholders as protecting with the scan every time."""
    tok = reversal_engine.tokenizer
    for text in texts + texts:  # the second time round, its characters are known
        protected = ph.protect(text, tok.unknown)
        got = tok.encode(text)
        assert got.ids == tok.source.encode(protected.text) + [tok.special.eos]
        assert got.placeholders == protected.placeholders
        assert got.pieces == [tok.source.id_to_piece(i) for i in got.ids]
        assert tok.target_pieces(got.ids) == [tok.target.id_to_piece(i) for i in got.ids]
