"""This release against a previous one, side by side: saturated service throughput.

    git worktree add /tmp/base f967d83        # the previous release
    python loadtest/bench_release.py --previous /tmp/base --texts build/corpus/test.jsonl

Each release serves its own shipped model with its own defaults (``nmt serve``
with no tuning flags, from its own checkout), one at a time on this machine,
in alternating rounds (previous, this, previous, this, ...). In each round
``--clients`` closed-loop clients (each sends its next request when the last is
answered) send one text per call for ``--duration`` seconds, then eight texts
per call. Reported per release and shape: texts/s and target tokens/s (medians
of the rounds) and this release's ratio to the previous one. Also the useful
FLOP/s at saturation (matrix products of the encoder and decoder steps actually
run, from each text's source and target length) against the rate of an int8
matrix product of the GRU cell's shape measured in the same run (ONNX
Runtime ``MatMulInteger``, u8 x u8, the scheme this release's graphs use).
Writes ``loadtest/results/bench_release.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import grpc
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the server harness the tests use

from harness import ServerProcess, served_version  # noqa: E402
from service_load import cpu_seconds  # noqa: E402
from service.decoding.int8_form import FormChoice, Int8Form, cpu_flags, decide, reported_flags  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402

SHAPES = (1, 8)  # texts per call
FORM = decide(FormChoice.AUTO, cpu_flags())[0]
RESULTS = ROOT / "loadtest" / "results"


async def saturate(address: str, texts: list[str], *, per_call: int, clients: int, duration: float,
                   seed: int, cpu: Callable[[], float] | None = None) -> dict:
    """Closed loop: texts/s, target tokens/s, source tokens and target tokens answered; with ``cpu``
    (the server's CPU seconds so far), also the cores it used."""
    done = tokens = sources = errors = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)
        await stub.Translate(pb.TranslateRequest(texts=texts[:per_call]), timeout=60)  # warm-up
        stop_at = time.perf_counter() + duration

        async def client(k: int) -> None:
            nonlocal done, tokens, sources, errors
            rng = random.Random(seed * 1000 + k)
            while time.perf_counter() < stop_at:
                batch = [rng.choice(texts) for _ in range(per_call)]
                try:
                    reply = await stub.Translate(pb.TranslateRequest(texts=batch), timeout=120)
                except grpc.aio.AioRpcError:
                    errors += 1
                    continue
                done += len(batch)
                tokens += sum(len(t.hypotheses[0].tokens) for t in reply.translations)
                sources += sum(len(t.source_tokens) + 1 for t in reply.translations)
        start, cpu_start = time.perf_counter(), cpu() if cpu else float("nan")
        await asyncio.gather(*(client(k) for k in range(clients)))
        seconds = time.perf_counter() - start
        cores = ((cpu() - cpu_start) / seconds) if cpu else float("nan")
    return {"texts_per_s": done / seconds, "tokens_per_s": tokens / seconds, "errors": errors,
            "texts": done, "target_tokens": tokens, "source_tokens": sources, "seconds": seconds, "cores": cores}


def descendants(pid: int) -> list[int]:
    """The live descendants of process ``pid`` (an engine process, multiprocessing's tracker)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, grown = {pid}, True
    while grown:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree, grown = tree | more, bool(more)
    return sorted(tree - {pid})


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` and its live descendants (an engine process included)."""
    return sum(cpu_seconds(p) for p in (pid, *descendants(pid)))


def each_shape(address: str, texts: list[str], *, clients: int, duration: float, seed: int,
               label: str, pid: int | None = None) -> list[tuple[int, dict]]:
    """``saturate`` at each number of texts per call (``SHAPES``), one after the other, printed;
    with ``pid`` (the server's), the cores its process tree used."""
    results = []
    cpu = (lambda: tree_cpu_seconds(pid)) if pid else None
    for per_call in SHAPES:
        result = asyncio.run(saturate(address, texts, per_call=per_call, clients=clients, duration=duration,
                                      seed=seed, cpu=cpu))
        results.append((per_call, result))
        print(f"{label} {per_call}/call: {result['texts_per_s']:.0f} texts/s, "
              f"{result['tokens_per_s']:.0f} tokens/s, {result['cores']:.2f} cores, {result['errors']} errors",
              flush=True)
    return results


