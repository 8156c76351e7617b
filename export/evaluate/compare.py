"""The seeds' systems side by side (``nmt compare``): BLEU by sentence length, step cost, attention.

``nmt compare --system NAME=CHECKPOINT ... --corpus CORPUS --output models/evaluation``
evaluates every system with the PyTorch reference decoders (``export.evaluate.evaluate``:
detokenized, placeholders restored, sacreBLEU/chrF against the catalogs'
translations) on the test split and on the long-message set (``long.jsonl``,
when the corpus has one), and writes:

- ``comparison.json`` and ``comparison.md``: per system, BLEU and chrF on each
  set (beam 5 and greedy), BLEU by source length in words over both sets
  together, the int8 decoder step's median milliseconds at 32 rows (its
  exported graph on ONNX Runtime, the systems timed in alternating rounds),
  and the parameter count;
- ``bleu-by-length.png``: BLEU against source length, one line per system
  (Bahdanau et al.'s figure 2 on this data);
- ``attention-<k>.png``: for each sentence of ``--heatmap``, the greedy
  attention of every system that has one, one panel each, sized by the
  sentence so the labels stay readable at any length.

Sentences any system trained on are not scored: pass every system's training
corpus with ``--exclude-train`` (their ``train.jsonl`` sources are removed
from both sets).

``--step-only`` times the int8 steps again into an existing ``comparison.json``
(the scores stay): for a comparison whose timing shared the CPU with other work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import sacrebleu
import torch

from export.data.pairs import Pair, read_split
from export.evaluate.evaluate import decode, letters
from export.evaluate.heatmaps import plot_attention
from export.train.checkpoint import load_checkpoint
from export.train.model import RNNSearch
from service.models.attention import has_attention
from service.text.tokenizer import Tokenizer

BUCKETS = ((1, 5), (6, 10), (11, 15), (16, 20), (21, 30), (31, 40), (41, 1000))  # source words
MIN_BUCKET = 50  # a length bucket with fewer sentences is reported, not plotted
STEP_ROWS, STEP_SRC_LEN, STEP_ROUNDS, STEP_CALLS = 32, 24, 7, 30
HEATMAPS = (
    "Unknown error",  # adjective after the noun in French: erreur inconnue
    "Show hidden files",
    "The selected file could not be opened because the disk is full.",
    "Could not open the configuration file {path}: the permission was denied by the operating system",
)


def bucket_of(words: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= words <= hi:
            return f"{lo}-{hi}" if hi < 1000 else f"{lo}+"
    raise ValueError(words)


def bleu_chrf(hyps: list[str], refs: list[str]) -> dict:
    return {"bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2), "sentences": len(hyps)}


def held_out(corpus: Path) -> dict[str, list[Pair]]:
    """The test split and, when the corpus has one, the long set."""
    sets = {"test": read_split(corpus / "test.jsonl")}
    if (corpus / "long.jsonl").exists():
        sets["long"] = read_split(corpus / "long.jsonl")
    return sets


def step_milliseconds(models: dict[str, RNNSearch], threads: int = 2) -> dict[str, float]:
    """Median ms of each system's int8 decoder step at ``STEP_ROWS`` rows, in alternating rounds."""
    import onnxruntime as ort

    from export.graphs.onnx_export import GRAPHS, export_graphs
    from service.decoding.layout import width

    sessions, feeds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            root = Path(tmp) / name
            root.mkdir()
            export_graphs(model, root, quantize=True)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
            sessions[name] = ort.InferenceSession(str(root / GRAPHS["int8"]["decoder_step"]), opts)
            enc = ort.InferenceSession(str(root / GRAPHS["int8"]["encoder"]), opts)
            rng = np.random.default_rng(0)
            cols = width(STEP_SRC_LEN)
            src = rng.integers(4, model.config.src_vocab_size, (STEP_ROWS, cols)).astype(np.int64)
            src[:, STEP_SRC_LEN:] = model.config.pad_id
            lengths = np.full(STEP_ROWS, STEP_SRC_LEN, dtype=np.int64)
            annotations, keys, state = enc.run(None, {"src_ids": src, "src_lengths": lengths})
            feeds[name] = {"prev_tokens": rng.integers(4, model.config.tgt_vocab_size, STEP_ROWS).astype(np.int64),
                           "state": state, "annotations": annotations, "keys": keys,
                           "src_mask": src != model.config.pad_id, "k": np.array(5, dtype=np.int64)}
        times: dict[str, list[float]] = {name: [] for name in models}
        fetch = ["topk_log_probs", "topk_ids", "next_state", "attention"]
        for _ in range(STEP_ROUNDS):
            for name, session in sessions.items():
                session.run(fetch, feeds[name])  # warm
                start = time.perf_counter()
                for _ in range(STEP_CALLS):
                    session.run(fetch, feeds[name])
                times[name].append((time.perf_counter() - start) / STEP_CALLS * 1e3)
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


