"""The CUDA provider run for real (issue 29): parity with the CPU on the same graphs, the server
on CUDA, and the service benchmark there beside the CPU server of the same machine.

    nmt export models/en-fr/checkpoint-4.pt --output build/cuda-check/en-fr/4 --name en-fr \\
        --version 4 --quantize int8       # fp32 graphs (the repository ships int8 only)
    python loadtest/bench_cuda.py --repository build/cuda-check/en-fr/4 --texts build/corpus-v2/test.jsonl

Needs a GPU and onnxruntime-gpu as the only ``onnxruntime`` (``pip install 'nmt-serve[gpu]'``);
``--provider cpu`` runs every part on the CPU (a dry run of the script where there is no GPU).

1. Graphs: the fp32 encoder and decoder step in a CPU session and a ``--provider`` session,
   fed the same padded batch of real texts (decoder steps teacher-forced by the CPU's argmax):
   the largest difference of every output and the share of rows whose best word agrees.
2. Engine: greedy and beam 5 over the first ``--parity-texts`` texts, one batch, on each
   provider (the CUDA side through ``Runtime``'s I/O binding): the share of identical
   translations and each engine's texts/s.
3. Service: ``nmt serve --provider cuda --precision fp32`` and the CPU server at its defaults
   (int8, every core), alternating ``--rounds`` rounds; closed-loop clients (``bench_release``'s
   ``saturate``) at one and eight texts per call.
Writes ``loadtest/results/bench_cuda.json`` and ``.md`` after each part; a part that raises is
recorded with its traceback and the next part runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "loadtest"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_release import SHAPES, each_shape  # noqa: E402
from harness import ServerProcess  # noqa: E402
from service.decoding.engine import Engine, _tokenizer  # noqa: E402
from service.decoding.runtime import Runtime, _step_feed  # noqa: E402
from service.models.manifest import DECODER_OUTPUTS, load_manifest  # noqa: E402
from service.options import DecodingOptions  # noqa: E402

RESULTS = ROOT / "loadtest" / "results"


def graphs_parity(repository: Path, texts: list[str], provider: str, steps: int = 20) -> dict:
    manifest = load_manifest(repository)
    cpu = Runtime(manifest, precision="fp32", provider="cpu", intra_op_threads=None)
    other = Runtime(manifest, precision="fp32", provider=provider, intra_op_threads=None)
    tokenizer = _tokenizer(manifest)
    ids = [tokenizer.encode(t).ids for t in texts]
    src_len = max(map(len, ids))
    src = np.zeros((len(ids), src_len), np.int64)
    for row, x in enumerate(ids):
        src[row, :len(x)] = x
    lengths = np.array([len(x) for x in ids], np.int64)
    encoded = [rt.encode(src, lengths) for rt in (cpu, other)]
    out = {"rows": len(ids), "src_len": src_len, "encoder_max_abs_diff": max(
        float(np.abs(getattr(encoded[0], k) - getattr(encoded[1], k)).max())
        for k in ("annotations", "keys", "init_state"))}
    mask = np.arange(src_len)[None, :] < lengths[:, None]
    context = cpu.context(encoded[0].annotations, encoded[0].keys, mask)
    state = encoded[0].init_state
    prev = np.full(len(ids), manifest.special.bos, np.int64)
    diffs: dict[str, float] = {name: 0.0 for name in DECODER_OUTPUTS}
    agree = []
    for _ in range(steps):
        feed = _step_feed(prev, state, context, 4)
        a, b = (dict(zip(DECODER_OUTPUTS, rt.decoder.run(list(DECODER_OUTPUTS), feed))) for rt in (cpu, other))
        for name in DECODER_OUTPUTS:
            if a[name].dtype.kind == "f":
                diffs[name] = max(diffs[name], float(np.abs(a[name] - b[name]).max()))
        agree.append(float(np.mean(a["log_probs"].argmax(1) == b["log_probs"].argmax(1))))
        prev, state = a["log_probs"].argmax(1).astype(np.int64), a["next_state"]
    out.update({"steps": steps, "step_max_abs_diff": diffs, "top1_agreement": min(agree),
                "providers": other.decoder.get_providers()})
    return out


def engine_parity(repository: Path, texts: list[str], provider: str) -> dict:
    engines = {"cpu": Engine(repository, precision="fp32"),
               "other": Engine(repository, precision="fp32", provider=provider)}
    out: dict = {}
    for beam in (1, 5):
        answers, speed = {}, {}
        for name, engine in engines.items():
            engine.translate(texts[:8], DecodingOptions(beam_size=beam))  # warm-up
            start = time.perf_counter()
            answers[name] = [t.hypotheses[0].text for t in engine.translate(texts, DecodingOptions(beam_size=beam))]
            speed[name] = len(texts) / (time.perf_counter() - start)
        same = sum(x == y for x, y in zip(answers["cpu"], answers["other"]))
        out[f"beam{beam}"] = {"identical_share": same / len(texts), "texts": len(texts),
                              "texts_per_s": speed, "first_difference": next(
                                  ([s, x, y] for s, x, y in zip(texts, answers["cpu"], answers["other"]) if x != y),
                                  None)}
    return out


def step_times(repository: Path, texts: list[str], provider: str, rows: tuple[int, ...] = (8, 32, 128, 512),
               repeats: int = 30) -> dict:
    """Median time of one decoder step (``Runtime.step``, k = 5, the state fed back) at ``rows``
    rows of real texts, fp32 on the CPU and on ``provider``: a step's fixed cost and its growth."""
    manifest = load_manifest(repository)
    tokenizer = _tokenizer(manifest)
    out: dict[str, dict[int, float]] = {}
    for name, prov in (("cpu", "cpu"), ("other", provider)):
        rt = Runtime(manifest, precision="fp32", provider=prov, intra_op_threads=None)
        out[name] = {}
        for n in rows:
            ids = [tokenizer.encode(texts[i % len(texts)]).ids for i in range(n)]
            src_len = max(map(len, ids))
            src = np.zeros((n, src_len), np.int64)
            for row, x in enumerate(ids):
                src[row, :len(x)] = x
            lengths = np.array([len(x) for x in ids], np.int64)
            enc = rt.encode(src, lengths)
            context = rt.context(enc.annotations, enc.keys, np.arange(src_len)[None, :] < lengths[:, None])
            state, prev = rt.state(enc.init_state), np.full(n, manifest.special.bos, np.int64)
            times = []
            for _ in range(repeats + 5):
                start = time.perf_counter()
                result = rt.step(prev, state, context, 5)
                times.append(time.perf_counter() - start)
                state, prev = result.next_state, result.topk_ids[:, 0].astype(np.int64)
            out[name][n] = statistics.median(times[5:]) * 1e3
    return {"ms_per_step": out, "src_len_note": "rows cycle over the first texts; padded to the longest"}


