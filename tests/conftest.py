"""Shared fixtures: tiny corpora, tokenizers and models made by the tests themselves.

- ``tiny_checkpoint``: a small untrained RNNsearch with real SentencePiece models
  (software-message-like sentences with placeholders). Seconds to make.
- ``reversal_checkpoint``: a small RNNsearch trained here to reverse digit
  strings (lengths 3 to 12): a real, accurate model whose attention must lie on
  the anti-diagonal. About a minute on 2 cores; made once per session.
- ``tiny_repository``, ``reversal_repository``: those exported to ONNX model repositories.
- ``reversal_engine``: the engine alone on ``reversal_repository`` (the reference answers).
- ``server``, ``tiny_server``, ``slow_server``: those served in-process on port 0 (one per
  test module; ``harness.ServerThread``). ``slow_server``'s decoder steps take 50 ms.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Tiny models run fastest on one thread, and two would oversubscribe a busy 2-core machine."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


TINY_SENTENCES = [
    ("Delete %s files?", "Supprimer %s fichiers ?"),
    ("Open the file", "Ouvrir le fichier"),
    ("Save the file", "Enregistrer le fichier"),
    ("Cannot open %(name)s", "Impossible d'ouvrir %(name)s"),
    ("{0} of {1} items", "{0} sur {1} éléments"),
    ("Set $HOME first", "Définissez d'abord $HOME"),
    ("Click <b>here</b>", "Cliquez <b>ici</b>"),
    ("The red car", "La voiture rouge"),
    ("The green house", "La maison verte"),
    ("Unknown option", "Option inconnue"),
    ("Invalid password", "Mot de passe invalide"),
    ("File not found", "Fichier introuvable"),
    ("Print the version and exit", "Afficher la version et quitter"),
    ("size %-7ld bytes", "taille %-7ld octets"),
]

# validating by steps, not minutes, makes the run the same on any machine at any load; often
# (about 3 times an epoch), so best.pt and the plateau schedule pick among many checkpoints: with
# fewer passes or validations, exact reversals of one seed or another fell to 95-97 %
REVERSAL_TRAINING = dict(minutes=15, max_epochs=12, batch_tokens=1200, lr=3e-3, label_smoothing=0.0,
                         validate_steps=20, bleu_slice=100, threads=1)
REVERSAL_MODEL = {"emb_size": 32, "enc_hidden_size": 64, "dec_hidden_size": 64,
                  "attn_size": 64, "out_size": 32, "dropout": 0.0}


def write_pairs(path: Path, pairs: list[tuple[str, str]]) -> None:
    """Write raw (source, target) pairs as a corpus split file."""
    from service.text import placeholders

    with path.open("w", encoding="utf-8") as f:
        for src, tgt in pairs:
            prot = placeholders.protect(src)
            tgt_prot = placeholders.protect_target(tgt, prot.placeholders)
            assert tgt_prot is not None, (src, tgt)
            f.write(json.dumps({"src": prot.text, "tgt": tgt_prot, "placeholders": list(prot.placeholders),
                                "src_raw": src, "tgt_raw": tgt}, ensure_ascii=False) + "\n")


def make_corpus(root: Path, train: list[tuple[str, str]], valid: list[tuple[str, str]],
                test: list[tuple[str, str]] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_pairs(root / "train.jsonl", train)
    write_pairs(root / "valid.jsonl", valid)
    write_pairs(root / "test.jsonl", test if test is not None else valid)
    return root


def digit_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 12))]
        out.append((" ".join(digits), " ".join(reversed(digits))))
    return out


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny_corpus")
    return make_corpus(root, TINY_SENTENCES * 3, TINY_SENTENCES[:6])


@pytest.fixture(scope="session")
def tiny_tokenizers(tiny_corpus: Path) -> Path:
    from export.data import tokenizers

    out = tiny_corpus.parent / "tiny_tokenizers"
    tokenizers.train(tiny_corpus, out, src_vocab_size=60, tgt_vocab_size=60)
    return out


def _save_untrained(tok_dir: Path, out: Path, seed: int = 0, **sizes: int) -> Path:
    import torch

    from export.train.checkpoint import save_checkpoint
    from export.train.model import RNNSearch
    from service.models.config import ModelConfig
    from service.text.tokenizer import Tokenizer

    tok = Tokenizer(tok_dir / "source.model", tok_dir / "target.model")
    torch.manual_seed(seed)
    config = ModelConfig(src_vocab_size=tok.source.get_piece_size(),
                         tgt_vocab_size=tok.target.get_piece_size(), **sizes)
    model = RNNSearch(config).eval()
    save_checkpoint(out, model, {"source.model": (tok_dir / "source.model").read_bytes(),
                                 "target.model": (tok_dir / "target.model").read_bytes()})
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_tokenizers: Path) -> Path:
    """An untrained tiny model (random weights) with real tokenizers."""
    return _save_untrained(tiny_tokenizers, tiny_tokenizers.parent / "tiny.pt", emb_size=16,
                           enc_hidden_size=16, dec_hidden_size=32, attn_size=32, out_size=16,
                           dropout=0.0)


@pytest.fixture(scope="session")
def reversal_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reversal_corpus")
    return make_corpus(root, digit_pairs(6000, seed=1), digit_pairs(200, seed=2), digit_pairs(300, seed=3))


@pytest.fixture(scope="session")
def reversal_checkpoint(reversal_corpus: Path) -> Path:
    """A small RNNsearch trained to reverse digit strings (the sanity task)."""
    from export.data import tokenizers
    from export.train import training as train

    tok_dir = reversal_corpus.parent / "reversal_tokenizers"
    tokenizers.train(reversal_corpus, tok_dir, src_vocab_size=40, tgt_vocab_size=40)
    config = train.TrainConfig(**REVERSAL_TRAINING)
    return train.train(reversal_corpus, tok_dir, reversal_corpus.parent / "reversal_run",
                       model_config=REVERSAL_MODEL, config=config, log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny_repository(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_checkpoint`` exported and verified: a model repository ``.../en-fr/1`` with
    fp32 and int8 graphs (greedy parity measured on random sources). Do not modify it:
    copy it first (``shutil.copytree``)."""
    from export.graphs.repository import export_repository

    out = tmp_path_factory.mktemp("tiny_repository") / "en-fr" / "1"
    return export_repository(tiny_checkpoint, out, name="en-fr", version="1", quantize=True)


