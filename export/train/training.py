"""Training: teacher forcing, Adam, clipping, token-budget length buckets.

Writes ``<out>/last.pt`` at every validation (resumable) and ``<out>/best.pt``
when the validation BLEU improves. A checkpoint is self-contained: model
config, weights and both SentencePiece models.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import sacrebleu
import torch
import torch.nn.functional as F
from tqdm import tqdm

from export.data.pairs import Pair, read_split
from export.train import recipe
from export.train.batches import Example, collate, encode_pairs, make_batches, pack_batches, padded_length  # noqa: F401
from export.train.checkpoint import load_checkpoint, save_checkpoint
from export.train.model import RNNSearch
from export.train.search import greedy
from service.decoding.int8_form import cpu_flags
from service.models.config import ModelConfig
from service.text.tokenizer import EOS_ID, Tokenizer


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (stored in the checkpoint beside the model config)."""

    minutes: float = 60.0  # wall-clock budget; training stops after it
    max_epochs: int = 1000
    max_steps: int = 0  # if > 0, stop after this many updates (a budget that does not depend on CPU sharing)
    batch_tokens: int = 3000  # padded target tokens per batch
    max_len: int = 100  # pairs with longer source or target (pieces) are skipped
    lr: float = 1e-3
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    validate_minutes: float = 5.0  # time between validations
    validate_steps: int = 0  # if > 0, validate every this many steps instead (reproducible runs)
    bleu_slice: int = 400  # validation sentences decoded for BLEU
    seed: int = 1
    threads: int = 2
    init_uniform: float = 0.0  # if > 0, a new model's weights from uniform(-x, x) (OpenNMT-py's param_init)
    warmup_steps: int = 0  # linear learning-rate warm-up (recipe.lr_at)
    lr_schedule: str = "plateau"  # after the warm-up: halve on a stalled validation BLEU, or "rsqrt"
    ema_decay: float = 0.0  # if > 0, an exponential moving average of the weights, saved as ema.pt
    valid_long: int = 0  # the longest validation pairs (beyond bleu_slice) also decoded for BLEU
    keep_checkpoints: bool = False  # every validation's weights kept as checkpoints/step-<N>.pt (fp16)
    bf16: str = "off"  # bf16 autocast of the forward pass: off, auto (where the CPU has AMX/AVX-512 BF16), on


def loss_on(model: RNNSearch, batch: tuple[torch.Tensor, ...], smoothing: float) -> tuple[torch.Tensor, int]:
    logits, targets = model.token_logits(*batch)  # real target positions only
    loss = F.cross_entropy(logits, targets, label_smoothing=smoothing, reduction="sum")
    return loss, len(targets)


@torch.inference_mode()
def validate(model: RNNSearch, data: list[Example], pairs: list[Pair], tok: Tokenizer,
             cfg: TrainConfig) -> tuple[float, float, str]:
    """(per-token NLL on the whole split, greedy BLEU on a slice as users see it, and with
    ``valid_long`` the BLEU of its two parts, for the log)."""
    model.eval()
    total, count = 0.0, 0
    for idx in make_batches(data, cfg.batch_tokens, random.Random(0)):
        loss, n = loss_on(model, collate([data[i] for i in idx]), 0.0)
        total, count = total + float(loss), count + n
    hyps, refs = [], []
    sl = recipe.bleu_pairs(pairs, cfg.bleu_slice, cfg.valid_long)
    for start in range(0, len(sl), 64):
        chunk = sl[start:start + 64]
        enc = [tok.encode(p.src_raw) for p in chunk]
        src, lengths, _, _ = collate([(e.ids, [EOS_ID]) for e in enc])
        for e, p, h in zip(enc, chunk, greedy(model, src, lengths)):
            hyps.append(tok.decode(h.tokens, e.placeholders))
            refs.append(p.tgt_raw)
    model.train()
    parts, head = "", min(cfg.bleu_slice, len(pairs))
    if len(hyps) > head:
        parts = (f" (first {head}: {sacrebleu.corpus_bleu(hyps[:head], [refs[:head]]).score:.2f}, "
                 f"{len(hyps) - head} longest: {sacrebleu.corpus_bleu(hyps[head:], [refs[head:]]).score:.2f})")
    return total / max(count, 1), sacrebleu.corpus_bleu(hyps, [refs]).score, parts


