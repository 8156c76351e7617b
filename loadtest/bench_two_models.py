"""Two models served at once from one repository directory: how their engines share the CPU.

    python loadtest/bench_two_models.py --model models/en-fr/1 --model OTHER/1 \
        --texts build/corpus-v2/test.jsonl [--concurrency 16] [--seconds 20] [--rounds 3]

Every model of a repository directory has its own scheduler and engine thread
with its own ONNX Runtime sessions (``--threads`` intra-op threads each), so
two models under load at once compete for the same cores. One ``nmt serve``
process serves both (as ``a/1`` and ``b/1`` of a temporary repository: the
files copied, the manifests renamed); closed-loop gRPC clients (``bench_service.drive``)
load, in alternating rounds: model a alone, model b alone, then both at once
(``--concurrency`` clients on each). Reports texts/s of each model and the
total (medians of the rounds) and writes ``loadtest/results/two_models.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "loadtest"))

from service_load import drive  # noqa: E402
from export.data.pairs import read_split  # noqa: E402
from harness import ServerProcess  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = ROOT / "loadtest" / "results" / "two_models.md"


async def load(address: str, texts: list[str], models: list[str], *, concurrency: int, seconds: float
               ) -> dict[str, float]:
    """Closed-loop clients on each of ``models`` at once: texts/s per model."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)

        def sender(model: str):
            async def send(text: str) -> bool:
                try:
                    await stub.Translate(pb.TranslateRequest(texts=[text], model=model), timeout=60)
                    return True
                except grpc.aio.AioRpcError:
                    return False
            return send
        results = await asyncio.gather(*(drive(sender(m), texts, concurrency=concurrency, duration=seconds)
                                         for m in models))
    return {m: r["texts_per_s"] for m, r in zip(models, results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", type=Path, required=True, help="two model version directories")
    p.add_argument("--texts", type=Path, required=True, help="a corpus split (jsonl): its sources")
    p.add_argument("--concurrency", type=int, default=16, help="clients per model")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="--threads of nmt serve (per engine)")
    p.add_argument("--precision", default="int8")
    args = p.parse_args()
    if len(args.model) != 2:
        raise SystemExit("give --model twice")
    texts = [pair.src_raw for pair in read_split(args.texts)][:2000]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        for name, path in zip("ab", args.model):
            # the files copied (the server refuses a symlink out of its repository), the manifest
            # under the name a or b (a version's manifest must name its directory; manifest.json
            # itself has no checksum)
            version = repo / name / "1"
            version.mkdir(parents=True)
            for file in path.resolve().iterdir():
                if file.name != "manifest.json":
                    shutil.copyfile(file, version / file.name)
            raw = json.loads((path / "manifest.json").read_text())
            raw.update(name=name, version="1")
            (version / "manifest.json").write_text(json.dumps(raw))
        log = RESULTS.with_name("two_models_server.log")
        with ServerProcess(repo, log, "--precision", args.precision, "--threads", str(args.threads),
                           "--default-model", "a", startup_timeout=180) as server:
            asyncio.run(load(server.address, texts[:50], ["a", "b"], concurrency=4, seconds=3))  # warm
            figures: dict[str, list[dict[str, float]]] = {"a alone": [], "b alone": [], "both": []}
            for r in range(args.rounds):
                phases = [("a alone", ["a"]), ("b alone", ["b"]), ("both", ["a", "b"])]
                for phase, models in (phases if r % 2 == 0 else phases[::-1]):
                    got = asyncio.run(load(server.address, texts, models, concurrency=args.concurrency,
                                           seconds=args.seconds))
                    figures[phase].append(got)
                    print(f"round {r} {phase}: {got}", flush=True)
    med = {phase: {m: statistics.median(f[m] for f in fs) for m in fs[0]} for phase, fs in figures.items()}
    alone = med["a alone"]["a"] + med["b alone"]["b"]
    lines = [f"Two models in one `nmt serve` (`python loadtest/bench_two_models.py`, {args.precision}, "
             f"--threads {args.threads} per engine, {args.concurrency} closed-loop clients per loaded model, "
             f"{args.seconds:g} s phases, {args.rounds} rounds in alternating order, medians; a = "
             f"`{args.model[0]}`, b = `{args.model[1]}`):", "",
             "| phase | a texts/s | b texts/s | total texts/s |", "|---|---|---|---|",
             f"| a alone | {med['a alone']['a']:.1f} | | {med['a alone']['a']:.1f} |",
             f"| b alone | | {med['b alone']['b']:.1f} | {med['b alone']['b']:.1f} |",
             f"| both at once | {med['both']['a']:.1f} | {med['both']['b']:.1f} | "
             f"{med['both']['a'] + med['both']['b']:.1f} |", "",
             f"Both at once: a keeps {med['both']['a'] / med['a alone']['a']:.0%} of its alone throughput, "
             f"b {med['both']['b'] / med['b alone']['b']:.0%}; the total is "
             f"{(med['both']['a'] + med['both']['b']) / (alone / 2):.2f}x the mean of the two alone."]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