def model_flops(config: dict, *, texts: int, source_tokens: int, target_tokens: int) -> float:
    """Multiply-adds x 2 of the products greedy decoding runs: per source token the encoder's
    GRU (both directions) and the attention keys; per decoder step (target tokens + EOS) the
    GRU cell, the attention query, the deep output and the vocabulary projection (the
    attention's rows x src_len products left out: they depend on the source length)."""
    e, h, d, a, o, v = (config[k] for k in ("emb_size", "enc_hidden_size", "dec_hidden_size", "attn_size",
                                            "out_size", "tgt_vocab_size"))
    ctx = 2 * h
    encoder = 2 * 3 * (e + h) * h + ctx * a
    step = 3 * (e + ctx + d) * d + d * a + (d + e + ctx) * 2 * o + o * v
    return 2.0 * (encoder * source_tokens + step * (target_tokens + texts))


def int8_product_rate(rows: int = 160, inner: int = 1280, outer: int = 1536, threads: int = 2) -> float:
    """Integer ops/s of a ``MatMulInteger`` (rows x inner x outer) in the form this CPU's fast path
    uses (``service.decoding.int8_form``: u8 x s8 with VNNI or AMX, else u8 x u8), median of 30 runs."""
    rng = np.random.default_rng(0)
    signed = FORM is Int8Form.U8S8
    weight = (rng.integers(-127, 128, (inner, outer), dtype=np.int8) if signed
              else rng.integers(0, 256, (inner, outer), dtype=np.uint8))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "za", "zb"], ["y"])], "product",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["rows", inner])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [numpy_helper.from_array(weight, "b"), numpy_helper.from_array(np.array(128, np.uint8), "za"),
         numpy_helper.from_array(np.array(0, np.int8) if signed else np.array(128, np.uint8), "zb")])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                                   .SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feed = {"a": rng.integers(0, 256, (rows, inner), dtype=np.uint8)}
    for _ in range(5):
        session.run(None, feed)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return 2.0 * rows * inner * outer / statistics.median(times)


def serve(tree: Path, name: str, log_dir: Path, model: str | None, flags: str = "") -> ServerProcess:
    """``nmt serve`` of the checkout ``tree`` with its defaults (plus ``flags``) and its shipped model
    ``model`` (None: the version that checkout serves by default)."""
    env = {"PYTHONPATH": str(tree)}
    repository = tree / model if model else served_version(tree)
    return ServerProcess(repository, log_dir / f"bench_release_{name}_server.log", *shlex.split(flags), env=env,
                         cwd=tree, startup_timeout=300)


def run(args: argparse.Namespace) -> dict:
    lines = Path(args.texts).read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["src_raw"] for line in lines if line.strip()][: args.max_texts]
    trees = {"previous": args.previous.resolve(), "this": ROOT}
    rounds: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in SHAPES} for name in trees}
    product_rates = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for name, tree in trees.items():
            server = serve(tree, name, args.out.parent, args.model, getattr(args, f"{name}_flags"))
            try:
                for per_call, result in each_shape(server.address, texts, clients=args.clients, duration=args.duration,
                                                   seed=r, label=f"round {r} {name}", pid=server.proc.pid):
                    rounds[name][per_call].append(result)
            finally:
                server.stop()
        product_rates.append(int8_product_rate())
    this = ROOT / args.model if args.model else served_version(ROOT)  # both releases' models have its sizes
    manifest = json.loads((this / "manifest.json").read_text())
    return {"rounds": rounds, "int8_product_ops_per_s": statistics.median(product_rates),
            "model_config": manifest["model_config"], "clients": args.clients, "duration": args.duration,
            "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "previous": str(args.previous), "onnxruntime": ort.__version__, "int8_form": FORM.value,
            "flags": reported_flags()}