def _update(run: "_Run", batch, step: int):
    """Update ``step`` (1-based) on a collated batch: (summed loss, target tokens)."""
    config, model, opt = run.config, run.model, run.opt
    lr = recipe.lr_at(step, config.lr, config.warmup_steps, config.lr_schedule)
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run.bf16):
        loss, n = loss_on(model, batch, config.label_smoothing)
    opt.zero_grad(set_to_none=True)
    (loss / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
    opt.step()
    if run.ema is not None:
        run.ema.update()
    return loss, n


def _start(tok: Tokenizer, model_config: dict | None, config: TrainConfig, resume: Path | None):
    """A new model, or the one ``resume`` names with its optimizer and training state:
    (model, optimizer, lr scheduler, state, weight average or None)."""
    state: dict = {"step": 0, "epoch": 0, "best_bleu": -1.0, "elapsed": 0.0}
    ckpt = load_checkpoint(resume) if resume is not None else None
    if ckpt is not None:
        clash = {k: v for k, v in (model_config or {}).items() if getattr(ckpt.config, k) != v}
        if clash:
            raise ValueError(f"{resume}: a run is resumed with its own settings; it has "
                             + ", ".join(f"{k} {getattr(ckpt.config, k)!r} (given {v!r})" for k, v in clash.items()))
        model = RNNSearch(ckpt.config)
        model.load_state_dict(ckpt.weights)
        state.update(ckpt.extra.get("train_state", {}))
    else:
        model = RNNSearch(ModelConfig(src_vocab_size=tok.source.get_piece_size(),
                                      tgt_vocab_size=tok.target.get_piece_size(), **(model_config or {})))
        if config.init_uniform > 0:  # else PyTorch's per-layer defaults
            for param in model.parameters():
                torch.nn.init.uniform_(param, -config.init_uniform, config.init_uniform)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)
    ema = recipe.WeightAverage(model, config.ema_decay) if config.ema_decay > 0 else None
    if ckpt is not None and "optimizer" in ckpt.extra:
        opt.load_state_dict(ckpt.extra["optimizer"])
        sched.load_state_dict(ckpt.extra["scheduler"])
    if ckpt is not None and "torch_rng_state" in ckpt.extra:
        torch.set_rng_state(ckpt.extra["torch_rng_state"])  # dropout continues as uninterrupted
    if ema is not None and ckpt is not None and "ema" in ckpt.extra:
        ema.load_state_dict(ckpt.extra["ema"])  # else the average starts from the resumed weights
    return model, opt, sched, state, ema


@dataclass
class _Run:
    """A training run's moving parts, and what it does at a validation."""

    model: RNNSearch
    opt: torch.optim.Optimizer
    sched: Any  # ReduceLROnPlateau on the validation BLEU
    state: dict  # step, epoch, best_bleu, best_loss, elapsed: saved in the checkpoint
    config: TrainConfig
    tok: Tokenizer
    sp_files: dict[str, bytes]  # both SentencePiece models, embedded in every checkpoint
    out_dir: Path
    valid_data: list[Example]
    valid_pairs: list[Pair]
    log: Callable[[str], None]
    start: float = 0.0  # time.monotonic() of the run's start, less the time of the run resumed
    last_valid: float = 0.0  # time.monotonic() of the last validation
    languages: dict | None = None  # the corpus manifest's {"source", "target"}: the export's manifest names them
    ema: recipe.WeightAverage | None = None
    bf16: bool = False  # the forward pass under bf16 autocast (recipe.bf16_autocast)

    def save(self, path: Path) -> None:
        save_checkpoint(path, self.model, self.sp_files, extra={
            **({"languages": self.languages} if self.languages else {}),
            "train_config": asdict(self.config), "train_state": dict(self.state),
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "torch_rng_state": torch.get_rng_state(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {})})

    def save_weights(self, path: Path, *, half: bool) -> None:
        """The weights with the training state but no optimizer (kept and averaged checkpoints)."""
        save_checkpoint(path, self.model, self.sp_files, half=half, extra={
            **({"languages": self.languages} if self.languages else {}),
            "train_config": asdict(self.config), "train_state": dict(self.state)})

    def validate_and_save(self) -> None:
        state = self.state
        state["elapsed"] = time.monotonic() - self.start
        v_loss, v_bleu, parts = validate(self.model, self.valid_data, self.valid_pairs, self.tok, self.config)
        if self.config.lr_schedule == "plateau" and state["step"] > self.config.warmup_steps:
            self.sched.step(v_bleu)
        # a tie in BLEU (a saturated slice) goes to the lower validation loss, not the earlier
        improved = v_bleu > state["best_bleu"] or (v_bleu == state["best_bleu"]
                                                   and v_loss < state.get("best_loss", math.inf))
        if improved:
            state["best_bleu"], state["best_loss"] = v_bleu, v_loss
            self.save(self.out_dir / "best.pt")
        self.save(self.out_dir / "last.pt")
        if self.config.keep_checkpoints:
            self.save_weights(self.out_dir / "checkpoints" / f"step-{state['step']}.pt", half=True)
        if self.ema is not None:
            with self.ema.applied(self.model):
                self.save_weights(self.out_dir / "ema.pt", half=False)
        self.last_valid = time.monotonic()
        self.log(f"step {state['step']} epoch {state['epoch'] + 1} {state['elapsed'] / 60:.1f} min: "
                 f"valid loss {v_loss:.3f} ppl {math.exp(v_loss):.1f} greedy BLEU {v_bleu:.2f}{parts}"
                 f"{' (best)' if improved else ''} lr {self.opt.param_groups[0]['lr']:.2e}")


