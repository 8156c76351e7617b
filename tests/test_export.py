"""Export and verification: a tiny model exported, verified, and each failure mode caught."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.cli import export_main, verify_main
from export.graphs import parity, quantize, verify
from export.graphs.repository import export_repository
from service.decoding.runtime import Runtime
from service.errors import ModelRepositoryError
from service.models.manifest import (DECODER_INPUTS, DECODER_OUTPUTS, ENCODER_INPUTS, ENCODER_OUTPUTS,
                              FORMAT, MANIFEST, checksums, load_manifest, write_manifest)


def copy_repo(repo: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(repo, tmp_path / "en-fr" / "1"))


def rechecksum(repo: Path) -> None:
    """Refresh the manifest's checksums after a deliberate edit (so only the edit is wrong)."""
    raw = json.loads((repo / MANIFEST).read_text())
    raw["files"] = checksums(repo, list(raw["files"]))
    write_manifest(repo, raw)


def failed(report: verify.Report) -> list[str]:
    return [c.name for c in report.checks if not c.ok]


def test_export_writes_the_contract(tiny_repository: Path) -> None:
    m = load_manifest(tiny_repository)  # every checksum matches
    raw = m.raw
    assert raw["format"] == FORMAT and (m.name, m.version) == ("en-fr", "1")
    assert set(m.graphs) == {"fp32", "int8"}
    assert m.graphs["int8"].decoder_step == "decoder_step.int8.onnx"
    assert sorted(m.files) == sorted(p.name for p in tiny_repository.iterdir() if p.name != MANIFEST)
    assert raw["io"]["decoder_step"] == {"inputs": DECODER_INPUTS, "outputs": DECODER_OUTPUTS}
    assert raw["io"]["encoder"] == {"inputs": ENCODER_INPUTS, "outputs": ENCODER_OUTPUTS}
    assert raw["opset"] in (17, 18) and raw["producer"]["torch"].startswith("2.")
    assert raw["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert raw["limits"] == {"max_source_tokens": 200} and raw["quality"] == {}
    assert Path(raw["checkpoint"]["file"]).name == "tiny.pt"
    fp32, int8 = raw["parity"]["fp32"], raw["parity"]["int8"]
    assert fp32["step_max_abs_diff"] <= 1e-4 and fp32["padding_max_abs_diff"] <= 1e-5
    assert fp32["greedy_identical_share"] >= 0.995 and fp32["greedy_source"] == "random sources"
    assert 0 < int8["step_max_abs_diff"] <= verify.TOLERANCES["int8"].step  # int8 really is quantized
    encoder = onnx.load(str(tiny_repository / "encoder.onnx"))
    dims = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in encoder.graph.input}
    assert dims == {"src_ids": ["batch", "src_len"], "src_lengths": ["batch"]}
    ops = {n.op_type for n in onnx.load(str(tiny_repository / "decoder_step.int8.onnx")).graph.node}
    assert "MatMulIntegerToFloat" in ops and "GRU" not in ops and "DynamicQuantizeLinear" not in ops
    assert raw["graphs"]["int8"]["scheme"] == quantize.SCHEME and "scheme" not in raw["graphs"]["fp32"]
    assert int8["padding_max_abs_diff"] == 0.0  # rows are quantized independently