@pytest.fixture(scope="session")
def reversal_repository(reversal_checkpoint: Path, reversal_corpus: Path,
                        tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``reversal_checkpoint`` exported and verified (fp32 and int8, greedy parity on the
    reversal test split): a model repository ``.../reversal/1``. Copy before modifying."""
    from export.graphs.repository import export_repository

    out = tmp_path_factory.mktemp("reversal_repository") / "reversal" / "1"
    return export_repository(reversal_checkpoint, out, name="reversal", version="1", quantize=True,
                             test_split=reversal_corpus / "test.jsonl")


@pytest.fixture(scope="session")
def shortlisted(reversal_repository: Path, reversal_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``reversal_repository`` with a shortlist (3 words a piece, the 2 most frequent): its engines
    score each row over its own words."""
    import shutil

    from export.graphs import shortlist as build

    repo = tmp_path_factory.mktemp("shortlisted") / "reversal" / "1"
    shutil.copytree(reversal_repository, repo)
    build.write(repo, reversal_corpus, build.ShortlistConfig(per_source=3, frequent=2, min_count=1))
    return repo


# ---- servers (tests/harness.py starts them) ----------------------------------------------------

@pytest.fixture(scope="session")
def reversal_engine(reversal_repository: Path):
    """The engine alone: the reference for every served answer."""
    from service.decoding.engine import Engine

    return Engine(reversal_repository)


@pytest.fixture(scope="module")
def server(reversal_repository: Path):
    """The reversal model served in-process (up to 64 texts a request)."""
    from harness import ServerThread, config_for

    with ServerThread(config_for(reversal_repository, "--max-texts", "64")) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_server(tiny_repository: Path):
    """The untrained tiny model served in-process, with the tests' limits (8 texts, beam 4)."""
    from harness import ServerThread, config_for

    with ServerThread(config_for(tiny_repository)) as s:
        yield s


class SlowBatch:
    """The real batch, with a pause before each decoder step (to catch a call mid-decode);
    counts steps and removed rows. Everything else is the real batch's."""

    def __init__(self, batch, owner: SlowEngine) -> None:
        self.batch, self.owner = batch, owner

    def step(self):
        time.sleep(self.owner.step_seconds)
        self.owner.steps += 1
        return self.batch.step()

    def remove(self, keys) -> None:
        self.owner.removed += len(keys)
        self.batch.remove(keys)

    def __getattr__(self, name: str):
        return getattr(self.batch, name)


class SlowEngine:
    """The real engine, whose batches are ``SlowBatch``es. Everything else is the real engine's."""

    def __init__(self, engine, step_seconds: float) -> None:
        self.engine, self.step_seconds = engine, step_seconds
        self.steps = self.removed = 0

    def new_batch(self) -> SlowBatch:
        return SlowBatch(self.engine.new_batch(), self)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


SLOW_STEP_SECONDS = 0.05


@pytest.fixture(scope="module")
def slow_server(reversal_repository: Path, reversal_engine):
    """Steps take 50 ms; admits one LONG_DIGITS text at a time (queued work). ``engine`` is
    its SlowEngine; ``startup_health``: what health answered while it started (polled)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from harness import LONG_DIGITS, SERVING, ServerThread, config_for, wait_until
    from service.decoding.engine import Engine
    from service.options import DecodingOptions

    work = reversal_engine.prepare_text(LONG_DIGITS, DecodingOptions(), 0).work
    engine = SlowEngine(Engine(reversal_repository), SLOW_STEP_SECONDS)
    s = ServerThread(config_for(reversal_repository, "--max-queued-work", str(work * 3 // 2)), [engine],
                     wait=False)
    s.listening.wait(60)
    s.engine, s.startup_health = engine, []
    health = health_pb2_grpc.HealthStub(s.channel)

    def serving() -> bool:
        s.startup_health.append(health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                                             timeout=60).status)
        return s.startup_health[-1] == SERVING
    wait_until(serving, timeout=300, what="health SERVING after warm-up", interval=0)
    s.wait_started()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def languages_repository(reversal_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One repository of four directions, each the reversal model under another name and manifest
    ``languages``: ``en-fr/1`` (en->fr), ``en-de/1``, ``en-es/1`` and ``fr-en/1``. Copy before modifying."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("languages_repository")
    for name in ("en-fr", "en-de", "en-es", "fr-en"):
        version = shutil.copytree(reversal_repository, root / name / "1")
        manifest = json.loads((version / "manifest.json").read_text())
        source, target = name.split("-")
        manifest.update(name=name, languages={"source": source, "target": target})
        (version / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root
