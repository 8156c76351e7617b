"""The lexical shortlist: built from a corpus (export/graphs/shortlist.py), served by rewriting
the int8 step's output layer (service/decoding/shortlist.py), decided by --shortlist."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from export.graphs import shortlist as build
from service.decoding import shortlist
from service.decoding.engine import Engine
from service.decoding.shortlist import ShortlistChoice, candidates, decide, shortlist_graph
from service.errors import ModelRepositoryError
from service.models.manifest import load_manifest
from service.options import DecodingOptions

TEXTS = ["1 2 3 4 5", "9 8 7 6 5 4 3 2 1", "4 4 4", "0 1 0 1 7 7"]


@pytest.fixture(scope="module")
def shortlisted(reversal_repository: Path, reversal_corpus: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Path:
    """The reversal repository with a deliberately short list (3 per piece, 2 frequent)."""
    repo = tmp_path_factory.mktemp("shortlisted") / "reversal" / "1"
    shutil.copytree(reversal_repository, repo)
    build.write(repo, reversal_corpus, build.ShortlistConfig(per_source=3, frequent=2, min_count=1))
    return repo


def test_cooccurrence_counts_each_pair_once_per_sentence_pair() -> None:
    counts = build.cooccurrence([[1, 1, 2], [2]], [[3, 0], [3, 3]], src_vocab=3, tgt_vocab=4)
    assert counts[1, 3] == 1 and counts[1, 0] == 1 and counts[2, 3] == 2 and counts[0].sum() == 0


def test_build_ranks_specific_translations_first() -> None:
    # piece 1 always brings target 5; target 0 co-occurs with everything (frequent, not specific)
    src = [[1, 2]] * 4 + [[2]] * 6
    tgt = [[5, 0]] * 4 + [[0]] * 6
    counts = build.cooccurrence(src, tgt, 3, 6)
    target_counts = np.bincount(np.concatenate(tgt), minlength=6)
    offsets, ids, frequent = build.build(counts, target_counts, build.ShortlistConfig(per_source=1, frequent=1))
    assert list(ids[offsets[1]:offsets[2]]) == [5]
    assert list(frequent) == [0]
    assert offsets[0] == 0 and offsets[-1] == len(ids) and len(offsets) == 4


def test_write_records_the_file_with_its_checksum(shortlisted: Path) -> None:
    manifest = load_manifest(shortlisted)  # verifies every sha256, shortlist.npz included
    record = manifest.raw["shortlist"]
    assert record["file"] in manifest.files and record["per_source"] == 3
    assert 0 < record["valid"]["reference_pieces_covered"] <= 1
    with (shortlisted / record["file"]).open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
    broken = shortlisted.parent.parent / "broken" / "1"
    shutil.copytree(shortlisted, broken)
    with (broken / record["file"]).open("r+b") as f:
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ModelRepositoryError, match="shortlist.npz: sha256 mismatch"):
        load_manifest(broken)


@pytest.mark.parametrize("choice, record, precision, on", [
    (ShortlistChoice.AUTO, None, "int8", False),
    (ShortlistChoice.AUTO, {"file": "s.npz"}, "int8", False),  # no BLEU measured
    (ShortlistChoice.ON, {"file": "s.npz"}, "int8", True),
    (ShortlistChoice.ON, {"file": "s.npz"}, "fp32", False),
    (ShortlistChoice.OFF, {"file": "s.npz"}, "int8", False),
])
def test_decide(choice: ShortlistChoice, record: dict | None, precision: str, on: bool) -> None:
    assert decide(choice, record, precision=precision)[0] is on


def _bleu(loss: float) -> dict:
    pair = {"full": 40.0, "shortlist": 40.0 - loss}
    return {"file": "s.npz", "bleu": {s: {"greedy": pair, "beam5": pair} for s in ("test", "long")}}


def test_auto_is_on_only_within_0_3_bleu() -> None:
    assert decide(ShortlistChoice.AUTO, _bleu(0.3), precision="int8")[0] is True
    on, why = decide(ShortlistChoice.AUTO, _bleu(0.31), precision="int8")
    assert on is False and "0.31" in why


def test_candidates_mask_each_row_to_its_own_text(shortlisted: Path) -> None:
    _, layer = shortlist_graph(onnx.load(str(shortlisted / "decoder_step.int8.onnx")))
    texts = [np.array([3, 5, 7]), np.array([5, 9])]
    c = candidates(layer, texts, [2, 1], pad_id=0)
    assert c.gathered and c.width % shortlist.ALIGN == 0
    union = list(c.feed["candidates"][:4])
    assert union == [3, 5, 7, 9]
    bias = c.feed["row_bias"]  # (rows, width)
    assert bias.shape == (3, c.width)
    assert [list(np.flatnonzero(row > shortlist.NEG_LARGE)) for row in bias] == [[0, 1, 2], [0, 1, 2], [1, 3]]
    np.testing.assert_array_equal(bias[2, [1, 3]], layer.bias[[5, 9]])
    np.testing.assert_array_equal(c.feed["shortlist_weight"], layer.weight[:, c.feed["candidates"]])
    wide = candidates(layer, [np.arange(len(layer.scale))], [1], pad_id=0)
    assert not wide.gathered and wide.width == len(layer.scale)


def test_every_candidate_gives_the_full_vocabularys_answer(reversal_repository: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A list holding every piece changes nothing: per row, gathered or masked, the tokens are the full
    vocabulary's, and the log-probabilities agree to rounding."""
    from service.decoding import shortlist_rows

    engine = Engine(reversal_repository, precision="int8", shortlist=ShortlistChoice.OFF)
    everything = shortlist.Shortlist(offsets=np.zeros(41, np.int64), ids=np.zeros(0, np.int32),
                                     always=np.arange(engine.vocab_size))
    full = [t.hypotheses[0].tokens for t in engine.translate(TEXTS, DecodingOptions(beam_size=3))]
    load_rows = shortlist_rows.load
    for share, rows in ((1.0, True), (1.0, False), (0.0, False)):  # per row, gathered, then masked
        monkeypatch.setattr(shortlist, "MAX_GATHERED_SHARE", share)
        monkeypatch.setattr(shortlist_rows, "load", load_rows if rows else lambda *a, **k: None)
        listed = Engine(reversal_repository, precision="int8", shortlist=ShortlistChoice.OFF)
        listed.runtime.shortlist = everything
        listed.runtime._use_shortlist(str(reversal_repository / "decoder_step.int8.onnx"), everything,
                                      options=listed.runtime.decoder.get_session_options(),
                                      providers=["CPUExecutionProvider"])
        assert listed.runtime.shortlist_rows is rows
        batch = listed.new_batch()
        batch.add([((0, 0), listed.prepare_text(TEXTS[0], DecodingOptions(), 0))])
        assert batch._candidates is not None and batch._candidates.per_row is rows
        assert batch._candidates.gathered is (share == 1.0 and not rows)
        assert [t.hypotheses[0].tokens for t in listed.translate(TEXTS, DecodingOptions(beam_size=3))] == full


