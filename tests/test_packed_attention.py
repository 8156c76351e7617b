"""Packed attention (``service.decoding.packed``): the int8 step scores real source positions
only, and gives the padded step's bits."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from service.decoding import packed
from service.decoding.engine import Engine
from service.decoding.layout import width
from service.options import DecodingOptions


def test_indices_cover_each_rows_run_rounded_to_four_and_mask_the_rest() -> None:
    got = packed.indices(np.array([3, 1, 6]), 8)
    # runs of 4, 4 and 8 positions; row r's column c lies at r * 8 + c of the flattened keys
    np.testing.assert_array_equal(got["key_rows"], [0] * 4 + [1] * 4 + [2] * 8)
    np.testing.assert_array_equal(got["key_index"], [0, 1, 2, 3, 8, 9, 10, 11, *range(16, 24)])
    n = 16  # a masked column reads position n: the appended NEG_LARGE
    np.testing.assert_array_equal(got["score_index"], [[0, 1, 2, n, n, n, n, n],
                                                       [4, n, n, n, n, n, n, n],
                                                       [8, 9, 10, 11, 12, 13, n, n]])


def test_runs_are_rounded_as_the_service_rounds_widths() -> None:
    from service.decoding import layout

    lengths = np.arange(1, 40)
    runs = np.bincount(packed.indices(lengths, layout.width(int(lengths.max())))["key_rows"])
    assert np.all(runs % layout.WIDTH_MULTIPLE == 0) and np.all(runs - lengths < layout.WIDTH_MULTIPLE)


def test_a_run_never_passes_the_columns() -> None:
    got = packed.indices(np.array([5, 2]), 5)  # 5 rounds up to 8 > 5 columns: cut to 5
    np.testing.assert_array_equal(got["key_rows"], [0] * 5 + [1] * 4)
    assert got["key_index"].max() < 2 * 5


def _sessions(repository: Path) -> tuple[Engine, ort.InferenceSession, ort.InferenceSession]:
    engine = Engine(repository, precision="int8", intra_op_threads=1, packed_attention=False,
                    fused_attention=False)
    step = onnx.load(str(engine.manifest.path(engine.manifest.graphs["int8"].decoder_step)))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    padded = ort.InferenceSession(step.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rewritten = packed.pack_attention(step)
    assert {i.name for i in rewritten.graph.input} == set(packed.step_inputs({i.name: [] for i in step.graph.input}))
    return engine, padded, ort.InferenceSession(rewritten.SerializeToString(), options,
                                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("seed", range(4))
def test_the_packed_step_gives_the_padded_steps_bits(reversal_repository: Path, seed: int) -> None:
    """Real encoder outputs of texts of mixed lengths, beams of 1 and 3, every output compared."""
    engine, padded, rewritten = _sessions(reversal_repository)
    rng = np.random.default_rng(seed)
    texts = [" ".join(str(d) for d in rng.integers(0, 10, int(n))) for n in rng.integers(1, 30, 9)]
    batch = engine.new_batch()
    batch.add([((0, i), engine.prepare_text(t, DecodingOptions(beam_size=1 + 2 * (i % 2)), i))
               for i, t in enumerate(texts)])
    context = batch._context.device
    assert context.packed is None and context.src_mask.shape[1] == width(int(context.src_mask.sum(1).max()))
    rows = len(batch._prev)
    feed = {"prev_tokens": rng.integers(0, engine.vocab_size, rows).astype(np.int64),
            "state": rng.uniform(-1, 1, (rows, engine.runtime.host_state(batch._state).shape[1])).astype(np.float32),
            "annotations": context.annotations, "keys": context.keys, "src_mask": context.src_mask,
            "k": np.array(6, dtype=np.int64)}
    names = [o.name for o in padded.get_outputs()]
    want = padded.run(names, feed)
    got = rewritten.run(names, packed.to_packed(feed))
    for name, a, b in zip(names, want, got):
        np.testing.assert_array_equal(a, b, err_msg=name)
    attention = dict(zip(names, got))["attention"]
    assert np.all(attention[~context.src_mask] == 0)  # masked columns get no weight


def test_the_engine_serves_packed_and_translates_as_the_padded_step(reversal_repository: Path) -> None:
    texts = ["1 2 3", "9 8 7 6 5 4 3 2 1 0 1 2 3 4 5 6 7 8 9", "4", "5 5 5 5 5 5 5"]
    padded = Engine(reversal_repository, precision="int8", intra_op_threads=1, packed_attention=False,
                    fused_attention=False)
    served = Engine(reversal_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    assert served.runtime.packed and not padded.runtime.packed
    assert "src_mask" not in {i.name for i in served.runtime.decoder.get_inputs()}
    for options in (DecodingOptions(), DecodingOptions(beam_size=4, num_hypotheses=2, return_attention=True)):
        a, b = padded.translate(texts, options), served.translate(texts, options)
        for x, y in zip(a, b):
            assert [(h.text, h.score) for h in x.hypotheses] == [(h.text, h.score) for h in y.hypotheses]
        alone = [served.translate([t], options)[0] for t in texts]  # a text alone or in the batch: same bits
        assert [[h.score for h in x.hypotheses] for x in alone] == [[h.score for h in y.hypotheses] for y in b]


def test_a_graph_the_rewrite_does_not_know_is_refused_by_name(reversal_repository: Path) -> None:
    engine = Engine(reversal_repository, precision="fp32", intra_op_threads=1)
    assert not engine.runtime.packed  # fp32 graphs (the traced step) run as exported
    traced = onnx.load(str(engine.manifest.path(engine.manifest.graphs["fp32"].decoder_step)))
    with pytest.raises(ValueError, match="keys|chain|Unsqueeze"):
        packed.pack_attention(traced)


def test_a_failed_known_answer_check_keeps_the_padded_step_with_one_log_line(
        reversal_repository: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(packed, "same_bits", lambda *args: "output 0 differs (max |diff| 1)")
    with caplog.at_level(logging.WARNING, logger="nmt.packed"):
        engine = Engine(reversal_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    assert not engine.runtime.packed
    assert "src_mask" in {i.name for i in engine.runtime.decoder.get_inputs()}
    assert [r.message for r in caplog.records if r.name == "nmt.packed"] == [
        "packed attention refused (output 0 differs (max |diff| 1)): the step scores every padded column"]
    assert engine.translate(["1 2 3"])[0].hypotheses[0].text


def test_the_benchmark_runs_on_a_repository_and_finds_the_same_bits(
        reversal_repository: Path, reversal_corpus: Path, tmp_path: Path) -> None:
    from loadtest import bench_packed

    out = tmp_path / "bench_packed"
    assert bench_packed.main([str(reversal_repository), "--texts", str(reversal_corpus / "test.jsonl"),
                              "--rows", "4", "12", "--draws", "2", "--rounds", "1", "--threads", "1",
                              "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    draws = [d for rows in result["rows"].values() for d in rows]
    assert len(draws) == 4 and all(d["bit_identical"] for d in draws)
    assert all(d["packed_share"] <= 1 and d["padded_ms"] > 0 and d["packed_ms"] > 0 for d in draws)
    assert all(d["served"] == ("packed" if d["packed_share"] <= packed.PACKED_SHARE_MAX else "padded") for d in draws)
    assert "Gather" in result["profile"]["packed"] and "Where" in result["profile"]["padded"]
    assert "| 12 | median |" in out.with_suffix(".md").read_text()


def test_the_shared_pool_is_the_servers_and_sessions_loaded_after_it_join_it(
        reversal_repository: Path, tmp_path: Path) -> None:
    """ONNX Runtime's global pools are process-wide and cannot be undone, so this runs in a
    process of its own: ``shared_pool`` only where ``nmt serve`` allowed it, then every later
    engine on the same pool (ONNX Runtime refuses pools of their own there) and the same bits."""
    script = f"""
