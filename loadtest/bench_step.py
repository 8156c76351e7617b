"""Decoder-step latency: fp32 vs int8 ONNX Runtime vs PyTorch eager, side by side.

    python loadtest/bench_step.py models/en-fr/1 [--checkpoint PATH] [--old-int8 GRAPH]
        [--old-int8-encoder GRAPH] [--encoder-batches 32] [--rows 32 160 512] [--src-len 20]
        [--threads 2] [--rounds 7] [--steps 30] [--no-bf16] [--clock wall|cpu] [--profile ROWS]

One decoder step (log-probs, top-k, next state, attention) at each row count
(160 rows = a batch of 32 texts at beam 5), as the engine runs it: the ONNX
side is ``service.decoding.runtime.Runtime.step`` with the serving session options.
PyTorch runs ``step_log_probs`` + top-k under ``inference_mode`` with the same
thread count. The engines take turns in blocks of ``--steps`` steps (the first
few of a block discarded: the other engine's idle threads may still be
spinning), for ``--rounds`` rounds; reported: the median over rounds of each
block's median. This is the ceiling of any engine-level speed-up: the rest of
decoding (search, tokenization) is the same work on both sides. Writes
``bench_step.md`` and ``bench_step.json``.

Also timed, in the same rotation: PyTorch with bf16 weights and activations
(``model.to(torch.bfloat16)``); ``--old-int8``, another int8 step graph (e.g.
the previous export, ``git show HEAD~1:models/en-fr/1/decoder_step.int8.onnx``)
run the same way; and each int8 graph's *matrix-product floor*: its
``MatMulIntegerToFloat`` nodes alone (``export.int8_step.product_floor``: same
weights, same shapes, uint8 inputs at the same row count, same session
options), what the step would cost if everything around the products were
free. The report gives step / floor for each int8 graph. Then the encoders
(each precision's, and ``--old-int8-encoder``) at ``--encoder-batches``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from export.checkpoint import load_checkpoint
from export.int8_step import product_floor
from export.parity import encode
from export.verify import FIRST_ID, random_batch
from service.models.manifest import DECODER_INPUTS, load_manifest
from service.decoding.runtime import Runtime, _session_options
from service.text.tokenizer import EOS_ID, PAD_ID

TOP_K = 10  # what a beam of 5 asks for (2 x beam)
WARMUP = 3  # steps discarded at the start of each block


def step_inputs(runtime: Runtime, *, rows: int, src_len: int, vocab_sizes: tuple[int, int],
                rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Realistic step inputs: the fp32 encoder's outputs on random sources with one
    masked column, as the engine's batches have (``service.decoding.layout.PAD_COLUMNS``)."""
    src = rng.integers(FIRST_ID, vocab_sizes[0], size=(rows, src_len + 1))  # (rows, src_len + 1)
    src[:, src_len - 1], src[:, src_len] = EOS_ID, PAD_ID
    lengths = np.full(rows, src_len, dtype=np.int64)
    annotations, keys, state = encode(runtime, src, lengths)  # (rows, src_len + 1, ctx_size), ...
    return {"prev_tokens": rng.integers(FIRST_ID, vocab_sizes[1], size=rows).astype(np.int64),
            "state": state, "annotations": annotations, "keys": keys, "src_mask": src != PAD_ID}


FLOOR = "floor"  # name prefix of a matrix-product floor
STEP_OUTPUTS = ["topk_log_probs", "topk_ids", "next_state", "attention"]  # what the engine fetches


def floor_session(step_graph: Path, threads: int) -> ort.InferenceSession:
    """The int8 step's products alone, with the decoder's serving session options."""
    model = product_floor(onnx.load(str(step_graph)))
    return ort.InferenceSession(model.SerializeToString(), _session_options(threads, spinning=True),
                                providers=["CPUExecutionProvider"])