def _epoch(run: _Run, data: list[Example], batches: list[list[int]], skip: int) -> bool:
    """Train on ``batches[skip:]``, validating when due; True when the time or step budget ran out."""
    config, state = run.config, run.state
    bar = tqdm(batches[skip:], desc=f"epoch {state['epoch'] + 1}", mininterval=10,
               leave=False, initial=skip, total=len(batches))
    tokens_seen, t0 = 0, time.monotonic()
    for idx in bar:
        loss, n = _update(run, collate([data[i] for i in idx]), state["step"] + 1)
        state["step"] += 1
        tokens_seen += n
        bar.set_postfix(loss=f"{loss.item() / n:.3f}",
                        tok_s=f"{tokens_seen / (time.monotonic() - t0):.0f}", refresh=False)
        if time.monotonic() - run.start > config.minutes * 60 or 0 < config.max_steps <= state["step"]:
            return True
        due = (state["step"] % config.validate_steps == 0 if config.validate_steps
               else time.monotonic() - run.last_valid > config.validate_minutes * 60)
        if due:
            run.validate_and_save()
    return False


def _batch_order(data: list[Example], config: TrainConfig, state: dict) -> tuple[random.Random, int]:
    """The batch order of an uninterrupted run: one generator from the seed, epoch after epoch.

    A resumed run replays the orders of the epochs done and skips the batches of its current
    epoch already trained (its steps beyond those epochs' batches), so with the saved dropout
    generator, killed and resumed at a validation it is the same run (tests/test_training.py).
    Returns the generator and the batches of the current epoch to skip."""
    rng, skip = random.Random(config.seed), state["step"]
    for _ in range(state["epoch"]):
        skip -= len(make_batches(data, config.batch_tokens, rng))
    return rng, max(0, skip)  # (a resume with another --batch-tokens: its epoch starts over)


def corpus_languages(corpus_dir: Path) -> dict | None:
    """The corpus manifest's ``languages`` ({"source": "en", "target": "de"}), if it has one."""
    path = corpus_dir / "manifest.json"
    try:
        languages = json.loads(path.read_text(encoding="utf-8")).get("languages")
    except (OSError, ValueError):
        return None
    return dict(languages) if isinstance(languages, dict) else None


def train(corpus_dir: Path, tokenizer_dir: Path, out_dir: Path, *, model_config: dict | None = None,
          config: TrainConfig = TrainConfig(), resume: Path | None = None, log=print) -> Path:
    """Train until the time budget, the step budget or the epoch limit; returns the best checkpoint's path."""
    recipe.lr_at(1, config.lr, config.warmup_steps, config.lr_schedule)  # a bad setting fails first
    bf16, why = recipe.bf16_autocast(config.bf16, cpu_flags())
    torch.set_num_threads(config.threads)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tok = Tokenizer(tokenizer_dir / "source.model", tokenizer_dir / "target.model")
    sp_files = {name: (tokenizer_dir / name).read_bytes() for name in ("source.model", "target.model")}
    train_data = encode_pairs(read_split(corpus_dir / "train.jsonl"), tok, config.max_len)
    valid_pairs = read_split(corpus_dir / "valid.jsonl")
    valid_data = encode_pairs(valid_pairs, tok, config.max_len)
    if not train_data:
        raise ValueError(f"{corpus_dir / 'train.jsonl'}: no usable training pairs")
    model, opt, sched, state, ema = _start(tok, model_config, config, resume)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"model: {model.num_parameters() / 1e6:.2f}M parameters {asdict(model.config)}; "
        f"data: {len(train_data)} train, {len(valid_data)} valid examples; bf16 autocast {why}")
    run = _Run(model=model, opt=opt, sched=sched, state=state, config=config, tok=tok, sp_files=sp_files,
               out_dir=out_dir, valid_data=valid_data, valid_pairs=valid_pairs, log=log,
               languages=corpus_languages(corpus_dir), ema=ema, bf16=bf16)
    rng, skip = _batch_order(train_data, config, state)
    run.start, run.last_valid = time.monotonic() - state["elapsed"], time.monotonic()
    model.train()
    while state["epoch"] < config.max_epochs:
        if _epoch(run, train_data, make_batches(train_data, config.batch_tokens, rng), skip):
            break
        skip = 0
        state["epoch"] += 1
    run.validate_and_save()  # the final weights always get a validation (and best.pt a candidate)
    return out_dir / "best.pt"
