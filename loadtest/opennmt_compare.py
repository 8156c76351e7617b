"""OpenNMT-py 3.5.1 RNN beside our trainer, on the same corpus, pieces and machine (issue 14).

Issue 14's acceptance: our trainer processes at least as many sentences per second as
OpenNMT-py at the same token budget, and the shipped default beats an OpenNMT-py RNN of
the same size trained for the same wall time (test split and long set, beam 5,
placeholders protected for both). This script is a measuring tool, not a project
dependency: OpenNMT-py lives in its own virtualenv, ``build/onmt-venv`` (build/ is
git-ignored), and everything else runs with the project's ``.venv``. Run it from the
repository root; on a shared machine put ``nice -n 19`` in front of every command.

Commands::

    P=".venv/bin/python loadtest/opennmt_compare.py"
    $P setup                                   # build/onmt-venv: torch 2.13.0 CPU + OpenNMT-py 3.5.1
    $P prepare build/corpus-v2 --tokenizers models/en-fr/4
    $P train build/corpus-v2 --minutes 29.81   # -> build/opennmt-compare/corpus-v2/runs/onmt-29.81m/
    $P evaluate build/corpus-v2 --onmt build/opennmt-compare/corpus-v2/runs/onmt-29.81m \\
        --ours build/en-fr/checkpoint-3.pt     # -> loadtest/results/opennmt_quality.{json,md}
    $P speed build/corpus-v2 --tokenizers models/en-fr/4 --minutes 3 --rounds 3
                                               # -> loadtest/results/opennmt_speed.md
    $P compare build/corpus-v2 --tokenizers build/tokenizers-v2 --minutes 30 --rounds 2
                                               # -> loadtest/results/opennmt_compare.{json,md}
    $P levers build/corpus-v2 --tokenizers build/tokenizers-v2 --minutes 10 \\
        --lever "rsqrt=--lr 0.002 --warmup-steps 100 --lr-schedule rsqrt"
                                               # -> loadtest/results/opennmt_levers.{json,md}

``setup`` is the same as this shell snippet (pip must never change torch: any other torch
version than 2.13.0 pulls a multi-GB CUDA build; OpenNMT-py 3.5.1 asks for torch<2.3, so it
is installed with --no-deps and its light dependencies under a constraints file)::

    python3.11 -m venv build/onmt-venv
    echo torch==2.13.0 > build/onmt-constraints.txt
    build/onmt-venv/bin/pip install -c build/onmt-constraints.txt torch==2.13.0
    build/onmt-venv/bin/pip install --no-deps opennmt-py==3.5.1
    build/onmt-venv/bin/pip install -c build/onmt-constraints.txt numpy configargparse pyyaml \\
        sacrebleu six waitress flask rapidfuzz 'pyonmttok>=1.37,<2' sentencepiece pyahocorasick \\
        'ctranslate2>=4,<5' tensorboard spacy fasttext-wheel

OpenNMT-py 3.5.1 loads its checkpoints with ``torch.load`` without ``weights_only``, which
torch 2.13 refuses: every OpenNMT process gets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.

``prepare CORPUS --tokenizers DIR``
    Writes ``<work>/data/``: train/valid ``.src``/``.tgt`` files of SentencePiece pieces made
    with OUR models (source ids = ``tok.source.encode(src)``, target = ``tok.encode_target
    (tgt)``, as export/train/training.py's ``encode_pairs``, the same max_len filter of 100 pieces
    counting EOS), and ``src.vocab``/``tgt.vocab``: every piece of our models but the four
    specials, which OpenNMT adds itself (<unk> <blank> <s> </s>), so both vocabularies have
    exactly our sizes. ``<work>`` is ``build/opennmt-compare/<corpus dir name>``.

``train CORPUS --minutes M``
    OpenNMT-py trained for M minutes of wall clock. OpenNMT has no time limit, so the
    trainer runs in-process under a small wrapper (``_onmt-worker``, in the OpenNMT venv)
    that stops its batch iterator once the budget is spent; OpenNMT then saves its final
    checkpoint as at any end of training. The budget starts at the first batch (OpenNMT's
    reading of the first bucket is start-up, as our trainer's encoding of the corpus is), and
    it includes OpenNMT's validations, as ours includes its own. The wrapper counts the
    sentences and target tokens (EOS included, as ours) of every batch trained and writes
    ``stats.json`` beside ``train.log``, ``config.yaml`` and the checkpoints. For the
    acceptance, M is the training time of our checkpoint (``evaluate --ours`` prints it: its
    train_state's elapsed minutes).

    The model is ours in size (ModelConfig defaults): brnn encoder, GRU,
    1 layer, 256 per direction (enc_hid_size 512), decoder 512, embeddings 256, global
    attention mlp (Bahdanau's additive), input feeding, dropout 0.2. Optimisation as ours
    (export/train/training.py TrainConfig): Adam (0.9, 0.999), lr 1e-3, token batches of 3000,
    loss normalised by target tokens, label smoothing 0.1, gradient norm clipped at 1.0.
    Learning rate: constant (decay_method none, learning_rate_decay 1.0, so OpenNMT's
    default halving from step 50000 never happens); ours halves it on a BLEU plateau (every
    5 minutes, patience 2), which only matters for runs of 20 minutes and more. Everything
    else is OpenNMT's default (uniform init 0.1, no source EOS, examples sorted by length in
    a bucket, batches shuffled), but the bucket is set to the corpus size, one epoch (the
    default, 262144 examples, holds 4-5 copies of a 57k-pair corpus and drops the copies that
    fall into one batch). CPU only, ``--threads`` (2) torch threads with
    OMP/MKL_NUM_THREADS set alike, ``num_workers 0`` (batches built in the training process,
    as ours: on 2 cores a loader process would take one from the model).

``speed CORPUS --tokenizers DIR --minutes M --rounds R``
    Both trainers for the same budget, alternating (ours first in odd rounds, OpenNMT first
    in even ones), from scratch, with no validation inside the budget. Ours runs as
    ``.venv/bin/nmt train`` (the project code untouched); its sentences and tokens are
    counted afterwards by replaying its batching (``make_batches`` with the run's seed and
    token budget, as recorded in last.pt) for the steps last.pt records, over the elapsed
    time it records (from after the corpus encoding to the last step). OpenNMT's come from
    the wrapper above. Writes the rounds and their medians to
    ``loadtest/results/opennmt_speed.md`` (and ``.json``).

``evaluate CORPUS --onmt RUN [--ours CHECKPOINT]``
    Translates the test split and ``long.jsonl`` (when the corpus has one) with
    ``onmt_translate`` (beam 5, length penalty avg: score / length as our beam search, CPU),
    sources protected and split by our tokenizer exactly as ``nmt evaluate`` does
    (``Tokenizer.encode(src_raw)``), the output pieces decoded by our target model and the
    placeholders restored by ``Tokenizer.decode``; scored by export/evaluate/evaluate.py's
    ``scores`` (sacreBLEU, chrF, ... against tgt_raw). ``--ours`` decodes our checkpoint with
    export/evaluate/evaluate.py's ``decode`` (beam 5) on the same sentences. Writes
    ``loadtest/results/opennmt_quality.json`` and ``.md``.

``compare CORPUS --tokenizers DIR --minutes M [--rounds R] [--ours-args "..."] [--max-sentences N]``
    Issue 30's one command: ``prepare`` when ``<work>/data`` is missing, then in every round
    both trainers back to back for M minutes of wall clock each, from scratch (ours first in odd
    rounds, OpenNMT first in even ones). Ours: ``nmt train CORPUS --tokenizers DIR --attention
    bahdanau --max-steps 0 --minutes M --validate-steps 200 --threads T --init-uniform 0.1``
    followed by the words of ``--ours-args`` (a recipe lever, compared by the same command; write
    ``--ours-args="--dropout 0.3"``); OpenNMT as ``train`` runs it. Updates, sentences/s and target
    tokens/s as ``speed`` counts them, the minutes used and the load average before and after
    each run. Then each round's two models (ours: the run's best.pt; OpenNMT: its last
    checkpoint) on the test and long splits with beam 5, by ``evaluate``'s code. Writes every
    round, the medians over rounds (and of the differences ours - OpenNMT), the CPU model, its
    flags, cores and load, and the command line to ``loadtest/results/opennmt_compare.json``
    and ``.md``. A failed run stops the comparison with an error naming it. Runs under
    ``<work>/compare/``.

``compare ... --minutes M --continue-ours RUN --continue-peer RUN``
    The figure at a longer budget without training both from scratch again: each finished run is
    copied to ``<work>/continued-<M>m/compare/`` and trained on until M minutes of training in all,
    then both are evaluated as above (one round). Ours by ``nmt train --resume`` (refused unless
    ``RUN`` was trained with the same ``--ours-args``); OpenNMT-py by ``train_from`` with its
    optimizer (``reset_optim none``). OpenNMT does not resume its data where it stopped, so the
    worker reads and skips the batches the run trained (``--skip-batches``; its batches are
    deterministic) and the continuation is refused unless they hold the same number of sentences
    and target tokens the run counted. Counts and minutes cover both parts. Writes
    ``loadtest/results/opennmt_compare_<M>min.{json,md}``.

Figures from short budgets (under 10 minutes) or a ``--max-sentences`` subset are labelled
SMOKE in the result files: they prove the pipeline, they are not acceptance figures.

The stages live in ``loadtest/opennmt/`` (``prepare``, ``train``, ``speed``, ``evaluate``,
``compare``, ``report``); this file is their command line. Figures and history: ``docs/opennmt.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opennmt.common import ROOT  # loadtest/ is on sys.path: this script's directory
from opennmt.levers import add_levers


def corpus_args(s: argparse.ArgumentParser, tokenizers: bool = False) -> None:
    s.add_argument("corpus", type=Path, help="corpus directory (train/valid/test.jsonl, maybe long.jsonl)")
    s.add_argument("--work", type=Path, help="work directory (default build/opennmt-compare/<corpus name>)")
    if tokenizers:
        s.add_argument("--tokenizers", type=Path, required=True, help="directory with source.model, target.model")
    s.add_argument("--threads", type=int, default=2)


def add_setup_prepare(sub) -> None:
    from opennmt.prepare import cmd_prepare, cmd_setup

    s = sub.add_parser("setup", help="build/onmt-venv with torch 2.13.0 CPU and OpenNMT-py 3.5.1")
    s.add_argument("--python", default="python3.11")
    s.set_defaults(func=cmd_setup)
    s = sub.add_parser("prepare", help="piece files and vocabularies from our SentencePiece models")
    corpus_args(s, tokenizers=True)
    s.set_defaults(func=cmd_prepare)


def add_train(sub) -> None:
    from opennmt.train import cmd_train

    s = sub.add_parser("train", help="OpenNMT-py RNN of our size for a wall-clock budget")
    corpus_args(s)
    s.add_argument("--minutes", type=float, required=True)
    s.add_argument("--run", type=Path, help="run directory (default <work>/runs/onmt-<minutes>m)")
    s.add_argument("--valid-steps", type=int, default=2000)
    s.add_argument("--save-steps", type=int, default=1000)
    s.add_argument("--report-every", type=int, default=100)
    s.set_defaults(func=cmd_train)


def add_worker(sub) -> None:
    from opennmt.train import cmd_onmt_worker

    s = sub.add_parser("_onmt-worker", help="internal: onmt_train under the clock (run by train, in build/onmt-venv)")
    s.add_argument("--config", required=True)
    s.add_argument("--minutes", type=float, required=True)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--stats", required=True)
    s.add_argument("--skip-batches", type=int, default=0, help="read and skip the first N batches (a continued run)")
    s.set_defaults(func=cmd_onmt_worker)


def add_speed(sub) -> None:
    from opennmt.speed import cmd_speed

    s = sub.add_parser("speed", help="both trainers, same budget, alternating; median sents/s")
    corpus_args(s, tokenizers=True)
    s.add_argument("--minutes", type=float, default=3.0)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--keep", action="store_true", help="keep the runs' checkpoints")
    s.set_defaults(func=cmd_speed)


def add_evaluate(sub) -> None:
    from opennmt.evaluate import cmd_evaluate

    s = sub.add_parser("evaluate", help="test split (and long set) with beam 5, both systems")
    corpus_args(s)
    s.add_argument("--onmt", type=Path, required=True, help="OpenNMT run directory (its last checkpoint) or .pt")
    s.add_argument("--ours", type=Path, help="our checkpoint (.pt) for the side-by-side table")
    s.add_argument("--splits", nargs="+", default=["test", "long"])
    s.add_argument("--beam", type=int, default=5)
    s.add_argument("--batch-size", type=int, default=32, help="onmt_translate sentences per batch")
    s.add_argument("--max-sentences", type=int, help="first N sentences of each split (smoke)")
    s.set_defaults(func=cmd_evaluate)


def add_compare(sub) -> None:
    from opennmt.compare import cmd_compare

    s = sub.add_parser("compare", help="both trainers, same wall time, alternating; both evaluated alike")
    corpus_args(s, tokenizers=True)
    s.add_argument("--minutes", type=float, required=True, help="wall clock of every training run")
    s.add_argument("--rounds", type=int, default=1, help="rounds; the order alternates (odd rounds: ours first)")
    s.add_argument("--ours-args", default="", help='extra `nmt train` arguments, e.g. --ours-args="--dropout 0.3"')
    s.add_argument("--max-sentences", type=int, help="first N sentences of each split (smoke)")
    s.add_argument("--continue-ours", type=Path, metavar="RUN",
                   help="train this finished run of ours on until --minutes in all (with --continue-peer)")
    s.add_argument("--continue-peer", type=Path, metavar="RUN", help="the same for this OpenNMT-py run")
    s.set_defaults(func=cmd_compare)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (add_setup_prepare, add_train, add_speed, add_evaluate, add_compare, add_levers, add_worker):
        add(sub)
    args = p.parse_args(argv)
    args.argv = [".venv/bin/python", "loadtest/opennmt_compare.py", *(sys.argv[1:] if argv is None else argv)]
    if args.command != "_onmt-worker" and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
