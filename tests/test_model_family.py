"""The seeds' model family through the whole pipeline: every attention kind exports (fp32, int8),
verifies (parity, bit-exact batch invariance), and is served beside the others from one
repository directory; the bad inputs of the kinds are one line naming the value and the choices."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest

from conftest import _save_untrained
from export.data import tokenizers
from export.graphs.onnx_export import GRAPHS
from export.graphs.repository import export_repository
from harness import ServerThread, config_for
from service.decoding.engine import Engine
from service.errors import ModelRepositoryError
from service.models.attention import KINDS
from service.models.manifest import DECODER_INPUTS, ENCODER_OUTPUTS, MANIFEST, load_manifest
from service.proto.nmt.v1 import translation_pb2 as pb

# widths that are multiples of the vector width, as real models' are (see export.graphs.parity.check_padding)
SIZES = dict(emb_size=16, enc_hidden_size=16, dec_hidden_size=32, attn_size=32, out_size=16, dropout=0.0)
TEXTS = ["Open the file", "Save %s as {name}"]


@pytest.fixture(scope="module")
def family(tiny_tokenizers: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One repository directory holding a tiny untrained model of every kind: ``<kind>/1``."""
    from service.app import WARMUP_TEXT

    root = tmp_path_factory.mktemp("family")
    for kind in KINDS:
        for seed in range(10):  # an untrained model whose warm-up translation is not empty (served)
            checkpoint = _save_untrained(tiny_tokenizers, root / f"{kind}.pt", seed=seed, attention=kind, **SIZES)
            out = export_repository(checkpoint, root / "models" / kind / "1", name=kind, version="1",
                                    quantize=True, force=True)
            if all(Engine(out, precision=p).translate([WARMUP_TEXT])[0].hypotheses[0].text.strip()
                   for p in ("fp32", "int8")):
                break
    return root / "models"


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_exports_verifies_and_keeps_the_contract(family: Path, kind: str) -> None:
    manifest = load_manifest(family / kind / "1")
    assert manifest.attention == kind == manifest.model_config.attention
    for precision in ("fp32", "int8"):
        parity = manifest.raw["parity"][precision]
        assert parity["padding_max_abs_diff"] == 0.0  # bit-exact: alone or in a padded batch
        assert parity["dynamic_shapes_ran"] == 12
        if precision == "fp32":
            assert parity["greedy_identical_share"] >= 0.995
        step = onnx.load(str(family / kind / "1" / GRAPHS[precision]["decoder_step"]))
        assert [i.name for i in step.graph.input] == list(DECODER_INPUTS)  # even those it does not read
    engine = Engine(family / kind / "1", precision="fp32")
    ids = np.array([[5, 6, 7, 3]], dtype=np.int64)
    out = engine.runtime.encode(ids, np.array([4], dtype=np.int64))
    assert out.keys.shape == (1, 4, manifest.model_config.key_size)
    assert out.init_state.shape == (1, manifest.model_config.state_size)
    assert set(ENCODER_OUTPUTS) == {"annotations", "keys", "init_state"}


IN_PROCESS = ("--engine-process", "off")  # the in-process thread rule

