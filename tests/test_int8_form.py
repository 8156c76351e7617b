"""The int8 products' form per CPU (service/decoding/int8_form.py): the decision from the CPU's
flags, the in-memory u8 -> s8 weight conversion, the known-answer check and its fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.decoding import int8_form, packed
from service.decoding.engine import Engine
from service.decoding.int8_form import FAST_FLAGS, FormChoice, Int8Form, cpu_flags, decide, to_s8

HERE_FAST = sorted(cpu_flags() & set(FAST_FLAGS))


@pytest.mark.parametrize("flags, form", [
    ({"sse4_2", "avx2", "fma"}, Int8Form.U8U8),  # Zen 3, Haswell..Skylake client
    ({"avx2", "avx512f", "avx512_vnni"}, Int8Form.U8S8),  # Zen 4/5, Cascade Lake
    ({"avx2", "avx_vnni"}, Int8Form.U8S8),  # Alder Lake
    ({"avx2", "avx512_vnni", "amx_int8", "amx_tile"}, Int8Form.U8S8),  # Sapphire Rapids
    (set(), Int8Form.U8U8),  # no /proc/cpuinfo
])
def test_auto_decides_from_the_cpu_flags(flags: set[str], form: Int8Form) -> None:
    chosen, why = decide(FormChoice.AUTO, flags)
    assert chosen is form
    assert why.startswith("no VNNI") == (form is Int8Form.U8U8)


def test_an_explicit_choice_wins_over_the_flags() -> None:
    assert decide(FormChoice.U8U8, {"avx512_vnni"})[0] is Int8Form.U8U8
    assert decide(FormChoice.U8S8, {"avx2"})[0] is Int8Form.U8S8


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_vnni\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_vnni"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def _product_graph(weight_u8: np.ndarray, zero_point: int = 128) -> onnx.ModelProto:
    """y = MatMulIntegerToFloat(a uint8 (rows, in), w uint8 (in, out)) with zero points 128."""
    k, n = weight_u8.shape
    inits = [numpy_helper.from_array(weight_u8, "w"), numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.full(n, 0.01, np.float32), "w_scale"),
             numpy_helper.from_array(np.array(128, np.uint8), "a_zero"),
             numpy_helper.from_array(np.array(zero_point, np.uint8), "w_zero")]
    node = helper.make_node("MatMulIntegerToFloat", ["a", "w", "one", "w_scale", "a_zero", "w_zero"], ["y"],
                            domain="com.microsoft")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, ["rows", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a})[0]


def test_to_s8_stores_the_same_integers_as_int8_with_zero_point_0() -> None:
    rng = np.random.default_rng(0)
    weight = rng.integers(1, 256, size=(32, 16)).astype(np.uint8)
    converted, changed = to_s8(_product_graph(weight))
    assert changed == 1
    inits = {t.name: numpy_helper.to_array(t) for t in converted.graph.initializer}
    assert inits["w"].dtype == np.int8
    np.testing.assert_array_equal(inits["w"].astype(np.int16), weight.astype(np.int16) - 128)
    [node] = converted.graph.node
    assert inits[node.input[5]].dtype == np.int8 and int(inits[node.input[5]]) == 0
    onnx.checker.check_model(converted)


def test_to_s8_leaves_a_product_whose_zero_point_is_not_128() -> None:
    weight = np.full((8, 4), 130, np.uint8)
    converted, changed = to_s8(_product_graph(weight, zero_point=127))
    assert changed == 0
    assert numpy_helper.to_array(converted.graph.initializer[0]).dtype == np.uint8


def test_small_products_agree_in_both_forms_on_every_cpu() -> None:
    """Activations near the zero point keep every 16-bit pair sum far from saturation: the two
    forms then compute the same integers even with AVX2's u8 x s8 kernel."""
    rng = np.random.default_rng(1)
    weight = rng.integers(128 - 20, 128 + 21, size=(64, 24)).astype(np.uint8)
    a = rng.integers(128 - 20, 128 + 21, size=(5, 64)).astype(np.uint8)
    model = _product_graph(weight)
    np.testing.assert_array_equal(_run(model, a), _run(to_s8(model)[0], a))


@pytest.mark.skipif(not HERE_FAST, reason="this CPU has no VNNI or AMX: its u8 x s8 kernel adds pairs in "
                    "saturating 16-bit lanes (AVX2), so the forms are not both exact here")