def test_tokens_stay_inside_each_texts_candidates(shortlisted: Path) -> None:
    engine = Engine(shortlisted, precision="int8", shortlist=ShortlistChoice.ON)
    assert engine.shortlist
    lists = engine.runtime.shortlist
    for text, result in zip(TEXTS, engine.translate(TEXTS, DecodingOptions(beam_size=2, num_hypotheses=2))):
        allowed = set(lists.of_text(engine.tokenizer.encode(text).ids).tolist())
        for hypothesis in result.hypotheses:
            ids = [engine.tokenizer.target.piece_to_id(p) for p in hypothesis.tokens]
            assert set(ids) <= allowed, (text, hypothesis.tokens)


def test_a_text_decodes_the_same_alone_and_in_a_batch(shortlisted: Path) -> None:
    engine = Engine(shortlisted, precision="int8", shortlist=ShortlistChoice.ON)
    for beam in (1, 3):
        options = DecodingOptions(beam_size=beam)
        together = [t.hypotheses[0].tokens for t in engine.translate(TEXTS, options)]
        alone = [engine.translate([text], options)[0].hypotheses[0].tokens for text in TEXTS]
        assert together == alone


def test_auto_follows_the_recorded_bleu(shortlisted: Path, tmp_path: Path) -> None:
    assert not Engine(shortlisted, precision="int8").shortlist  # auto by default: no BLEU recorded
    assert not Engine(shortlisted, precision="int8", shortlist=ShortlistChoice.OFF).shortlist
    repo = tmp_path / "reversal" / "1"
    shutil.copytree(shortlisted, repo)
    manifest = json.loads((repo / "manifest.json").read_text())
    manifest["shortlist"]["bleu"] = _bleu(0.1)["bleu"]
    (repo / "manifest.json").write_text(json.dumps(manifest))
    engine = Engine(repo, precision="int8", shortlist=ShortlistChoice.AUTO)
    assert engine.shortlist and "within" in engine.shortlist_reason
    assert not Engine(repo, precision="fp32", shortlist=ShortlistChoice.AUTO).shortlist