def plot_bleu_by_length(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, r in results["systems"].items():
        buckets = [(b, v) for b, v in r["bleu_by_source_words"].items() if v["sentences"] >= MIN_BUCKET]
        ax.plot([b for b, _ in buckets], [v["bleu"] for _, v in buckets], marker="o", label=name)
    ax.set_xlabel("source sentence length (words), test split + long set")
    ax.set_ylabel("BLEU (beam 5)")
    ax.set_title("BLEU by source length (buckets of at least %d sentences)" % MIN_BUCKET, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict) -> str:
    systems = results["systems"]
    sets = list(next(iter(systems.values()))["sets"])
    lines = ["| system | attention | parameters | " + " | ".join(
        f"{s} BLEU | {s} chrF" for s in sets) + " | greedy test BLEU | int8 step ms (32 rows) |",
        "|---|---|---|" + "---|---|" * len(sets) + "---|---|"]
    for name, r in systems.items():
        cells = " | ".join(f"{r['sets'][s]['beam5']['bleu']} | {r['sets'][s]['beam5']['chrf']}" for s in sets)
        lines.append(f"| {name} | {r['attention']} | {r['parameters'] / 1e6:.2f}M | {cells} | "
                     f"{r['sets']['test']['greedy']['bleu']} | {r['step_ms']} |")
    buckets = list(next(iter(systems.values()))["bleu_by_source_words"])
    lines += ["", "BLEU (beam 5) by source length in words, test split and long set together:", "",
              "| words | sentences | " + " | ".join(systems) + " |", "|---|---|" + "---|" * len(systems)]
    first = next(iter(systems.values()))["bleu_by_source_words"]
    for b in buckets:
        lines.append(f"| {b} | {first[b]['sentences']} | " + " | ".join(
            str(r["bleu_by_source_words"][b]["bleu"]) for r in systems.values()) + " |")
    lines += ["", f"Sentences: {', '.join(f'{s} {n}' for s, n in results['sentences'].items())} "
              f"(left out: {results['left_out']} whose letters match a training source)."]
    return "\n".join(lines) + "\n"


def compare(systems: dict[str, Path], corpus: Path, output: Path, *, exclude_train: list[Path],
            heatmaps: tuple[str, ...] = HEATMAPS, max_sentences: int | None = None, threads: int = 2,
            log=print) -> dict:
    torch.set_num_threads(threads)
    output.mkdir(parents=True, exist_ok=True)
    checkpoints = {name: load_checkpoint(path) for name, path in systems.items()}
    models = {name: c.model() for name, c in checkpoints.items()}
    excluded = set()
    for train in exclude_train:
        excluded |= {letters(p.src) for p in read_split(train)}
    # without any source a system trained on (by letters)
    all_sets = held_out(corpus)
    kept = {name: [p for p in pairs if letters(p.src) not in excluded] for name, pairs in all_sets.items()}
    sets = {name: pairs[:max_sentences] for name, pairs in kept.items()}
    results = {"corpus": str(corpus), "sentences": {s: len(p) for s, p in sets.items()},
               "left_out": sum(len(all_sets[s]) - len(kept[s]) for s in sets),
               "metric": "sacreBLEU/chrF, detokenized, placeholders restored, PyTorch reference decoders",
               "systems": {}}
    with tempfile.TemporaryDirectory() as tmp:
        toks = {}  # each system with its own SentencePiece models (en-fr/1's are corpus v1's)
        for name, ckpt in checkpoints.items():
            (Path(tmp) / name).mkdir()
            for file, data in ckpt.tokenizers.items():
                (Path(tmp) / name / file).write_bytes(data)
            toks[name] = Tokenizer(Path(tmp) / name / "source.model", Path(tmp) / name / "target.model")
        for name, ckpt in checkpoints.items():
            tok = toks[name]
            r = {"checkpoint": str(systems[name]), "attention": ckpt.config.attention,
                 "parameters": models[name].num_parameters(), "train_state": ckpt.extra.get("train_state", {}),
                 "sets": {}}
            pooled_hyps: list[str] = []
            pooled: list[Pair] = []
            for set_name, pairs in sets.items():
                r["sets"][set_name] = {}
                for beam in (1, 5):
                    decoded = decode(models[name], tok, [p.src_raw for p in pairs], beam_size=beam)
                    r["sets"][set_name][decoded.name] = bleu_chrf(decoded.texts, [p.tgt_raw for p in pairs])
                    if beam == 5:
                        pooled_hyps += decoded.texts
                        pooled += pairs
                log(f"{name} {set_name}: {r['sets'][set_name]}")
            by_bucket: dict[str, list[int]] = {}
            for i, p in enumerate(pooled):
                by_bucket.setdefault(bucket_of(len(p.src_raw.split())), []).append(i)
            r["bleu_by_source_words"] = {
                b: bleu_chrf([pooled_hyps[i] for i in by_bucket[b]], [pooled[i].tgt_raw for i in by_bucket[b]])
                for b in (bucket_of(lo) for lo, _ in BUCKETS) if b in by_bucket}
            results["systems"][name] = r
        for name, ms in step_milliseconds(models, threads).items():
            results["systems"][name]["step_ms"] = ms
        attending = {n: (m, toks[n]) for n, m in models.items() if has_attention(m.config.attention)}
        results["heatmaps"] = []
        for k, sentence in enumerate(heatmaps):
            if attending:
                translations = plot_attention(attending, sentence, output / f"attention-{k}.png")
                results["heatmaps"].append({"file": f"attention-{k}.png", "source": sentence,
                                            "translations": translations})
    plot_bleu_by_length(results, output / "bleu-by-length.png")
    return write(results, output)


def write(results: dict, output: Path) -> dict:
    """``comparison.json`` and ``comparison.md`` in ``output``."""
    (output / "comparison.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    (output / "comparison.md").write_text(markdown(results))
    return results


def retime(systems: dict[str, Path], output: Path, *, threads: int = 2) -> dict:
    """Time the int8 steps again for ``output/comparison.json`` (``--step-only``); the scores stay.

    For a comparison whose timing shared the CPU with other work: the step figures are
    ratios of alternating rounds, but only a quiet machine gives them their absolute value.
    """
    path = output / "comparison.json"
    results = json.loads(path.read_text())
    if set(systems) != set(results["systems"]):
        raise ValueError(f"--system: {path} compares {sorted(results['systems'])}, got {sorted(systems)}")
    models = {name: load_checkpoint(p).model() for name, p in systems.items()}
    for name, ms in step_milliseconds(models, threads).items():
        results["systems"][name]["step_ms"] = ms
    return write(results, output)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nmt compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", action="append", required=True, metavar="NAME=CHECKPOINT",
                   help="a system to compare (repeatable)")
    p.add_argument("--corpus", type=Path, required=True, help="corpus directory (test.jsonl, long.jsonl)")
    p.add_argument("--output", "-o", type=Path, required=True)
    p.add_argument("--exclude-train", type=Path, action="append", default=[],
                   help="a train.jsonl some system trained on: its sources are not scored (repeatable)")
    p.add_argument("--heatmap", action="append", help="sentence to plot (repeatable)")
    p.add_argument("--max-sentences", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--step-only", action="store_true",
                   help="only time the int8 steps again, into the --output comparison.json and .md")
    args = p.parse_args(argv)
    systems = {}
    for item in args.system:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--system must be NAME=CHECKPOINT, got {item!r}")
        systems[name] = Path(path)
    if args.step_only:
        print(markdown(retime(systems, args.output, threads=args.threads)))
        return 0
    results = compare(systems, args.corpus, args.output, exclude_train=args.exclude_train,
                      heatmaps=tuple(args.heatmap) if args.heatmap else HEATMAPS,
                      max_sentences=args.max_sentences, threads=args.threads)
    print(markdown(results))
    return 0
