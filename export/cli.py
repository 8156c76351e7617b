"""Offline subcommands of ``nmt`` (entry-point group ``nmt.commands``).

Every expected failure (missing path, corrupt catalog, empty corpus, foreign
checkpoint) is one line on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Callable

from export.data.corpus import CorpusError
from export.train.checkpoint import CheckpointError
from service.errors import ModelRepositoryError
from service.models.attention import DEFAULT as DEFAULT_KIND
from service.models.attention import KINDS

EXPECTED = (CorpusError, CheckpointError, ModelRepositoryError, FileExistsError, FileNotFoundError, ValueError)


def one_line_errors(name: str) -> Callable:
    def wrap(fn: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
        @functools.wraps(fn)
        def run(argv: list[str]) -> int:
            try:
                return fn(argv) or 0
            except EXPECTED as e:
                print(f"nmt {name}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                      file=sys.stderr)
                return 2
        return run
    return wrap


@one_line_errors("corpus")
def corpus_main(argv: list[str]) -> int:
    from export.data import corpus

    p = argparse.ArgumentParser(prog="nmt corpus", description=corpus.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", "-o", type=Path, required=True, help="corpus directory to write")
    p.add_argument("--language", default="fr", choices=sorted(corpus.LANGUAGES),
                   help="target language: the catalogs read are */<language>/LC_MESSAGES/*.po|mo (default: fr)")
    p.add_argument("--reverse", type=Path, default=None, metavar="CORPUS",
                   help="instead: write CORPUS turned around (fr-en from en-fr), same sentences per split")
    p.add_argument("--catalogs", type=Path, nargs="*", default=None,
                   help="directories searched for */<language>/LC_MESSAGES/*.po|mo "
                        "(default: /usr/share/locale and the installed Python packages)")
    p.add_argument("--no-catalogs", action="store_true", help="use only --tsv/--parallel data")
    p.add_argument("--exclude", nargs="*", default=list(corpus.DEFAULT_EXCLUDE),
                   help="gettext domains (glob) to skip (default: %(default)s)")
    p.add_argument("--tsv", type=Path, action="append", default=[], help="source<TAB>target file")
    p.add_argument("--parallel", type=Path, nargs=2, action="append", default=[],
                   metavar=("SOURCE", "TARGET"), help="two line-aligned text files")
    p.add_argument("--max-chars", type=int, default=corpus.CorpusConfig.max_chars)
    args = p.parse_args(argv)
    if args.reverse is not None:
        from export.data.reverse import reverse
        reverse(args.reverse, args.output)
        return 0
    roots = [] if args.no_catalogs else (args.catalogs or corpus.default_roots())
    parallel = [(t, None) for t in args.tsv] + [(s, t) for s, t in args.parallel]
    if not roots and not parallel:
        raise CorpusError("no input: give --catalogs, --tsv or --parallel")
    corpus.build(roots, args.output, config=corpus.CorpusConfig(max_chars=args.max_chars),
                 parallel=parallel, exclude=tuple(args.exclude), language=args.language)
    return 0


@one_line_errors("tokenizers")
def tokenizers_main(argv: list[str]) -> int:
    from export.data import tokenizers

    p = argparse.ArgumentParser(prog="nmt tokenizers", description=tokenizers.__doc__)
    p.add_argument("corpus", type=Path, help="corpus directory (train.jsonl)")
    p.add_argument("--output", "-o", type=Path, required=True)
    p.add_argument("--src-vocab-size", type=int, default=8000)
    p.add_argument("--tgt-vocab-size", type=int, default=8000)
    args = p.parse_args(argv)
    src, tgt = tokenizers.train(args.corpus, args.output, src_vocab_size=args.src_vocab_size,
                                tgt_vocab_size=args.tgt_vocab_size)
    print(f"tokenizers: {src} {tgt}")
    return 0


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def train_parser() -> argparse.ArgumentParser:
    """``nmt train``'s options (also read by loadtest/opennmt/levers.py to recognise a finished run)."""
    from export.train import training as train
    from export.train.recipe import BF16_SETTINGS, SCHEDULES

    d = train.TrainConfig()
    p = argparse.ArgumentParser(prog="nmt train", description=train.__doc__)
    p.add_argument("corpus", type=Path, help="corpus directory (train.jsonl, valid.jsonl)")
    p.add_argument("--tokenizers", type=Path, required=True, help="directory with source.model, target.model")
    p.add_argument("--output", "-o", type=Path, required=True, help="run directory (best.pt, last.pt)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="time budget")
    p.add_argument("--max-epochs", type=int, default=d.max_epochs)
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="stop after this many updates (0: no step limit); a budget that CPU sharing "
                        "does not change, for comparing runs")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--label-smoothing", type=_fraction, default=d.label_smoothing,
                   help="the target's probability mass spread over the vocabulary, in [0, 1) (OpenNMT-py's 0.1)")
    p.add_argument("--validate-minutes", type=float, default=d.validate_minutes)
    p.add_argument("--validate-steps", type=int, default=d.validate_steps,
                   help="validate every this many steps instead of minutes (0: by minutes)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--init-uniform", type=float, default=d.init_uniform,
                   help="draw a new model's weights from uniform(-x, x), as OpenNMT-py (0: PyTorch's defaults)")
    p.add_argument("--resume", type=Path, help="continue from a last.pt")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear learning-rate warm-up")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default=d.lr_schedule,
                   help="after the warm-up: halve the rate when the validation BLEU stalls (plateau), or "
                        "lr * sqrt(warmup / step) (rsqrt)")
    p.add_argument("--ema-decay", type=float, default=d.ema_decay,
                   help="keep an exponential moving average of the weights (e.g. 0.999), written as ema.pt")
    p.add_argument("--valid-long", type=int, default=d.valid_long,
                   help="also decode the N longest validation pairs for the BLEU that chooses best.pt")
    p.add_argument("--bf16", choices=BF16_SETTINGS, default=d.bf16,
                   help="bf16 autocast of the forward pass: auto where the CPU has AMX or AVX-512 BF16")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep every validation's weights as checkpoints/step-N.pt (fp16), to average")
    for name in ("emb_size", "enc_hidden_size", "dec_hidden_size", "attn_size", "out_size"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--tie-embeddings", action="store_true", default=None,
                   help="the output layer's weights are the target embeddings (needs out_size == emb_size)")
    p.add_argument("--attention", choices=KINDS,
                   help=f"how the decoder reads the source (default {DEFAULT_KIND}; none: RNNencdec)")
    return p


