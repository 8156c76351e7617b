"""What ``bench_step.py`` times: the served step graphs, their product floors, realistic feeds.

Everything is built from a shipped model repository (int8 graphs only is enough)
as the server builds it: the int8 form this CPU runs (``service.decoding.int8_form``),
the full-vocabulary step and, where the repository has a shortlist, the shortlist
step (``service.decoding.shortlist``). A *product floor* is a graph of the step's
``MatMulIntegerToFloat`` nodes alone, in the same form, with the same weights and
the same row count (``export.graphs.int8_step.product_floor``): what the step
would cost if everything around its products were free. The shortlist step's
floor has the output product at the union's width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from export.graphs.int8_step import product_floor
from service.decoding import int8_form, shortlist
from service.decoding.engine import Engine
from service.decoding.runtime import _session_options, _step_feed
from service.decoding.shortlist import ShortlistChoice
from service.options import DecodingOptions

TOP_K = 10  # what a beam of 5 asks for (2 x beam)
Run = Callable[[], object]


def write_results(args: Any, r: dict, markdown: Callable[[dict, Any], str]) -> int:
    """``r`` with the CPU's flags and the int8 form ``args.repository`` is served in, written to ``args.out``
    (.json, and .md by ``markdown``) and the table printed: the end of a step benchmark's ``main``."""
    from service.decoding.int8_form import reported_flags

    r["cpu_flags"] = reported_flags()
    r["int8_form"] = str(Engine(args.repository, precision="int8", intra_op_threads=1).int8_form)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(r, indent=1) + "\n")
    text = markdown(r, args)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


@contextlib.contextmanager
def graph_middle() -> Iterator[None]:
    """Engines built inside serve the step's middle by the graph (``fused_middle`` not offered), to compare
    with the compiled middle; the rest as served."""
    from service.decoding import fused_middle

    offered, fused_middle.offered = fused_middle.offered, lambda: "the graph's middle, to compare with"
    try:
        yield
    finally:
        fused_middle.offered = offered


def engines(repository: Path, threads: int) -> dict[str, Engine]:
    """The served engine without and (where the repository has one) with its shortlist."""
    out = {"full": Engine(repository, precision="int8", intra_op_threads=threads, shortlist=ShortlistChoice.OFF)}
    if out["full"].manifest.raw.get("shortlist"):
        out["shortlist"] = Engine(repository, precision="int8", intra_op_threads=threads,
                                  shortlist=ShortlistChoice.ON)
    return out


def sources(path: Path | None, count: int, rng: np.random.Generator) -> list[str]:
    """``count`` test sources of 8 to 14 words (about 10 to 20 pieces), or digit strings."""
    if path is None:
        return [" ".join(str(d) for d in rng.integers(0, 10, 10)) for _ in range(count)]
    texts = [json.loads(line)["src_raw"] for line in path.read_text().splitlines() if line.strip()]
    texts = [t for t in texts if 8 <= len(t.split()) <= 14]
    return [texts[i] for i in rng.choice(len(texts), size=count, replace=len(texts) < count)]


def step_feed(engine: Engine, texts: list[str], *, beam: int) -> tuple[dict, object]:
    """The step inputs of a batch of ``texts`` at ``beam`` rows each, as the engine builds them
    after its first step (a real layout: encoder outputs, padding, candidates)."""
    batch = engine.new_batch()
    batch.add([((0, i), engine.prepare_text(t, DecodingOptions(beam_size=beam), i)) for i, t in enumerate(texts)])
    state = engine.runtime.host_state(batch._state)
    context = batch._context.device
    if context.slots is not None:  # a slotted store (``layout.SlottedContext``): the rows in order, as graphs take them
        context = dataclasses.replace(context, annotations=context.annotations[context.slots],
                                      keys=context.keys[context.slots], slots=None)
    feed = _step_feed(batch._prev, state, context, TOP_K)
    return feed, batch._candidates


def step_run(engine: Engine, feed: dict, candidates: object) -> Run:
    runtime = engine.runtime
    session = runtime.step_session("src_mask" not in feed, candidates)  # as served: packed where it pays
    full = feed if candidates is None else {**feed, **candidates.feed}
    outputs = ["topk_log_probs", "topk_ids", "next_state", "attention"]
    if hasattr(session, "product"):  # fused (service.decoding.fused): as a running batch steps, the
        product = session.product(full["state"])  # state's product carried from the step before
        return lambda: (session.keep(full["state"], product), session.run(outputs, full))
    return lambda: session.run(outputs, full)


