"""Engine benchmark (not a test): ONNX Runtime engine (fp32, int8) against PyTorch eager.

    python loadtest/bench_engine.py REPOSITORY CHECKPOINT TEST_SPLIT \\
        [--max-sentences 256] [--repeats 3] [--threads 2]

Decodes the first ``--max-sentences`` sources of the test split in consecutive
batches of 1, 8, 32 and 64 sentences, greedy and beam 5, with each engine:
``service.decoding.engine.Engine`` on the fp32 and int8 graphs, and the PyTorch
reference ``export.train.search.beam_search`` (batched, ``torch.inference_mode``, the
same search algorithm) on the checkpoint the graphs came from, in fp32 and with
bf16 weights and activations (``model.to(torch.bfloat16)``), all with the same
number of threads. Both include tokenization and detokenization. Reports target
tokens/s (best hypothesis, EOS excluded) and sentences/s (median of the
repeats), the share of outputs identical to PyTorch's, and at batch 64 the
achieved useful FLOP/s against a numpy fp32 matrix product of the output
projection's shape. Writes ``loadtest/results/bench_engine.md`` and ``.json``.
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv(default: int = 2) -> int:
    """--threads, read before numpy starts its BLAS pool (it reads the variables once)."""
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
    return default


for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(_threads_from_argv())

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime  # noqa: E402
import torch  # noqa: E402

from export.train.checkpoint import load_checkpoint  # noqa: E402
from export.train.model import RNNSearch  # noqa: E402
from export.train.search import beam_search  # noqa: E402
from export.train.training import collate  # noqa: E402
from service.decoding.engine import Engine  # noqa: E402
from service.models.config import ModelConfig  # noqa: E402
from service.models.manifest import load_manifest  # noqa: E402
from service.options import DecodingOptions  # noqa: E402

BATCH_SIZES = (1, 8, 32, 64)
BEAMS = (1, 5)
MAX_LEN, MAX_RATIO, LENGTH_PENALTY = 200, 3.0, 1.0  # the same limits on both sides
FLOPS_BATCH = 64
PROFILE_SHAPES = ((1, 128), (4, 32), (5, 32), (1, 256))  # (beam, texts per batch): 128 rows, beam 5's 160,
# and 256 texts greedy: the batch stays at >= 128 rows for longer
RESULTS = Path(__file__).parent / "results"


@dataclass
class Run:
    engine: str  # "onnx-fp32", "onnx-int8", "torch-eager"
    beam: int
    batch: int
    sentences: int
    target_tokens: int
    seconds: float  # median wall time over repeats
    cpu_seconds: float  # median process CPU time (all threads; steadier on a shared machine)
    identical_to_torch: float | None = None  # share of best hypotheses equal to torch's
    useful_flops: float | None = None  # decoder + encoder FLOPs of the texts' real lengths

    @property
    def tokens_per_s(self) -> float:
        return self.target_tokens / self.seconds

    @property
    def sentences_per_s(self) -> float:
        return self.sentences / self.seconds


def step_flops(cfg: ModelConfig, src_len: int) -> float:
    """Multiply-add FLOPs (x2) of one decoder step of one row over a source of src_len."""
    ctx, dec, emb = cfg.ctx_size, cfg.dec_hidden_size, cfg.emb_size
    attention = dec * cfg.attn_size + src_len * cfg.attn_size + src_len * ctx
    cell = (emb + ctx) * 3 * dec + dec * 3 * dec
    output = (dec + emb + ctx) * 2 * cfg.out_size + cfg.out_size * cfg.tgt_vocab_size
    return 2.0 * (attention + cell + output)


def encoder_flops(cfg: ModelConfig, src_len: int) -> float:
    h = cfg.enc_hidden_size
    per_token = 2 * (cfg.emb_size * 3 * h + h * 3 * h) + cfg.ctx_size * cfg.attn_size
    return 2.0 * (src_len * per_token + h * cfg.dec_hidden_size)


def timed(fn: Callable[[], list], repeats: int) -> tuple[float, float, list]:
    """(median wall seconds, median process CPU seconds, the last output)."""
    walls, cpus, out = [], [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), out


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def onnx_decode(engine: Engine, sources: list[str], batch: int, beam: int) -> list[tuple[list[str], int]]:
    """(best hypothesis pieces, decoder steps) per sentence."""
    options = DecodingOptions(beam_size=beam, length_penalty=LENGTH_PENALTY, max_decoding_length=MAX_LEN,
                              max_length_ratio=MAX_RATIO)
    out = []
    for chunk in chunks(sources, batch):
        out += [(list(t.hypotheses[0].tokens), t.steps) for t in engine.translate(chunk, options)]
    return out


def torch_decode(model: RNNSearch, engine: Engine, sources: list[str], batch: int, beam: int
                 ) -> list[tuple[list[str], int]]:
    tok = engine.tokenizer
    out = []
    for chunk in chunks(sources, batch):
        encoded = [tok.encode(s) for s in chunk]
        src, lengths, _, _ = collate([(e.ids, [engine.special.eos]) for e in encoded])
        hyps = beam_search(model, src, lengths, beam_size=beam, length_penalty=LENGTH_PENALTY,
                           max_len=MAX_LEN, max_ratio=MAX_RATIO)
        for e, h in zip(encoded, hyps):
            tok.decode(h[0].tokens, e.placeholders)  # the same detokenization work as the engine
            out.append((tok.target_pieces(h[0].tokens), -1))
    return out


def matmul_flops(cfg: ModelConfig, rows: int, repeats: int = 20) -> float:
    """FLOP/s of a numpy fp32 (rows, out_size) @ (out_size, vocab_size) product."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, cfg.out_size), dtype=np.float32)
    b = rng.standard_normal((cfg.out_size, cfg.tgt_vocab_size), dtype=np.float32)
    a @ b  # warm-up
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2.0 * rows * cfg.out_size * cfg.tgt_vocab_size / best


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.checkpoint)
    model, cfg = ckpt.model(), ckpt.config
    model_bf16 = load_checkpoint(args.checkpoint).model().to(torch.bfloat16)  # bf16 weights and activations
    with args.test_split.open(encoding="utf-8") as f:
        sources = [json.loads(line)["src_raw"] for line in f if line.strip()][: args.max_sentences]
    precisions = load_manifest(args.repository).graphs
    engines = {f"onnx-{p}": Engine(args.repository, precision=p, intra_op_threads=args.threads)
               for p in ("fp32", "int8") if p in precisions}
    fp32 = engines["onnx-fp32"]
    src_lens = [len(fp32.tokenizer.encode(s).ids) for s in sources]
    runs: list[Run] = []
    for beam in args.beams:
        for batch in args.batch_sizes:
            print(f"beam {beam} batch {batch}", flush=True)
            deciders = {name: (lambda texts, e=e: onnx_decode(e, texts, batch, beam))
                        for name, e in engines.items()}
            deciders["torch-eager"] = lambda texts: torch_decode(model, fp32, texts, batch, beam)
            if args.bf16:
                deciders["torch-bf16"] = lambda texts: torch_decode(model_bf16, fp32, texts, batch, beam)
            outputs = {}
            for name, fn in deciders.items():
                fn(sources[:batch])  # warm-up: sessions, allocators, caches
                seconds, cpu, outputs[name] = timed(lambda: fn(sources), args.repeats)
                tokens = sum(len(pieces) for pieces, _ in outputs[name])
                runs.append(Run(engine=name, beam=beam, batch=batch, sentences=len(sources),
                                target_tokens=tokens, seconds=seconds, cpu_seconds=cpu))
            reference = [pieces for pieces, _ in outputs["torch-eager"]]
            steps = [s for _, s in outputs["onnx-fp32"]]  # torch runs the same steps (same algorithm)
            flops = sum(beam * n * step_flops(cfg, length) + encoder_flops(cfg, length)
                        for n, length in zip(steps, src_lens))
            for run in runs[-len(deciders):]:
                mine = [pieces for pieces, _ in outputs[run.engine]]
                run.identical_to_torch = sum(a == b for a, b in zip(mine, reference)) / len(reference)
                run.useful_flops = flops
    return {"runs": runs, "matmul_flops": {beam: matmul_flops(cfg, FLOPS_BATCH * beam) for beam in args.beams},
            "model": cfg.to_dict(), "parameters": model.num_parameters()}