def markdown(r: dict, args: argparse.Namespace) -> str:
    med = {name: {n: {k: statistics.median(x[k] for x in rs)
                      for k in ("texts_per_s", "tokens_per_s", "cores")}
                  for n, rs in shapes.items()} for name, shapes in r["rounds"].items()}
    flags = "".join(f" --{name}-flags {shlex.quote(getattr(args, f'{name}_flags'))}"
                    for name in ("previous", "this") if getattr(args, f"{name}_flags"))
    flags += f" --out {args.out}" if args.out != RESULTS / "bench_release" else ""
    settings = "flags as named" if flags else "default settings"
    out = [f"# This release against the previous one (saturated, {settings})", "",
           f"`python loadtest/bench_release.py --previous {args.previous}{flags} --texts {args.texts} "
           f"--rounds {args.rounds} --duration {args.duration:g} --clients {args.clients}`; {r['cpu']}, CPU flags "
           f"{', '.join(r['flags']) or 'none'}; onnxruntime {r['onnxruntime']}. "
           "Alternating rounds, medians; each release with its own defaults (plus the flags named) and shipped "
           "model. Cores: CPU seconds of the server's processes (an engine process included) per second.", "",
           "| texts per call | previous texts/s | this texts/s | ratio | previous tokens/s | this tokens/s | ratio "
           "| previous cores | this cores |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in SHAPES:
        p, t = med["previous"][n], med["this"][n]
        out.append(f"| {n} | {p['texts_per_s']:.0f} | {t['texts_per_s']:.0f} | {t['texts_per_s'] / p['texts_per_s']:.2f}x "
                   f"| {p['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {t['tokens_per_s'] / p['tokens_per_s']:.2f}x "
                   f"| {p['cores']:.2f} | {t['cores']:.2f} |")
    out += ["", "Per round (texts/s): " + "; ".join(
        f"{name} {n}/call " + ", ".join(f"{x['texts_per_s']:.0f}" for x in rs)
        for name, shapes in r["rounds"].items() for n, rs in shapes.items())]
    rate = r["int8_product_ops_per_s"]
    out += ["", "## Useful FLOP/s at saturation", "",
            f"Against an int8 product of the GRU cell's shape (160 x 1280 x 1536, {r['int8_form']} `MatMulInteger`, "
            f"2 threads) measured in the same run: {rate / 1e9:.0f} G ops/s.", "",
            "| release | texts per call | useful GFLOP/s | share of the int8 product rate |", "|---|---:|---:|---:|"]
    for name, shapes in r["rounds"].items():
        for n, rs in shapes.items():
            flops = statistics.median(model_flops(r["model_config"], texts=x["texts"], source_tokens=x["source_tokens"],
                                                  target_tokens=x["target_tokens"]) / x["seconds"] for x in rs)
            out.append(f"| {name} | {n} | {flops / 1e9:.1f} | {flops / rate:.1%} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--previous", type=Path, required=True, help="a checkout of the previous release")
    p.add_argument("--texts", type=Path, required=True, help="test split (jsonl with src_raw)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--max-texts", type=int, default=1000)
    p.add_argument("--previous-flags", default="", help="more `nmt serve` flags for the previous release")
    p.add_argument("--this-flags", default="", help="more `nmt serve` flags for this release (--engine-process on)")
    p.add_argument("--model", help="the model each checkout serves (relative to it); default: its own served version")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_release")
    args = p.parse_args(argv)
    result = run(args)
    return write_results(args.out, result, markdown(result, args))


def write_results(out: Path, result: dict, text: str) -> int:
    """``out``.md (the table) and ``out``.json (the figures); the table printed; 0."""
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