def test_listmodels_says_whether_the_shortlist_serves(shortlisted: Path) -> None:
    from harness import ServerThread, config_for
    from service.proto.nmt.v1 import translation_pb2 as pb

    for flag, on in (("on", True), ("off", False)):
        with ServerThread(config_for(shortlisted, "--precision", "int8", "--shortlist", flag)) as s:
            [info] = s.api.ListModels(pb.ListModelsRequest(), timeout=10).models
            assert info.shortlist is on
            assert s.api.Translate(pb.TranslateRequest(texts=["1 2 3"]), timeout=30).translations


@settings(max_examples=60, deadline=None)
@given(lists=st.lists(st.lists(st.integers(0, 300), max_size=12), min_size=1, max_size=30),
       pieces=st.lists(st.integers(-3, 35), max_size=20), own=st.booleans())
def test_a_texts_words_are_the_union_of_its_pieces_lists_compiled_or_not(lists, pieces, own) -> None:
    """``Shortlist.of_text``: the compiled union (``shortlist_words.c``) gives numpy's answer, ascending and
    without repeats, pieces outside the table bringing nothing; ``own`` leaves the always-words out."""
    module = shortlist
    compiled = pytest.importorskip("service.decoding._attention", reason="installed without a C compiler")
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids in lists])]).astype(np.int64)
    table = module.Shortlist(offsets=offsets, ids=np.array([i for ids in lists for i in ids], np.int32),
                             always=np.array([0, 5, 299], np.int64))
    got = table.of_text(tuple(pieces), own=own)
    want = set().union(*(lists[p] for p in pieces if 0 <= p < len(lists)))
    want = sorted(want - {0, 5, 299} if own else want | {0, 5, 299})
    assert got.dtype == (np.int32 if own else np.int64)
    assert got.tolist() == want
    try:
        module._attention = None
        assert module.Shortlist(offsets=offsets, ids=table.ids, always=table.always).of_text(pieces, own=own).tolist() == want
    finally:
        module._attention = compiled


def test_a_list_outside_the_table_is_refused_naming_it() -> None:
    compiled = pytest.importorskip("service.decoding._attention", reason="installed without a C compiler")
    with pytest.raises(ValueError, match="piece 1's list \\(offsets 2 to 9\\) must lie within the 3 ids"):
        compiled.shortlist_words(np.array([0, 2, 9], np.int64), np.array([1, 2, 3], np.int32), [1], np.empty(8, np.int32))
    with pytest.raises(ValueError, match="ids holds 8, not a word below out's 8"):
        compiled.shortlist_words(np.array([0, 1], np.int64), np.array([8], np.int32), [0], np.empty(8, np.int32))