def test_int8_step_is_batch_invariant(tiny_repository: Path) -> None:
    """A row decoded alone, or inside padded batches of any size, gives bit-identical outputs."""
    runtime = Runtime(load_manifest(tiny_repository), precision="int8", provider="cpu", intra_op_threads=1)
    rng = np.random.default_rng(5)
    src, lengths = verify.random_batch(rng, batch=9, src_len=11, vocab_size=40)  # (batch, src_len)
    annotations, keys, state = parity.encode(runtime, src, lengths)
    prev = rng.integers(verify.FIRST_ID, 40, size=len(src))  # (rows,)
    args = (prev, state, annotations, keys, src != 0)
    together = parity.run_step(runtime, *args, k=3)
    for rows in ([4], [4, 0], [7, 4, 2, 8]):  # row 4 alone, then among others in other orders
        part = parity.run_step(runtime, *(a[rows] for a in args), k=3)
        for name, value in part.items():
            assert np.array_equal(value[rows.index(4)], together[name][4]), name
    n = int(lengths[4])  # without the batch's padding too: its own source length
    enc_alone = parity.encode(runtime, src[4:5, :n], lengths[4:5])
    assert all(np.array_equal(a[0], t[4, :n]) for a, t in zip(enc_alone[:2], (annotations, keys)))
    alone = parity.run_step(runtime, prev[4:5], enc_alone[2], enc_alone[0], enc_alone[1], src[4:5, :n] != 0, k=3)
    for name in ("log_probs", "next_state", "topk_ids"):
        assert np.array_equal(alone[name][0], together[name][4]), name


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMax takes its axes as an attribute, then an input
def test_quantized_products_are_close_and_row_independent(opset: int) -> None:
    rng = np.random.default_rng(0)
    w_gemm, b_gemm = rng.normal(size=(24, 16)).astype(np.float32), rng.normal(size=24).astype(np.float32)
    w_mm, w_vec = rng.normal(size=(24, 12)).astype(np.float32), rng.normal(size=(12, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w_gemm", "b_gemm"], ["h"], transB=1),  # (rows, 24)
         helper.make_node("MatMul", ["h", "w_mm"], ["y"]),  # (rows, 12)
         helper.make_node("MatMul", ["y", "w_vec"], ["v"])],  # (rows, 1): stays fp32
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 16])],
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["rows", 1]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, ["rows", 24])],
        [numpy_helper.from_array(a, n) for a, n in
         ((w_gemm, "w_gemm"), (b_gemm, "b_gemm"), (w_mm, "w_mm"), (w_vec, "w_vec"))])
    model = quantize.quantize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node].count("MatMulIntegerToFloat") == 2
    assert model.graph.node[-1].op_type == "MatMul" and "w_vec" in model.graph.node[-1].input
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.normal(size=(6, 16)).astype(np.float32)
    x[2] *= 100.0  # a large row must not coarsen the others' quantization
    x[3] = 0.0  # an all-zero row (padding) gives exactly the bias, not NaN
    exact = (x @ w_gemm.T + b_gemm) @ w_mm @ w_vec
    got, h = session.run(None, {"x": x})
    assert np.allclose(got, exact, rtol=0.05, atol=0.05 * np.abs(exact[[0, 1, 4, 5]]).max())
    assert np.array_equal(h[3], b_gemm)
    for row in range(len(x)):
        assert np.array_equal(session.run(None, {"x": x[row:row + 1]})[0][0], got[row])


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_verify_passes_on_an_export(tiny_repository: Path, precision: str) -> None:
    report = verify.verify_repository(tiny_repository, precision=precision, seed=1)
    assert report.ok, report.table()
    names = [c.name for c in report.checks]
    for check in ("sha256", "onnx.checker", "dynamic axes", "step parity", "padding invariance"):
        assert check in names
    assert report.parity()["dynamic_shapes_ran"] == len(verify.GRID_BATCHES) * len(verify.GRID_SRC_LENS)