def test_full_range_products_bit_identical_where_the_cpu_is_exact() -> None:
    rng = np.random.default_rng(2)
    weight = rng.integers(1, 256, size=(256, 64)).astype(np.uint8)
    a = rng.integers(0, 256, size=(40, 256)).astype(np.uint8)
    model = _product_graph(weight)
    np.testing.assert_array_equal(_run(model, a), _run(to_s8(model)[0], a))


def test_known_answer_names_the_differing_output() -> None:
    same = int8_form.known_answer(lambda f: [f["x"]], lambda f: [f["x"].copy()], {"x": np.ones(3)})
    assert same is None
    differs = int8_form.known_answer(lambda f: [f["x"]], lambda f: [f["x"] + 1e-7], {"x": np.ones(3)})
    assert differs is not None and "output 0" in differs


def test_auto_serves_the_fast_form_only_on_a_fast_cpu(reversal_repository: Path) -> None:
    engine = Engine(reversal_repository, precision="int8")
    assert engine.int8_form == ("u8s8" if HERE_FAST else "u8u8")
    assert Engine(reversal_repository, precision="fp32").int8_form == ""


def test_a_failed_known_answer_check_falls_back_with_one_log_line(
        reversal_repository: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(int8_form, "known_answer", lambda *args: "output 0 differs (max |diff| 1)")
    with caplog.at_level(logging.WARNING, logger="nmt.int8"):
        engine = Engine(reversal_repository, precision="int8", int8_form=FormChoice.U8S8)
    assert engine.int8_form == "u8u8"
    assert "known-answer" in engine.runtime.int8_form_reason
    assert [r.message for r in caplog.records if "refused" in r.message] == [
        r.message for r in caplog.records if r.name == "nmt.int8"]
    assert len([r for r in caplog.records if r.name == "nmt.int8"]) == 1


def test_forced_u8s8_translates_as_u8u8_or_falls_back(reversal_repository: Path) -> None:
    """Asked for u8 x s8, the engine either serves it with u8 x u8's exact bits (VNNI, AMX) or
    refuses it (AVX2's saturating kernel); it never serves different translations."""
    texts = ["1 2 3 4 5", "9 8 7 6 5 4 3 2 1", "4 4 4"]
    shipped = Engine(reversal_repository, precision="int8", int8_form=FormChoice.U8U8)
    forced = Engine(reversal_repository, precision="int8", int8_form=FormChoice.U8S8)
    if forced.int8_form == "u8s8":
        feed = forced.runtime._step_feed()
        feed = packed.to_packed(feed) if forced.runtime.packed else feed
        for a, b in zip(shipped.runtime.decoder.run(None, feed), forced.runtime.decoder.run(None, feed)):
            np.testing.assert_array_equal(a, b)
    else:
        assert not HERE_FAST, "a CPU with VNNI or AMX refused u8s8"
    assert [t.hypotheses[0].text for t in forced.translate(texts)] == \
        [t.hypotheses[0].text for t in shipped.translate(texts)]


def test_the_flags_parse_into_the_config() -> None:
    from service.config import Int8Form as Form, Shortlist, parse

    default = parse(["--model-repository", "x"], env={})
    assert default.int8_form is Form.AUTO and default.shortlist is Shortlist.AUTO
    asked = parse(["--model-repository", "x", "--int8-form", "U8U8"], env={"NMT_SHORTLIST": "auto"})
    assert asked.int8_form is Form.U8U8 and asked.shortlist is Shortlist.AUTO


def test_the_served_form_is_reported_everywhere(reversal_repository: Path, tmp_path: Path) -> None:
    """ListModels, /v1/models and nmt_model_info name the int8 form and the shortlist."""
    import shutil
    import urllib.request

    from harness import ServerThread, config_for
    from service.proto.nmt.v1 import translation_pb2 as pb

    repo = tmp_path / "reversal" / "1"
    shutil.copytree(reversal_repository, repo)
    with ServerThread(config_for(repo, "--precision", "int8", "--int8-form", "u8u8")) as s:
        [info] = s.api.ListModels(pb.ListModelsRequest(), timeout=10).models
        assert (info.int8_form, info.shortlist) == ("u8u8", False)
        assert s.http("GET", "/v1/models").json()["models"][0]["int8_form"] == "u8u8"
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10).read().decode()
        assert 'int8_form="u8u8"' in text