def served_step_graph(engine: Engine, feed: dict | None = None) -> onnx.ModelProto:
    """The full step graph in the form this engine serves (int8 form, packed attention); for a
    ``feed`` without packed indices (a layout with little padding), the padded step it serves then."""
    if engine.runtime._step_model is not None and (feed is None or "src_mask" not in feed
                                                   or not engine.runtime.packed):
        return engine.runtime._step_model
    graph = onnx.load(str(engine.manifest.path(engine.manifest.graphs["int8"].decoder_step)))
    return int8_form.to_s8(graph)[0] if engine.int8_form == "u8s8" else graph


def floor_run(step: onnx.ModelProto, rows: int, threads: int, rng: np.random.Generator,
              *, output_width: int | None = None) -> Run:
    """The product floor of ``step`` at ``rows`` rows (``output_width``: the output product's
    weight cut to that many columns, as the shortlist step's)."""
    floor = product_floor(step)
    if output_width is not None:
        inits = {t.name: t for t in floor.graph.initializer}
        for name in (shortlist.WEIGHT, shortlist.SCALE):
            value = numpy_helper.to_array(inits[name])
            cut = value[..., :output_width]
            inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(cut), name))
        _loosen(floor)
    session = ort.InferenceSession(floor.SerializeToString(), _session_options(threads, spinning=True),
                                   providers=["CPUExecutionProvider"])
    inits = {t.name: t for t in floor.graph.initializer}
    feed = {node.input[0]: rng.integers(1, 256, size=(rows, inits[node.input[1]].dims[0])).astype(np.uint8)
            for node in floor.graph.node}
    return lambda: session.run(None, feed)


def _loosen(model: onnx.ModelProto) -> None:
    """Outputs of any width (the cut output product's)."""
    for value in model.graph.output:
        value.type.tensor_type.shape.dim[1].dim_param = "width"


def encoder_run(engine: Engine, texts: list[str]) -> Run:
    """One encoder run on ``texts``, padded as the batch pads them."""
    from service.decoding import layout

    ids = [engine.prepare_text(t, DecodingOptions(), i).source_ids for i, t in enumerate(texts)]
    src, lengths = layout.pad_sources(ids, engine.special.pad)
    return lambda: engine.runtime.encode(src, lengths)


def profile_ops(model: bytes, feed: dict, *, threads: int, runs: int = 100) -> dict[str, float]:
    """ONNX Runtime's profiler (``enable_profiling``): mean kernel ms per op type over ``runs``."""
    import collections
    import tempfile

    options = _session_options(threads, spinning=True)
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = str(Path(tmp) / "step")
        profiled = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            profiled.run(None, feed)
        events = json.loads(Path(profiled.end_profiling()).read_text())
    per_op: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"] / 1e3 / runs
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def profile_served(engine: Engine, feed: dict, *, threads: int, runs: int = 100, candidates=None) -> dict[str, float]:
    """``profile_ops`` of the step as this engine serves it for ``feed``'s layout. With the fused
    kernels (``service.decoding.fused``): the ops of its graphs together, and each compiled kernel as
    one entry (timed, not profiled: ONNX Runtime does not see them)."""
    import time

    from service.decoding import fused

    if engine.runtime.attention_form != "fused":
        return profile_ops(served_step_graph(engine, feed).SerializeToString(), feed, threads=threads, runs=runs)
    step = engine.runtime.step_session(False, candidates)
    feed = feed if candidates is None else {**feed, **candidates.feed}
    stages = step.stages(feed)
    ops: dict[str, float] = {}
    for name in ("attention kernel", "output kernel"):
        if name in stages:
            stages[name]()
            start = time.perf_counter()
            for _ in range(runs):
                stages[name]()
            ops[f"{name} (compiled, timed)"] = (time.perf_counter() - start) / runs * 1e3
    product = step.query.run(None, {"state": feed["state"]})[0]
    values = {**feed, fused.PRODUCT: product,
              fused.CONTEXT: np.zeros((len(feed["state"]), step.ctx_size), np.float32)}
    for graph in step.graphs.values():
        inputs = {i.name: values[i.name] for i in graph.graph.input}
        for op, ms in profile_ops(graph.SerializeToString(), inputs, threads=threads, runs=runs).items():
            ops[op] = ops.get(op, 0.0) + ms
    return dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def profile_table(a: dict[str, float], b: dict[str, float], names: tuple[str, str], top: int = 16) -> list[str]:
    """Two profiles (op -> ms) side by side as markdown rows, the largest ops first, and their totals."""
    lines = [f"| op | {names[0]} | {names[1]} |", "|---|---:|---:|"]
    for op in sorted(set(a) | set(b), key=lambda o: -max(a.get(o, 0), b.get(o, 0)))[:top]:
        lines.append(f"| {op} | {a.get(op, 0):.3f} | {b.get(op, 0):.3f} |")
    return lines + [f"| all | {sum(a.values()):.3f} | {sum(b.values()):.3f} |"]