def service(repository: Path, texts: list[str], args: argparse.Namespace) -> dict:
    servers = {"cpu int8 (defaults)": ["--precision", "int8"],
               f"{args.provider} fp32": ["--provider", args.provider, "--precision", "fp32"]}
    rounds: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in SHAPES} for name in servers}
    listed = {}
    for r in range(args.rounds):
        for name, flags in servers.items():
            log = RESULTS / f"bench_cuda_{name.split()[0]}_server.log"
            server = ServerProcess(repository, log, *flags, startup_timeout=300)
            try:
                listed[name] = server.http("GET", "/v1/models").json()
                for per_call, result in each_shape(server.address, texts, clients=args.clients,
                                                   duration=args.duration, seed=r, label=f"round {r} {name}"):
                    rounds[name][per_call].append(result)
            finally:
                server.stop()
    return {"rounds": rounds, "models": listed, "clients": args.clients, "duration": args.duration}


def machine(provider: str) -> dict:
    facts = {"cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
             "onnxruntime": ort.__version__, "available_providers": ort.get_available_providers(),
             "python": platform.python_version()}
    if provider == "cuda":
        try:
            import subprocess
            facts["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                           "--format=csv,noheader"], capture_output=True, text=True,
                                          timeout=30).stdout.strip()
        except OSError as e:
            facts["gpu"] = f"nvidia-smi: {e}"
    return facts