def test_verify_cli_prints_a_table(tiny_repository: Path, capsys: pytest.CaptureFixture) -> None:
    assert verify_main([str(tiny_repository), "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "step parity" in out and "FAIL" not in out and out.rstrip().endswith("verify: ok")


def test_onnx_greedy_matches_torch_on_the_tiny_corpus(tiny_repository: Path, tiny_corpus: Path) -> None:
    report = verify.verify_repository(tiny_repository, test_split=tiny_corpus / "test.jsonl",
                                      max_sentences=4)
    assert report.ok, report.table()
    assert report.parity()["greedy_sentences"] == 4 and report.parity()["greedy_source"] == "test.jsonl"


@pytest.mark.parametrize(("file", "edit", "message"), [
    ("source.model", lambda p: p.write_bytes(p.read_bytes() + b"x"), "source.model: sha256 mismatch"),
    ("decoder_step.int8.onnx", lambda p: p.unlink(), "decoder_step.int8.onnx: file listed in the manifest is missing"),
])
def test_tampered_or_missing_file_is_named(tiny_repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                           file: str, edit, message: str) -> None:
    repo = copy_repo(tiny_repository, tmp_path)
    edit(repo / file)
    with pytest.raises(ModelRepositoryError, match=message):
        verify.verify_repository(repo)
    assert verify_main([str(repo)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_frozen_batch_axis_fails_dynamic_axes(tiny_repository: Path, tmp_path: Path) -> None:
    repo = copy_repo(tiny_repository, tmp_path)
    model = onnx.load(str(repo / "encoder.onnx"))
    for value in model.graph.input:
        value.type.tensor_type.shape.dim[0].dim_value = 2  # what a batch-of-two trace can leave behind
    onnx.save(model, str(repo / "encoder.onnx"))
    rechecksum(repo)
    report = verify.verify_repository(repo)
    assert "dynamic axes" in failed(report)
    assert "fixed to 2" in next(c.figure for c in report.checks if c.name == "dynamic axes")
    assert verify_main([str(repo), "--precision", "fp32"]) == 1


def test_perturbed_weights_fail_parity(tiny_repository: Path, tmp_path: Path) -> None:
    repo = copy_repo(tiny_repository, tmp_path)
    model = onnx.load(str(repo / "decoder_step.onnx"))
    matrices = [t for t in model.graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT]
    weight = matrices[-1]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    onnx.save(model, str(repo / "decoder_step.onnx"))
    rechecksum(repo)
    report = verify.verify_repository(repo)
    assert "step parity" in failed(report) and "onnx.checker" not in failed(report)
    assert report.parity()["step_max_abs_diff"] > verify.TOLERANCES["fp32"].step


def test_refuses_to_overwrite_without_force(tiny_repository: Path, tiny_checkpoint: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    before = (tiny_repository / MANIFEST).read_bytes()
    with pytest.raises(FileExistsError, match=f"{tiny_repository}: already exists"):
        export_repository(tiny_checkpoint, tiny_repository)
    assert export_main([str(tiny_checkpoint), "--output", str(tiny_repository)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists (use --force" in err
    assert (tiny_repository / MANIFEST).read_bytes() == before


def test_force_replaces_and_leaves_no_temporaries(tiny_checkpoint: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "en-fr" / "1"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("old")
    assert export_main([str(tiny_checkpoint), "--output", str(out), "--force", "--version", "7"]) == 0
    assert "exported" in capsys.readouterr().out
    assert load_manifest(out).version == "7" and set(load_manifest(out).graphs) == {"fp32"}
    assert not (out / "stale.txt").exists()
    assert [p.name for p in out.parent.iterdir()] == ["1"]


def test_failed_verification_writes_nothing(tiny_checkpoint: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    strict = verify.Tolerances(encoder=1e-4, step=0.0, padding=1e-5, greedy=0.995)
    monkeypatch.setitem(verify.TOLERANCES, "fp32", strict)  # no real graph differs by exactly 0
    out = tmp_path / "en-fr" / "1"
    with pytest.raises(verify.VerificationError, match=r"en-fr/1: export failed verification: step parity"):
        export_repository(tiny_checkpoint, out)
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(("content", "message"), [
    (None, "nope.pt: checkpoint does not exist"),
    (b"not a checkpoint", "nope.pt: not a PyTorch checkpoint"),
    ({"kind": "someone-else/v3", "weights": {}}, "nope.pt: not an nmt-serve RNNsearch checkpoint"),
])
def test_missing_or_foreign_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   content, message: str) -> None:
    path = tmp_path / "nope.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    out = tmp_path / "en-fr" / "1"
    assert export_main([str(path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nmt export: error: ") and err.count("\n") == 1 and message in err
    assert not out.parent.exists()


def test_verify_rejects_a_foreign_checkpoint(tiny_repository: Path, other_checkpoint: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    assert verify_main([str(tiny_repository), "--checkpoint", str(other_checkpoint)]) == 2
    assert "model config differs" in capsys.readouterr().err


@pytest.fixture
def other_checkpoint(tiny_tokenizers: Path, tmp_path: Path) -> Path:
    """A valid checkpoint of other sizes than the tiny model (no training needed)."""
    from conftest import _save_untrained

    return _save_untrained(tiny_tokenizers, tmp_path / "other.pt", emb_size=8, enc_hidden_size=8,
                           dec_hidden_size=8, attn_size=8, out_size=4, dropout=0.0)


@pytest.mark.slow
def test_reversal_model_parity_on_its_test_split(reversal_repository: Path) -> None:
    parity = load_manifest(reversal_repository).raw["parity"]
    assert parity["fp32"]["greedy_source"] == "test.jsonl" and parity["fp32"]["greedy_sentences"] == 300
    assert parity["fp32"]["greedy_identical_share"] >= 0.995
    assert parity["fp32"]["step_max_abs_diff"] <= 1e-4 and parity["fp32"]["padding_max_abs_diff"] <= 1e-5
    assert np.isfinite(parity["int8"]["greedy_identical_share"])