def write(results: dict, args: argparse.Namespace) -> None:
    runs: list[Run] = results["runs"]
    torch_tps = {(r.beam, r.batch): r.tokens_per_s for r in runs if r.engine == "torch-eager"}
    torch_cpu = {(r.beam, r.batch): r.target_tokens / r.cpu_seconds for r in runs if r.engine == "torch-eager"}
    lines = [
        "# Engine benchmark", "",
        f"Model: {results['parameters'] / 1e6:.2f}M parameters; {runs[0].sentences} sentences of "
        f"`{args.test_split}`; {args.threads} threads; median of {args.repeats} runs; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; onnxruntime "
        f"{onnxruntime.__version__}, torch {torch.__version__}.", "",
        "| engine | beam | batch | sentences/s | target tokens/s | x torch | tokens per CPU-s | x torch (CPU) "
        "| identical to torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(runs, key=lambda r: (r.beam, r.batch, r.engine)):
        per_cpu = r.target_tokens / r.cpu_seconds
        lines.append(f"| {r.engine} | {r.beam} | {r.batch} | {r.sentences_per_s:.1f} | {r.tokens_per_s:.0f} | "
                     f"{r.tokens_per_s / torch_tps[(r.beam, r.batch)]:.2f} | {per_cpu:.0f} | "
                     f"{per_cpu / torch_cpu[(r.beam, r.batch)]:.2f} | {r.identical_to_torch:.3f} |")
    lines += ["", f"## Achieved FLOP/s at batch {FLOPS_BATCH}", "",
              "Useful FLOPs (encoder + decoder steps over each text's real length, matrix products "
              "only) per second, against a numpy fp32 product (rows, out_size) @ (out_size, vocab_size) "
              "with rows = batch x beam.", "",
              "| engine | beam | GFLOP/s | numpy matmul GFLOP/s | share |", "|---|---:|---:|---:|---:|"]
    for r in runs:
        if r.batch == FLOPS_BATCH:
            achieved, peak = r.useful_flops / r.seconds, results["matmul_flops"][r.beam]
            lines.append(f"| {r.engine} | {r.beam} | {achieved / 1e9:.2f} | {peak / 1e9:.2f} | {achieved / peak:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_engine.md").write_text("\n".join(lines) + "\n")
    payload = {**results, "runs": [{**asdict(r), "tokens_per_s": r.tokens_per_s,
                                    "sentences_per_s": r.sentences_per_s} for r in runs],
               "threads": args.threads, "repeats": args.repeats, "test_split": str(args.test_split),
               "onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "cpus": os.cpu_count()}
    (args.out / "bench_engine.json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines))


def profile_steps(args: argparse.Namespace) -> None:
    """``--profile``: time inside ``Runtime.step`` against the whole ``Batch.step``."""
    from step_profile import profile, table

    with args.test_split.open(encoding="utf-8") as f:
        sources = [json.loads(line)["src_raw"] for line in f if line.strip()][: args.max_sentences]
    profiles = []
    for precision in ("fp32", "int8"):
        engine = Engine(args.repository, precision=precision, intra_op_threads=args.threads)
        for beam, texts in PROFILE_SHAPES:
            profile(engine, sources[:texts], beam=beam, texts=texts, max_len=MAX_LEN, max_ratio=MAX_RATIO)
            profiles.append(profile(engine, sources, beam=beam, texts=texts, max_len=MAX_LEN,
                                    max_ratio=MAX_RATIO))
    lines = ["# Where a decoder step's time goes", "",
             f"`python loadtest/bench_engine.py {args.repository} {args.checkpoint} {args.test_split} --profile "
             f"--threads {args.threads} --max-sentences {args.max_sentences}`; {len(sources)} sentences; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; onnxruntime "
             f"{onnxruntime.__version__}. Medians over every step. Outside ONNX Runtime: "
             "(Batch.step - Runtime.step) / Runtime.step.", "", *table(profiles)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_engine_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repository", type=Path, help="models/<name>/<version>")
    p.add_argument("checkpoint", type=Path, help="the checkpoint the repository was exported from")
    p.add_argument("test_split", type=Path, help="test.jsonl (src_raw per line)")
    p.add_argument("--max-sentences", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of both engines")
    p.add_argument("--out", type=Path, default=RESULTS, help="where bench_engine.md/.json go")
    p.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")], default=list(BATCH_SIZES))
    p.add_argument("--beams", type=lambda v: [int(x) for x in v.split(",")], default=list(BEAMS))
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip PyTorch with bf16 weights")
    p.add_argument("--profile", action="store_true",
                   help="only the step profile: time in Runtime.step against the rest of a step")
    args = p.parse_args(argv)
    if args.profile:
        profile_steps(args)
        return 0
    write(bench(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
