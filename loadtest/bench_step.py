"""Decoder-step latency: fp32 vs int8 ONNX Runtime vs PyTorch eager, side by side.

    python loadtest/bench_step.py models/en-fr/1 [--checkpoint PATH] [--rows 1 8 32 64]
        [--src-len 20] [--threads 1] [--repeats 50] [--out loadtest/results]

One decoder step (log-probs, top-k, next state, attention) at each row count,
the engines interleaved repeat by repeat so that load on the machine hits them
alike; medians over the repeats. PyTorch runs under ``inference_mode`` with the
same thread count as ONNX Runtime. Writes ``bench_step.md`` and ``bench_step.json``.
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
from service.manifest import load_manifest
from service.tokenizer import EOS_ID, PAD_ID

TOP_K = 5  # what a beam of 5 asks for
WARMUP = 3


def step_inputs(graphs: Graphs, *, rows: int, src_len: int, vocab_sizes: tuple[int, int],
                rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Realistic step inputs: the fp32 encoder's outputs on random full-length sources."""
    src = rng.integers(FIRST_ID, vocab_sizes[0], size=(rows, src_len))  # (rows, src_len), no padding
    src[:, -1] = EOS_ID
    lengths = np.full(rows, src_len, dtype=np.int64)
    annotations, keys, state = graphs.encode(src, lengths)  # (rows, src_len, ctx_size), ...
    return {"prev_tokens": rng.integers(FIRST_ID, vocab_sizes[1], size=rows).astype(np.int64),
            "state": state, "annotations": annotations, "keys": keys, "src_mask": src != PAD_ID}


def engines(repo: Path, checkpoint: Path | None, threads: int) -> dict[str, Callable[[dict], object]]:
    """name -> one decoder step on a feed dict."""
    manifest = load_manifest(repo)
    out: dict[str, Callable[[dict], object]] = {}
    for precision in manifest.graphs:
        graphs = Graphs(manifest, precision, threads=threads)
        k = np.array(TOP_K, dtype=np.int64)
        out[f"onnx {precision}"] = lambda f, g=graphs, k=k: g.decoder.run(None, {**f, "k": k})
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


def measure(run: dict[str, Callable[[dict], object]], feed: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds per step for each engine, interleaved."""
    times: dict[str, list[float]] = {name: [] for name in run}
    for i in range(WARMUP + repeats):
        for name, step in run.items():
            start = time.perf_counter()
            step(feed)
            if i >= WARMUP:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def report(results: list[dict], meta: dict) -> str:
    names = [k for k in results[0] if k != "rows"]
    lines = [f"# Decoder-step latency ({meta['model']})", "",
             f"Median ms per step over {meta['repeats']} repeats; src_len {meta['src_len']}, "
             f"top-k {TOP_K}, {meta['threads']} thread(s); {meta['cpu']}; "
             f"onnxruntime {meta['onnxruntime']}, torch {meta['torch']}.", "",
             "| rows | " + " | ".join(f"{n} (ms)" for n in names) + " | int8 speed-up |",
             "|---:|" + "---:|" * (len(names) + 1)]
    for r in results:
        speedup = (f"{r['onnx fp32'] / r['onnx int8']:.2f}x" if "onnx int8" in r else "-")
        lines.append(f"| {r['rows']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + f" | {speedup} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repo", type=Path)
    p.add_argument("--checkpoint", type=Path, help="default: the one recorded in the manifest")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch eager")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--src-len", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
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
        results.append({"rows": rows, **measure(run, feed, args.repeats)})
    meta = {"model": f"{manifest.name}/{manifest.version}", "model_config": cfg, "repeats": args.repeats,
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
