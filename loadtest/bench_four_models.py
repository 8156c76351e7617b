"""en->fr served alone against en->fr beside three more directions (issue 32): idle latency,
saturated throughput and the process's memory, in alternating rounds.

    python loadtest/bench_four_models.py [--texts build/corpus-v2/test.jsonl] [--rounds 3] [--seconds 15]

Two repositories: ``one`` holds ``en-fr/3``; ``four`` holds it and ``en-de``, ``en-es``,
``fr-en``: the trained ``models/<pair>/1`` where they exist, else stand-ins (copies of en-fr/3
under the other names and languages: the same graphs' sizes, so the same memory and threads,
which is what this measures; the results say which). Each round starts each server (``nmt
serve``, the default threads: the cores divided among the models) and sends en->fr traffic only:
one short text at a time (median latency), then 16 closed-loop clients (texts/s); then reads the
process's resident memory (VmRSS, and its peak VmHWM). Medians over rounds; writes
``loadtest/results/bench_four_models.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "loadtest"))

from harness import ServerProcess  # noqa: E402
from service.decoding.int8_form import reported_flags  # noqa: E402
from service_load import closed_loop, idle_latency  # noqa: E402

SHIPPED = ROOT / "models" / "en-fr" / "3"
OTHERS = ("en-de", "en-es", "fr-en")


def repositories(tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    one, four, kinds = tmp / "one", tmp / "four", {}
    shutil.copytree(SHIPPED, one / "en-fr" / "3")
    shutil.copytree(SHIPPED, four / "en-fr" / "3")
    for name in OTHERS:
        trained = ROOT / "models" / name / "1"
        if (trained / "manifest.json").is_file():
            shutil.copytree(trained, four / name / "1")
            kinds[name] = "trained"
            continue
        version = shutil.copytree(SHIPPED, four / name / "1")
        manifest = json.loads((version / "manifest.json").read_text())
        source, target = name.split("-")
        manifest.update(name=name, version="1", languages={"source": source, "target": target})
        (version / "manifest.json").write_text(json.dumps(manifest, indent=1))
        kinds[name] = "stand-in (en-fr/3's files)"
    return one, four, kinds


def memory_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def one_round(repository: Path, log: Path, texts: list[str], seconds: float) -> dict:
    server = ServerProcess(repository, log, "--default-model", "en-fr")
    try:
        idle = asyncio.run(idle_latency(server.address, texts[:100]))
        load = asyncio.run(closed_loop(server.address, texts, concurrency=16, duration=seconds))
        return {"idle_ms": idle, "texts_per_s": load["texts_per_s"], **memory_mb(server.proc.pid)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=Path, default=ROOT / "build/corpus-v2/test.jsonl")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "bench_four_models")
    args = p.parse_args(argv)
    pairs = [json.loads(line)["src_raw"] for line in args.texts.read_text().splitlines() if line.strip()]
    texts = [t for t in pairs if 4 <= len(t.split()) <= 12]
    rounds: dict[str, list[dict]] = {"one": [], "four": []}
    with tempfile.TemporaryDirectory() as tmp:
        one, four, kinds = repositories(Path(tmp))
        for _ in range(args.rounds):
            for name, repository in (("one", one), ("four", four)):
                rounds[name].append(one_round(repository, Path(tmp) / f"{name}.log", texts, args.seconds))
                print(name, rounds[name][-1], flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    machine = {"cpu": f"{platform.machine()}, {os.cpu_count()} CPUs", "flags": reported_flags()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "models": kinds, "medians": med,
                                                         "rounds": rounds}, indent=1) + "\n")
    lines = ["# en->fr alone, and beside three more directions (loadtest/bench_four_models.py)", "",
             f"`python loadtest/bench_four_models.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
             f"{machine['cpu']}, CPU flags {', '.join(machine['flags']) or 'none'}; {args.rounds} alternating rounds, "
             f"medians; en->fr traffic only. The other three: "
             + ", ".join(f"{n} {k}" for n, k in kinds.items()) + ".", "",
             "| served | en->fr idle ms | en->fr texts/s, 16 clients | RSS MB | peak RSS MB |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {m['idle_ms']:.2f} | {m['texts_per_s']:.1f} | {m['VmRSS']:.0f} | {m['VmHWM']:.0f} |"
              for name, m in med.items()]
    lines += ["", f"Four against one: idle {med['four']['idle_ms'] / med['one']['idle_ms']:.2f}x, "
              f"saturated {med['four']['texts_per_s'] / med['one']['texts_per_s']:.2f}x."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