def engines(repo: Path, checkpoint: Path | None, threads: int, *, old_int8: Path | None = None,
            bf16: bool = True) -> dict[str, Callable[[dict], object]]:
    """name -> one decoder step on a feed dict (floors: their products on uint8 inputs)."""
    manifest = load_manifest(repo)
    out: dict[str, Callable[[dict], object]] = {}
    for precision in manifest.graphs:
        runtime = Runtime(manifest, precision=precision, provider="cpu", intra_op_threads=threads)

        def onnx_step(f: dict, runtime: Runtime = runtime) -> object:
            context = runtime.context(f["annotations"], f["keys"], f["src_mask"])
            return runtime.step(f["prev_tokens"], f["state"], context, TOP_K)

        out[f"onnx {precision}"] = onnx_step
    int8_graphs = {}
    if "int8" in manifest.graphs:
        int8_graphs["int8"] = manifest.path(manifest.graphs["int8"].decoder_step)
    if old_int8 is not None:
        session = ort.InferenceSession(str(old_int8), _session_options(threads, spinning=True),
                                       providers=["CPUExecutionProvider"])

        def old_step(f: dict, session: ort.InferenceSession = session) -> object:
            feed = {k: v for k, v in f.items() if k in DECODER_INPUTS}
            return session.run(STEP_OUTPUTS, {**feed, "k": np.array(TOP_K, dtype=np.int64)})

        out["onnx int8 old"] = old_step
        int8_graphs["int8 old"] = old_int8
    for name, graph in int8_graphs.items():
        session = floor_session(graph, threads)

        def floor(f: dict, session: ort.InferenceSession = session, key: str = f"{FLOOR} {name}") -> object:
            return session.run(None, f[key])

        out[f"{FLOOR} {name}"] = floor
    if checkpoint is not None:
        torch.set_num_threads(threads)
        model = load_checkpoint(checkpoint).model()
        models = {"torch eager": (model, torch.float32)}
        if bf16:
            models["torch bf16"] = (load_checkpoint(checkpoint).model().to(torch.bfloat16), torch.bfloat16)
        for name, (m, dtype) in models.items():

            @torch.inference_mode()
            def torch_step(f: dict, m=m, dtype=dtype) -> object:
                t = {k: torch.from_numpy(v) for k, v in f.items() if not k.startswith(FLOOR)}
                t = {k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()}
                log_probs, state, alpha = m.step_log_probs(
                    t["prev_tokens"], t["state"], t["annotations"], t["keys"], t["src_mask"])
                return log_probs.topk(TOP_K, dim=1), state, alpha

            out[name] = torch_step
    return out


