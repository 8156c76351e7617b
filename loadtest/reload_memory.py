"""Memory over model reloads: 20 load/unload cycles of a model version, RSS after each.

    python loadtest/reload_memory.py --model-repository models/en-fr/4 [--cycles 20]

An in-process server (``tests/harness.py``) serves ``<tmp>/en-fr/<n>/``; each cycle
copies the model in as version n + 1 (hard links: no disk copy), rescans (the new
version loads, warms up and takes over; the old one drains and closes), removes
the old directory, translates once, and reads this process's resident memory.
Reported: RSS after the first and the last cycle and the growth between them
(the issue's bound: 10 %). Writes ``loadtest/results/reload_memory.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import ServerThread, config_for  # noqa: E402
from service.models.manifest import MANIFEST  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def add_version(source: Path, root: Path, version: int) -> None:
    target = root / "en-fr" / str(version)
    shutil.copytree(source, target, copy_function=os.link)
    raw = json.loads((source / MANIFEST).read_text())
    raw["version"] = str(version)
    (target / MANIFEST).unlink()  # a link to the source's: write a file of its own
    (target / MANIFEST).write_text(json.dumps(raw))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", type=Path, default=ROOT / "models" / "en-fr" / "1")
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "reload_memory.md")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="nmt-reload-"))
    samples: list[float] = []
    try:
        add_version(args.model_repository.resolve(), root, 1)
        with ServerThread(config_for(root, "--max-texts", "8")) as server:
            for n in range(2, args.cycles + 2):
                add_version(args.model_repository.resolve(), root, n)
                asyncio.run_coroutine_threadsafe(server.app.models.rescan(), server.loop).result(300)
                shutil.rmtree(root / "en-fr" / str(n - 1))
                reply = server.api.Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=60)
                assert reply.model_version == str(n), reply.model_version
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0.5), server.loop).result()  # drains close
                samples.append(rss_mb())
                print(f"cycle {n - 1}: version {n} serving, RSS {samples[-1]:.0f} MB", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    growth = samples[-1] / samples[0] - 1
    lines = ["# RSS over model reloads", "",
             f"`python loadtest/reload_memory.py --model-repository {args.model_repository} --cycles {args.cycles}`: "
             f"{args.cycles} cycles of load (a new version, warmed up) and unload (the old one drained and "
             "closed), RSS of the serving process after each.", "",
             f"RSS after cycle 1: {samples[0]:.0f} MB; after cycle {len(samples)}: {samples[-1]:.0f} MB; "
             f"growth {growth:+.1%} (bound: 10 %).", "",
             "| cycle | RSS MB |", "|---:|---:|", *(f"| {i + 1} | {s:.0f} |" for i, s in enumerate(samples))]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:5]))
    return 0 if growth <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