import json
from pathlib import Path
from service import process
from service.config import parse
from service.decoding.engine import Engine
from service.decoding.sessions import global_pools
config = parse(["--model-repository", "{reversal_repository}"])
before = process.shared_pool(config, None)
own = Engine(Path("{reversal_repository}"), precision="int8", intra_op_threads=1)
texts = ["1 2 3", "9 8 7 6 5 4 3 2 1", "4 4"]
want = [t.hypotheses[0].score for t in own.translate(texts)]
with process.global_pools_allowed():
    inside = [process.shared_pool(config, None), process.shared_pool(config, 2),
              process.shared_pool(parse(["--model-repository", "{reversal_repository}", "--decoder-spinning", "off"]),
                                  None)]
    shared = Engine(Path("{reversal_repository}"), precision="int8", shared_pool=process.shared_pool(config, None))
after = process.shared_pool(config, None)
later = Engine(Path("{reversal_repository}"), precision="int8", intra_op_threads=1)
print(json.dumps({{"before": before, "after": after, "inside": inside, "global": global_pools(),
                  "pools": [e.runtime.decoder.get_session_options().use_per_session_threads
                            for e in (own, shared, later)],
                  "same": [[t.hypotheses[0].score for t in e.translate(texts)] == want for e in (shared, later)]}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"before": False, "after": False, "inside": [True, False, False], "global": True,
                   "pools": [True, False, False], "same": [True, True]}


def test_the_packed_step_serves_only_where_padding_is_skipped(reversal_repository: Path) -> None:
    """Rows of one length (little padding) take the padded step, mixed lengths the packed one
    (``packed.PACKED_SHARE_MAX``); a batch that moves between the two keeps its texts' bits."""
    assert packed.pays(np.array([3, 20, 2, 4]), 24)  # runs of 4, 20, 4, 4: 32 of 96 positions
    assert not packed.pays(np.array([8, 8, 7]), 12)  # 24 of 36
    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1, fused_attention=False)
    padded = Engine(reversal_repository, precision="int8", intra_op_threads=1, packed_attention=False,
                    fused_attention=False)

    def context(texts: list[str]):
        batch = engine.new_batch()
        batch.add([((0, i), engine.prepare_text(t, DecodingOptions(), i)) for i, t in enumerate(texts)])
        return batch._context.device

    same = context(["1 2 3 4 5 6 7", "7 6 5 4 3 2 1", "1 1 2 2 3 3 4"])
    assert same.packed is None and engine.runtime.step_session(False) is not engine.runtime.decoder
    assert context(["1", "2", "9 8 7 6 5 4 3 2 1 0 1 2 3 4 5 6 7 8 9 0 1 2 3"]).packed is not None
    # the long text outlives the short ones: the batch goes from packed to padded as they leave
    texts = ["1", "2 3", "9 8 7 6 5 4 3 2 1 0 1 2 3 4 5 6 7 8 9 0 1 2 3", "4 4"]
    for options in (DecodingOptions(), DecodingOptions(beam_size=3)):
        a, b = padded.translate(texts, options), engine.translate(texts, options)
        assert [[(h.text, h.score) for h in x.hypotheses] for x in a] == \
            [[(h.text, h.score) for h in x.hypotheses] for x in b]