def floor_inputs(step_graph: Path, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random uint8 activations for the floor graph of ``step_graph`` at ``rows`` rows."""
    graph = product_floor(onnx.load(str(step_graph))).graph
    inits = {t.name: t for t in graph.initializer}
    return {node.input[0]: rng.integers(1, 256, size=(rows, inits[node.input[1]].dims[0])).astype(np.uint8)
            for node in graph.node}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def measure(run: dict[str, Callable[[dict], object]], feed: dict, rounds: int, steps: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median over rounds of each engine's median ms per step in a block of ``steps``."""
    blocks: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(rounds):
        for name, step in run.items():
            times = []
            for i in range(WARMUP + steps):
                start = clock()
                step(feed)
                if i >= WARMUP:
                    times.append((clock() - start) * 1e3)
            blocks[name].append(statistics.median(times))
    return {name: statistics.median(b) for name, b in blocks.items()}


def encoders(repo: Path, threads: int, old_int8: Path | None) -> dict[str, Callable[[dict], object]]:
    """name -> one encoder run on a feed dict (the serving session options: no spinning)."""
    manifest = load_manifest(repo)
    files = {f"onnx {p}": manifest.path(manifest.graphs[p].encoder) for p in manifest.graphs}
    if old_int8 is not None:
        files["onnx int8 old"] = old_int8
    out = {}
    for name, file in files.items():
        session = ort.InferenceSession(str(file), _session_options(threads), providers=["CPUExecutionProvider"])
        out[name] = lambda f, session=session: session.run(None, f)
    return out


def profile(graph: Path, feed: dict, threads: int, runs: int = 200, warmup: int = 20) -> tuple[float, dict, dict]:
    """ONNX Runtime's profiler on the decoder step (``SessionOptions.enable_profiling``): median ms
    of a run, and per op type and per node the median kernel ms (over ``runs`` runs)."""
    import collections
    import tempfile

    opts = _session_options(threads, spinning=True)
    opts.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        opts.profile_file_prefix = str(Path(tmp) / "step")
        session = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
        inputs = {k: feed[k] for k in DECODER_INPUTS if k in feed} | {"k": np.array(TOP_K, dtype=np.int64)}
        for _ in range(warmup + runs):
            session.run(STEP_OUTPUTS, inputs)
        events = json.loads(Path(session.end_profiling()).read_text())
    run_ms = statistics.median(e["dur"] for e in events if e.get("name") == "model_run") / 1e3
    nodes: dict[str, list[float]] = collections.defaultdict(list)
    ops: dict[str, str] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            nodes[name].append(e["dur"] / 1e3)
            ops[name] = e["args"]["op_name"]
    node_ms = {n: statistics.median(v[warmup:] or v) for n, v in nodes.items()}
    by_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for n, ms in node_ms.items():
        by_op[ops[n]][0] += ms
        by_op[ops[n]][1] += 1
    return run_ms, dict(by_op), {n: (ops[n], ms) for n, ms in node_ms.items()}


def profile_report(graphs: dict[str, Path], feed: dict, rows: int, threads: int, clock: str) -> str:
    lines = [f"# Decoder-step profile at {rows} rows ({threads} thread(s))", "",
             "ONNX Runtime's profiler (median kernel ms per op type over 200 runs; wall clock, so on a "
             "shared CPU compare the graphs side by side, not with other runs).", ""]
    for name, graph in graphs.items():
        run_ms, by_op, nodes = profile(graph, feed, threads)
        total = sum(t for t, _ in by_op.values())
        products = by_op.get("MatMulIntegerToFloat", [0.0, 0])[0]
        lines += [f"## {name} (`{graph}`)", "",
                  f"run {run_ms:.3f} ms; kernels {total:.3f} ms, of which int8 products {products:.3f} ms "
                  f"and the rest {total - products:.3f} ms ({len(nodes)} nodes).", "",
                  "| op | ms | nodes |", "|---|---:|---:|"]
        lines += [f"| {op} | {t:.3f} | {c} |" for op, (t, c) in sorted(by_op.items(), key=lambda x: -x[1][0])]
        lines += [""]
    return "\n".join(lines) + "\n"


def report(results: list[dict], meta: dict, encoder: list[dict] | None = None) -> str:
    names = [k for k in results[0] if k != "rows"]
    onnx_names = [n for n in names if n.startswith("onnx")]
    floors = [n for n in names if n.startswith(FLOOR) and f"onnx {n[len(FLOOR) + 1:]}" in names]
    lines = [f"# Decoder-step latency ({meta['model']})", "",
             f"ms per step ({'CPU time of the calling thread' if meta.get('clock') == 'cpu' else 'wall clock'}; "
             f"median over {meta['rounds']} rounds of each engine's median over a block of "
             f"{meta['steps']} steps); src_len {meta['src_len']} (+1 masked column), top-k {TOP_K}, "
             f"{meta['threads']} thread(s); {meta['cpu']}; onnxruntime {meta['onnxruntime']}, "
             f"torch {meta['torch']}. 160 rows = 32 texts at beam 5. \"floor X\": the int8 graph X's "
             "matrix products alone (same weights and shapes, uint8 inputs); \"X / floor\": the step over "
             "its floor.", "",
             "| rows | " + " | ".join(f"{n} (ms)" for n in names) + " | "
             + " | ".join(f"{n} x torch" for n in onnx_names) + " | "
             + " | ".join(f"{n[len(FLOOR) + 1:]} / floor" for n in floors) + " |",
             "|---:|" + "---:|" * (len(names) + len(onnx_names) + len(floors))]
    for r in results:
        ratios = [f"{r['torch eager'] / r[n]:.2f}x" if "torch eager" in r else "-" for n in onnx_names]
        over = [f"{r['onnx ' + f[len(FLOOR) + 1:]] / r[f]:.2f}" for f in floors]
        lines.append(f"| {r['rows']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " | "
                     + " | ".join(ratios) + " | " + " | ".join(over) + " |")
    if encoder:
        names = [k for k in encoder[0] if k not in ("batch", "src_len")]
        lines += ["", f"Encoder, ms per batch (same method, blocks of {meta['steps']} runs; random sources of "
                  "mixed lengths, the longest src_len):", "",
                  "| batch | src_len | " + " | ".join(f"{n} (ms)" for n in names) + " |",
                  "|---:|---:|" + "---:|" * len(names)]
        lines += [f"| {r['batch']} | {r['src_len']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |"
                  for r in encoder]
    lines += ["", f"Load average (1 min) before / after: {meta['load'][0]:.2f} / {meta['load'][1]:.2f} "
              "(the CPU is shared: figures are comparable within a run, side by side)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo", type=Path)
    p.add_argument("--checkpoint", type=Path, help="default: the one recorded in the manifest")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch eager")
    p.add_argument("--old-int8", type=Path, help="another int8 decoder-step graph to time beside it")
    p.add_argument("--old-int8-encoder", type=Path, help="another int8 encoder graph to time beside it")
    p.add_argument("--encoder-batches", type=int, nargs="*", default=[32], help="encoder batch sizes timed")
    p.add_argument("--no-bf16", action="store_true", help="skip PyTorch with bf16 weights")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 160, 512])
    p.add_argument("--src-len", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30, help="steps per engine per round")
    p.add_argument("--profile", type=int, metavar="ROWS",
                   help="only profile the int8 step graphs at ROWS rows (bench_step.profile.md)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="cpu: the calling thread's CPU time, with --threads 1 (ONNX Runtime and PyTorch "
                        "then compute on it), for a CPU shared with other work")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1")
    clock = CLOCKS[args.clock]
    manifest = load_manifest(args.repo)
    if args.profile:
        fp32 = Runtime(manifest, precision="fp32", provider="cpu", intra_op_threads=args.threads)
        cfg = manifest.model_config
        feed = step_inputs(fp32, rows=args.profile, src_len=args.src_len,
                           vocab_sizes=(cfg["src_vocab_size"], cfg["tgt_vocab_size"]), rng=np.random.default_rng(0))
        graphs = {"int8": manifest.path(manifest.graphs["int8"].decoder_step)}
        if args.old_int8 is not None:
            graphs["int8 old"] = args.old_int8
        text = profile_report(graphs, feed, args.profile, args.threads, args.clock)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_step.profile.md").write_text(text)
        print(text)
        return 0
    checkpoint = None if args.no_torch else (
        args.checkpoint or args.repo.parent / manifest.raw["checkpoint"]["file"])
    run = engines(args.repo, checkpoint, args.threads, old_int8=args.old_int8, bf16=not args.no_bf16)
    cfg = manifest.model_config
    fp32 = Runtime(manifest, precision="fp32", provider="cpu", intra_op_threads=args.threads)
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    results = []
    for rows in args.rows:
        feed = step_inputs(fp32, rows=rows, src_len=args.src_len,
                           vocab_sizes=(cfg["src_vocab_size"], cfg["tgt_vocab_size"]), rng=rng)
        if "int8" in manifest.graphs:
            feed[f"{FLOOR} int8"] = floor_inputs(manifest.path(manifest.graphs["int8"].decoder_step), rows, rng)
        if args.old_int8 is not None:
            feed[f"{FLOOR} int8 old"] = floor_inputs(args.old_int8, rows, rng)
        results.append({"rows": rows, **measure(run, feed, args.rounds, args.steps, clock)})
    encoder = []
    if args.encoder_batches:
        run_encoder = encoders(args.repo, args.threads, args.old_int8_encoder)
        for batch in args.encoder_batches:
            src, lengths = random_batch(rng, batch=batch, src_len=args.src_len, vocab_size=cfg["src_vocab_size"])
            feed = {"src_ids": src, "src_lengths": lengths}
            encoder.append({"batch": batch, "src_len": args.src_len,
                            **measure(run_encoder, feed, args.rounds, args.steps, clock)})
    meta = {"model": f"{manifest.name}/{manifest.version}", "model_config": cfg, "rounds": args.rounds,
            "old_int8": str(args.old_int8) if args.old_int8 else None,
            "steps": args.steps,
            "src_len": args.src_len, "threads": args.threads, "top_k": TOP_K, "clock": args.clock,
            "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "onnxruntime": metadata.version("onnxruntime"), "torch": torch.__version__,
            "old_int8_encoder": str(args.old_int8_encoder) if args.old_int8_encoder else None,
            "load": [load_before, os.getloadavg()[0]]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_step.md").write_text(report(results, meta, encoder))
    (args.out / "bench_step.json").write_text(
        json.dumps({"meta": meta, "results": results, "encoder": encoder}, indent=1) + "\n")
    print(report(results, meta, encoder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