def train_settings(args: argparse.Namespace) -> tuple[dict, object]:
    """(the model config given, the TrainConfig) of parsed ``nmt train`` options."""
    from export.train import training as train

    model_config = {k: getattr(args, k) for k in ("emb_size", "enc_hidden_size", "dec_hidden_size",
                                                  "attn_size", "out_size", "dropout", "attention", "tie_embeddings")
                    if getattr(args, k) is not None}
    config = train.TrainConfig(minutes=args.minutes, max_epochs=args.max_epochs, max_steps=args.max_steps,
                               batch_tokens=args.batch_tokens, lr=args.lr, label_smoothing=args.label_smoothing,
                               validate_minutes=args.validate_minutes, validate_steps=args.validate_steps,
                               seed=args.seed, threads=args.threads, init_uniform=args.init_uniform,
                               warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule,
                               ema_decay=args.ema_decay, valid_long=args.valid_long,
                               keep_checkpoints=args.keep_checkpoints, bf16=args.bf16)
    return model_config, config


@one_line_errors("train")
def train_main(argv: list[str]) -> int:
    from export.train import training as train

    args = train_parser().parse_args(argv)
    model_config, config = train_settings(args)
    best = train.train(args.corpus, args.tokenizers, args.output, model_config=model_config,
                       config=config, resume=args.resume)
    print(f"best checkpoint: {best}")
    return 0


@one_line_errors("release")
def release_main(argv: list[str]) -> int:
    from export.train.checkpoint import release

    p = argparse.ArgumentParser(prog="nmt release",
                                description="Strip a training checkpoint for shipping: fp16 weights, "
                                            "no optimizer state (half the size; evaluate and export the result).")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--average", type=Path, nargs="+", default=[], metavar="CHECKPOINT",
                   help="average the weights with these checkpoints of the same run (e.g. the last "
                        "ones `nmt train --keep-checkpoints` kept)")
    args = p.parse_args(argv)
    if args.output.exists() and not args.force:
        raise FileExistsError(f"{args.output}: exists (use --force to overwrite)")
    release(args.checkpoint, args.output, average=args.average)
    print(f"released {args.checkpoint} -> {args.output} ({args.output.stat().st_size / 1e6:.1f} MB)")
    return 0


@one_line_errors("evaluate")
def evaluate_main(argv: list[str]) -> int:
    from export.evaluate import evaluate

    return evaluate.main(argv)


@one_line_errors("export")
def export_main(argv: list[str]) -> int:
    from export.graphs import repository

    return repository.main(argv)


@one_line_errors("prune")
def prune_main(argv: list[str]) -> int:
    from export.graphs.repository import prune_repository

    p = argparse.ArgumentParser(prog="nmt prune", description=prune_repository.__doc__)
    p.add_argument("repo", type=Path, help="model repository, e.g. models/en-fr/4")
    p.add_argument("--keep", action="append", required=True, metavar="PRECISION",
                   help="a precision whose graphs stay (repeatable), e.g. int8")
    args = p.parse_args(argv)
    deleted = prune_repository(args.repo, args.keep)
    print(f"{args.repo}: kept {', '.join(args.keep)}; deleted {', '.join(deleted) or 'nothing'}")
    return 0


@one_line_errors("verify")
def verify_main(argv: list[str]) -> int:
    from export.graphs import verify

    return verify.main(argv)


@one_line_errors("compare")
def compare_main(argv: list[str]) -> int:
    from export.evaluate import compare

    return compare.main(argv)
