"""Paths, OpenNMT-py's options for a model of our size, and small helpers."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "loadtest" / "opennmt_compare.py"  # the worker runs as `python ENTRY _onmt-worker`
ONMT_VENV = ROOT / "build" / "onmt-venv"
ONMT_PYTHON = ONMT_VENV / "bin" / "python"
CONSTRAINTS = ROOT / "build" / "onmt-constraints.txt"
RESULTS = ROOT / "loadtest" / "results"
WORK = ROOT / "build" / "opennmt-compare"
TORCH = "2.13.0"
OPENNMT = "3.5.1"
ONMT_DEPS = ["numpy", "configargparse", "pyyaml", "sacrebleu", "six", "waitress", "flask", "rapidfuzz",
             "pyonmttok>=1.37,<2", "sentencepiece", "pyahocorasick", "ctranslate2>=4,<5", "tensorboard",
             "spacy", "fasttext-wheel"]
ONMT_SPECIALS = ("<unk>", "<blank>", "<s>", "</s>")
MAX_LEN = 100  # export/train/training.py TrainConfig.max_len (pieces, EOS counted)
SMOKE_MINUTES = 10.0

# Our ModelConfig / TrainConfig defaults, in OpenNMT's words.
MODEL_OPTIONS = {
    "encoder_type": "brnn", "decoder_type": "rnn", "rnn_type": "GRU",
    "enc_layers": 1, "dec_layers": 1, "enc_hid_size": 512, "dec_hid_size": 512,
    "word_vec_size": 256, "global_attention": "mlp", "input_feed": 1, "bridge": False,
    "dropout": [0.2], "model_dtype": "fp32",
}
OPTIM_OPTIONS = {
    "optim": "adam", "adam_beta1": 0.9, "adam_beta2": 0.999, "learning_rate": 0.001,
    "decay_method": "none", "learning_rate_decay": 1.0, "max_grad_norm": 1.0,
    "label_smoothing": 0.1, "batch_type": "tokens", "batch_size": 3000, "valid_batch_size": 3000,
    "normalization": "tokens", "accum_count": [1], "seed": 1, "num_workers": 0,
    "world_size": 1, "train_steps": 100_000_000,
}


def log(msg: str) -> None:
    print(f"[opennmt_compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def work_dir(corpus: Path, work: Path | None) -> Path:
    return work if work is not None else WORK / corpus.resolve().name


def onmt_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def need_onmt() -> None:
    if not ONMT_PYTHON.exists():
        raise SystemExit(f"{ONMT_PYTHON} missing: run `{sys.argv[0]} setup` first")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def yaml_value(v) -> str:
    """JSON scalars and flat lists are valid YAML."""
    return json.dumps(v)


def write_config(path: Path, options: dict, data: dict) -> None:
    lines = [f"{k}: {yaml_value(v)}" for k, v in options.items()]
    lines.append("data:")
    for name, d in data.items():
        lines.append(f"    {name}:")
        lines += [f"        {k}: {yaml_value(v)}" for k, v in d.items()]
    path.write_text("\n".join(lines) + "\n")


def is_smoke(minutes: float | None = None, max_sentences: int | None = None) -> bool:
    return (minutes is not None and minutes < SMOKE_MINUTES) or max_sentences is not None


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), load average {os.getloadavg()[0]:.2f} at the end"


def last_checkpoint(run: Path) -> Path:
    ckpts = sorted(run.glob("model_step_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not ckpts:
        raise SystemExit(f"{run}: no model_step_*.pt checkpoint")
    return ckpts[-1]


def write_results(name: str, result: dict, markdown: str, *, ensure_ascii: bool = True) -> None:
    """``loadtest/results/<name>.json`` and ``.md``; the Markdown is printed too."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1, ensure_ascii=ensure_ascii) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)
