"""Decoder-step latency: fp32 vs int8 ONNX Runtime vs PyTorch eager, side by side.

    python loadtest/bench_step.py models/en-fr/1 [--checkpoint PATH]
        [--rows 1 8 32 64 160] [--src-len 20] [--threads 2] [--rounds 7] [--steps 30]

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
import torch

from export.checkpoint import load_checkpoint
from export.verify import FIRST_ID, Graphs
from service.models.manifest import load_manifest
from service.decoding.runtime import Runtime
from service.text.tokenizer import EOS_ID, PAD_ID

TOP_K = 10  # what a beam of 5 asks for (2 x beam)
WARMUP = 3  # steps discarded at the start of each block


def step_inputs(graphs: Graphs, *, rows: int, src_len: int, vocab_sizes: tuple[int, int],
                rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Realistic step inputs: the fp32 encoder's outputs on random sources with one
    masked column, as the engine's batches have (``service.decoding.batch.PAD_COLUMNS``)."""
    src = rng.integers(FIRST_ID, vocab_sizes[0], size=(rows, src_len + 1))  # (rows, src_len + 1)
    src[:, src_len - 1], src[:, src_len] = EOS_ID, PAD_ID
    lengths = np.full(rows, src_len, dtype=np.int64)
    annotations, keys, state = graphs.encode(src, lengths)  # (rows, src_len + 1, ctx_size), ...
    return {"prev_tokens": rng.integers(FIRST_ID, vocab_sizes[1], size=rows).astype(np.int64),
            "state": state, "annotations": annotations, "keys": keys, "src_mask": src != PAD_ID}


def engines(repo: Path, checkpoint: Path | None, threads: int) -> dict[str, Callable[[dict], object]]:
    """name -> one decoder step on a feed dict."""
    manifest = load_manifest(repo)
    out: dict[str, Callable[[dict], object]] = {}
    for precision in manifest.graphs:
        runtime = Runtime(manifest, precision=precision, provider="cpu", intra_op_threads=threads)

        def onnx_step(f: dict, runtime: Runtime = runtime) -> object:
            context = runtime.context(f["annotations"], f["keys"], f["src_mask"])
            return runtime.step(f["prev_tokens"], f["state"], context, TOP_K)

        out[f"onnx {precision}"] = onnx_step
    if checkpoint is not None:
        torch.set_num_threads(threads)
        model = load_checkpoint(checkpoint).model()

        @torch.inference_mode()
        def torch_step(f: dict) -> object:
            t = {k: torch.from_numpy(v) for k, v in f.items()}
            log_probs, state, alpha = model.step_log_probs(
                t["prev_tokens"], t["state"], t["annotations"], t["keys"], t["src_mask"])
            return log_probs.topk(TOP_K, dim=1), state, alpha

        out["torch eager"] = torch_step
    return out


def measure(run: dict[str, Callable[[dict], object]], feed: dict, rounds: int, steps: int) -> dict[str, float]:
    """Median over rounds of each engine's median ms per step in a block of ``steps``."""
    blocks: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(rounds):
        for name, step in run.items():
            times = []
            for i in range(WARMUP + steps):
                start = time.perf_counter()
                step(feed)
                if i >= WARMUP:
                    times.append((time.perf_counter() - start) * 1e3)
            blocks[name].append(statistics.median(times))
    return {name: statistics.median(b) for name, b in blocks.items()}


def report(results: list[dict], meta: dict) -> str:
    names = [k for k in results[0] if k != "rows"]
    onnx = [n for n in names if n.startswith("onnx")]
    lines = [f"# Decoder-step latency ({meta['model']})", "",
             f"ms per step (median over {meta['rounds']} rounds of each engine's median over a block of "
             f"{meta['steps']} steps); src_len {meta['src_len']} (+1 masked column), top-k {TOP_K}, "
             f"{meta['threads']} thread(s); {meta['cpu']}; onnxruntime {meta['onnxruntime']}, "
             f"torch {meta['torch']}. 160 rows = 32 texts at beam 5.", "",
             "| rows | " + " | ".join(f"{n} (ms)" for n in names) + " | "
             + " | ".join(f"{n} x torch" for n in onnx) + " |",
             "|---:|" + "---:|" * (len(names) + len(onnx))]
    for r in results:
        ratios = [f"{r['torch eager'] / r[n]:.2f}x" if "torch eager" in r else "-" for n in onnx]
        lines.append(f"| {r['rows']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo", type=Path)
    p.add_argument("--checkpoint", type=Path, help="default: the one recorded in the manifest")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch eager")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 160])
    p.add_argument("--src-len", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30, help="steps per engine per round")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    manifest = load_manifest(args.repo)
    checkpoint = None if args.no_torch else (
        args.checkpoint or args.repo.parent / manifest.raw["checkpoint"]["file"])
    run = engines(args.repo, checkpoint, args.threads)
    cfg = manifest.model_config
    fp32 = Graphs(manifest, "fp32", threads=args.threads)
    rng = np.random.default_rng(0)
    results = []
    for rows in args.rows:
        feed = step_inputs(fp32, rows=rows, src_len=args.src_len,
                           vocab_sizes=(cfg["src_vocab_size"], cfg["tgt_vocab_size"]), rng=rng)
        results.append({"rows": rows, **measure(run, feed, args.rounds, args.steps)})
    meta = {"model": f"{manifest.name}/{manifest.version}", "model_config": cfg, "rounds": args.rounds,
            "steps": args.steps,
            "src_len": args.src_len, "threads": args.threads, "top_k": TOP_K,
            "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "onnxruntime": metadata.version("onnxruntime"), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_step.md").write_text(report(results, meta))
    (args.out / "bench_step.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(report(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