def markdown(r: dict, args: argparse.Namespace) -> str:
    m = r["machine"]
    out = ["# The CUDA provider against the CPU, one machine, one run", "",
           f"`python loadtest/bench_cuda.py --repository {args.repository} --texts {args.texts} "
           f"--provider {args.provider} --rounds {args.rounds} --duration {args.duration:g} --clients {args.clients}`; "
           f"{m['cpu']}; GPU {m.get('gpu', 'none')}; onnxruntime {m['onnxruntime']} "
           f"({', '.join(m['available_providers'])}); Python {m['python']}.", ""]
    g = r.get("graphs")
    if g and "error" not in g:
        steps = ", ".join(f"{k} {v:.2e}" for k, v in g["step_max_abs_diff"].items())
        out += ["## Graphs (fp32, same inputs)", "",
                f"{g['rows']} texts padded to {g['src_len']} tokens, {g['steps']} teacher-forced steps, "
                f"sessions on {', '.join(g['providers'])}: encoder max abs diff {g['encoder_max_abs_diff']:.2e}; "
                f"step max abs diff {steps}; best word agrees on {g['top1_agreement']:.1%} of rows "
                "(the worst step).", ""]
    e = r.get("engine")
    if e and "error" not in e:
        out += ["## Engine (fp32, one batch)", "", "| search | identical translations | CPU texts/s | "
                f"{args.provider} texts/s |", "|---|---:|---:|---:|"]
        for search, x in e.items():
            if isinstance(x, dict):
                speeds = x["texts_per_s"]
                out.append(f"| {search} | {x['identical_share']:.1%} of {x['texts']} | {speeds['cpu']:.0f} | "
                           f"{speeds['other']:.0f} |")
        out.append("")
    t = r.get("steps")
    if t and "error" not in t:
        ms = t["ms_per_step"]
        out += ["## One decoder step (fp32, `Runtime.step`, k = 5, median of 30)", "",
                f"| rows | CPU ms | {args.provider} ms |", "|---:|---:|---:|"]
        out += [f"| {n} | {ms['cpu'][n]:.2f} | {ms['other'][n]:.2f} |" for n in ms["cpu"]] + [""]
    s = r.get("service")
    if s and "error" not in s:
        out += ["## Service (saturated, closed loop)", "",
                f"{s['clients']} clients, {s['duration']:g} s per measurement, alternating rounds, medians.", "",
                "| server | texts per call | texts/s | target tokens/s | errors |", "|---|---:|---:|---:|---:|"]
        for name, shapes in s["rounds"].items():
            for n, rs in shapes.items():
                if rs:
                    out.append(f"| {name} | {n} | {statistics.median(x['texts_per_s'] for x in rs):.0f} | "
                               f"{statistics.median(x['tokens_per_s'] for x in rs):.0f} | {sum(x['errors'] for x in rs)} |")
        out.append("")
    for part in ("graphs", "engine", "steps", "service"):
        if r.get(part, {}).get("error"):
            out += [f"## {part}: failed", "", "```", r[part]["error"].rstrip(), "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, required=True, help="a model repository with fp32 and int8 graphs")
    p.add_argument("--texts", type=Path, required=True, help="test split (jsonl with src_raw)")
    p.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--parity-texts", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--max-texts", type=int, default=1000)
    p.add_argument("--parts", default="graphs,engine,steps,service", help="which parts, comma-separated")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_cuda")
    args = p.parse_args(argv)
    lines = args.texts.read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["src_raw"] for line in lines if line.strip()][: args.max_texts]
    result: dict = {"machine": machine(args.provider)}
    parts = (("graphs", lambda: graphs_parity(args.repository, texts[:32], args.provider)),
             ("engine", lambda: engine_parity(args.repository, texts[: args.parity_texts], args.provider)),
             ("steps", lambda: step_times(args.repository, texts, args.provider)),
             ("service", lambda: service(args.repository, texts, args)))
    parts = tuple((name, part) for name, part in parts if name in args.parts.split(","))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, part in parts:
        start = time.perf_counter()
        try:
            result[name] = part()
        except Exception:  # recorded; the next part still runs
            result[name] = {"error": traceback.format_exc()[-4000:]}
        result[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {json.dumps(result[name])[:600]}", flush=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