def test_kinds_are_served_together_and_none_refuses_alignments(family: Path) -> None:
    engines = {kind: Engine(family / kind / "1", precision="int8") for kind in KINDS}
    with ServerThread(config_for(family, "--default-model", "bahdanau", "--precision", "int8")) as s:
        models = s.api.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert sorted((m.name, m.attention) for m in models) == sorted((k, k) for k in KINDS)
        assert models[0].name == "bahdanau" and models[0].is_default
        for kind in KINDS:
            reply = s.api.Translate(pb.TranslateRequest(texts=TEXTS, model=kind), timeout=60)
            alone = [engines[kind].translate([t])[0].hypotheses[0].text for t in TEXTS]
            assert [t.hypotheses[0].text for t in reply.translations] == alone  # each text as alone
            assert reply.model == kind
        aligned = s.api.Translate(pb.TranslateRequest(texts=TEXTS[:1], model="luong-dot", options=pb.DecodingOptions(
            return_attention=True)), timeout=60)
        alignments = aligned.translations[0].hypotheses[0].alignments
        assert alignments and all(abs(sum(a.weights) - 1) < 1e-3 for a in alignments)
        with pytest.raises(grpc.RpcError) as refused:
            s.api.Translate(pb.TranslateRequest(texts=TEXTS[:1], model="none", options=pb.DecodingOptions(
                return_attention=True)), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == ("options.return_attention must be false for model 'none/1' (its "
                                           "attention is 'none': no alignments), got True")
        assert s.api.Translate(pb.TranslateRequest(texts=TEXTS[:1], model="none"), timeout=60).translations


def test_engines_of_several_models_divide_the_cores_unless_threads_is_set(family: Path, monkeypatch) -> None:
    from service import app, process

    def threads(config) -> list[list[int]]:
        return [[s.get_session_options().intra_op_num_threads for s in (e.runtime.encoder, e.runtime.decoder)]
                for e in app.load_engines(config)]

    def pools(config) -> list[list[bool]]:  # use_per_session_threads
        return [[s.get_session_options().use_per_session_threads for s in (e.runtime.encoder, e.runtime.decoder)]
                for e in app.load_engines(config)]

    monkeypatch.setattr(process, "cores", lambda: (8, False))
    # (in process; with the engine process, the default on 2+ cores: tests/test_engine_process.py)
    assert threads(config_for(family, *IN_PROCESS)) == [[2, 2]] * 4  # 8 cores, 4 models
    assert threads(config_for(family, *IN_PROCESS, "--threads", "3")) == [[3, 3]] * 4  # asked: as asked
    assert threads(config_for(family / "none" / "1", *IN_PROCESS)) == [[0, 0]]  # one model: ONNX Runtime's default ...
    assert pools(config_for(family / "none" / "1", *IN_PROCESS)) == [[True, True]]  # a pool each outside `nmt serve`
    monkeypatch.setattr(process, "cores", lambda: (2, False))
    assert threads(config_for(family, *IN_PROCESS)) == [[1, 1]] * 4  # never below one
    monkeypatch.setattr(process, "cores", lambda: (3, True))  # a container limited to 3 cores
    assert threads(config_for(family / "none" / "1", *IN_PROCESS)) == [[3, 3]]  # one model: the limit, not the host


def test_a_containers_cpu_limit_is_read_from_its_cgroup(tmp_path: Path, monkeypatch) -> None:
    from service import process

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")  # 2.5 cores: 3 threads
    assert process.cpu_quota(v2) == 3
    (v2 / "cpu.max").write_text("max 100000\n")
    assert process.cpu_quota(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert process.cpu_quota(v1.parent) == 2
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert process.cpu_quota(v1.parent) is None
    assert process.cpu_quota(tmp_path / "nothing") is None
    monkeypatch.setattr(process, "cpu_quota", lambda: 1)
    assert process.cores() == (1, True)
    monkeypatch.setattr(process, "cpu_quota", lambda: 10_000)  # a limit above the CPU set: the set
    assert process.cores()[1] is False


def test_a_manifest_naming_an_unknown_kind_is_one_line(family: Path, tmp_path: Path) -> None:
    repo = shutil.copytree(family / "luong-general" / "1", tmp_path / "x" / "1")
    raw = json.loads((repo / MANIFEST).read_text())
    raw["model_config"]["attention"] = "luong-concat"
    (repo / MANIFEST).write_text(json.dumps(raw))  # manifest.json itself has no checksum
    with pytest.raises(ModelRepositoryError, match=r"model_config.attention must be one of bahdanau, "
                                                   r"luong-general, luong-dot, none; got 'luong-concat'"):
        load_manifest(repo)


def test_train_names_an_unknown_kind_and_a_resume_of_another_kind(tiny_corpus: Path, tiny_tokenizers: Path,
                                                                   tmp_path: Path, capsys) -> None:
    from export import cli
    from export.train import training as train

    with pytest.raises(SystemExit) as exit_:
        cli.train_main([str(tiny_corpus), "--tokenizers", str(tiny_tokenizers), "-o", str(tmp_path / "r"),
                        "--attention", "luong-concat"])
    assert exit_.value.code == 2
    assert ("argument --attention: invalid choice: 'luong-concat' (choose from 'bahdanau', 'luong-general', "
            "'luong-dot', 'none')") in capsys.readouterr().err
    config = train.TrainConfig(minutes=1, max_epochs=1, batch_tokens=200, bleu_slice=4, threads=1)
    run = tmp_path / "run"
    train.train(tiny_corpus, tiny_tokenizers, run, model_config=dict(SIZES, attention="none"), config=config,
                log=lambda *_: None)
    with pytest.raises(ValueError, match=r"last.pt: a run is resumed with its own settings; it has attention "
                                         r"'none' \(given 'luong-dot'\)"):
        train.train(tiny_corpus, tiny_tokenizers, run, model_config={"attention": "luong-dot"}, config=config,
                    resume=run / "last.pt", log=lambda *_: None)


def test_compare_writes_the_side_by_side_tables_and_figures(tiny_tokenizers: Path, tiny_corpus: Path,
                                                            tmp_path: Path) -> None:
    from export.evaluate.compare import compare, retime

    systems = {kind: _save_untrained(tiny_tokenizers, tmp_path / f"{kind}.pt", attention=kind, **SIZES)
               for kind in ("bahdanau", "none")}
    shutil.copy(tiny_corpus / "test.jsonl", tmp_path / "long.jsonl")  # a long set beside the test split
    corpus = shutil.copytree(tiny_corpus, tmp_path / "corpus")
    shutil.copy(tmp_path / "long.jsonl", corpus / "long.jsonl")
    results = compare(systems, corpus, tmp_path / "out", exclude_train=[], heatmaps=("Open the file",),
                      log=lambda *_: None)
    written = json.loads((tmp_path / "out" / "comparison.json").read_text())
    assert written == json.loads(json.dumps(results))
    for kind in systems:
        r = written["systems"][kind]
        assert r["attention"] == kind and r["parameters"] > 0 and r["step_ms"] > 0
        assert set(r["sets"]) == {"test", "long"} and set(r["sets"]["long"]) == {"greedy", "beam5"}
        assert sum(b["sentences"] for b in r["bleu_by_source_words"].values()) == 2 * written["sentences"]["test"]
    assert [h["translations"].keys() for h in written["heatmaps"]] == [{"bahdanau": None}.keys()]  # none has none
    for png in ("bleu-by-length.png", "attention-0.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
    assert "| bahdanau | bahdanau |" in (tmp_path / "out" / "comparison.md").read_text()
    retimed = retime(systems, tmp_path / "out", threads=1)  # --step-only: new step figures, the same scores
    assert all(retimed["systems"][k]["step_ms"] > 0 for k in systems)
    assert [{k: v for k, v in r.items() if k != "step_ms"} for r in retimed["systems"].values()] == \
        [{k: v for k, v in r.items() if k != "step_ms"} for r in written["systems"].values()]
    assert json.loads((tmp_path / "out" / "comparison.json").read_text()) == retimed
    with pytest.raises(ValueError, match=r"--system: .* compares \['bahdanau', 'none'\], got \['bahdanau'\]"):
        retime({"bahdanau": systems["bahdanau"]}, tmp_path / "out")
    other = tmp_path / "other_tokenizers"  # a system with other SentencePiece models (en-fr/1 beside v2's)
    tokenizers.train(corpus, other, src_vocab_size=70, tgt_vocab_size=70)
    systems["other"] = _save_untrained(other, tmp_path / "other.pt", **SIZES)
    again = compare(systems, corpus, tmp_path / "out2", exclude_train=[], heatmaps=("Open the file",),
                    log=lambda *_: None)
    assert again["systems"]["other"]["sets"]["test"]["beam5"]["sentences"] == written["sentences"]["test"]
    assert set(again["heatmaps"][0]["translations"]) == {"bahdanau", "other"}


@pytest.mark.parametrize("kind, sizes", [("bahdanau", SIZES), ("luong-general", {**SIZES, "emb_size": 32})])
def test_tied_embeddings_are_one_parameter_and_export_with_parity(family: Path, tiny_tokenizers: Path,
                                                                  tmp_path: Path, kind: str, sizes: dict) -> None:
    """``tie_embeddings``: the output layer's weights are the target embeddings, through a
    checkpoint's save and load, and the graphs verify as an untied model's do; the manifest
    says so (untied manifests do not carry the field)."""
    from export.train.checkpoint import load_checkpoint

    checkpoint = _save_untrained(tiny_tokenizers, tmp_path / "tied.pt", attention=kind, tie_embeddings=True, **sizes)
    decoder = load_checkpoint(checkpoint).model().decoder
    assert decoder.output.weight is decoder.embed.weight
    out = export_repository(checkpoint, tmp_path / "models" / "tied" / "1", name="tied", version="1",
                            quantize=True, force=True)
    manifest = load_manifest(out)
    assert manifest.model_config.tie_embeddings and manifest.raw["model_config"]["tie_embeddings"] is True
    for precision in ("fp32", "int8"):
        assert manifest.raw["parity"][precision]["padding_max_abs_diff"] == 0.0
    assert manifest.raw["parity"]["fp32"]["greedy_identical_share"] >= 0.995
    untied = load_manifest(family / kind / "1")
    assert not untied.model_config.tie_embeddings and "tie_embeddings" not in untied.raw["model_config"]
