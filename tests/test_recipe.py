"""The recipe's levers (issue 30): warm-up and decay, the weight average, long validation pairs,
kept and averaged checkpoints; each checked on its own and inside a tiny training run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from export.data.pairs import read_split
from export.train import recipe
from export.train import training as train
from export.train.checkpoint import load_checkpoint, release

SMALL = {"emb_size": 16, "enc_hidden_size": 16, "dec_hidden_size": 24, "attn_size": 16,
         "out_size": 16, "dropout": 0.0}


def test_warmup_is_linear_then_rsqrt_decays_and_plateau_leaves_the_rate_alone() -> None:
    assert [recipe.lr_at(s, 2e-3, 4, "rsqrt") for s in (1, 2, 4)] == [5e-4, 1e-3, 2e-3]
    assert recipe.lr_at(16, 2e-3, 4, "rsqrt") == pytest.approx(1e-3)  # sqrt(4 / 16) = 1/2
    assert recipe.lr_at(400, 2e-3, 4, "rsqrt") == pytest.approx(2e-4)
    assert recipe.lr_at(3, 1e-3, 4, "plateau") == pytest.approx(7.5e-4)
    assert recipe.lr_at(5, 1e-3, 4, "plateau") is None  # the scheduler's rate stands
    assert recipe.lr_at(1, 1e-3, 0, "plateau") is None


@pytest.mark.parametrize("schedule, warmup, message", [("cosine", 10, "lr_schedule: 'cosine'"),
                                                      ("rsqrt", 0, "warmup_steps")])
def test_bad_schedules_are_named_before_training(schedule: str, warmup: int, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        train.train(tmp_path / "no-corpus", tmp_path / "no-tok", tmp_path / "run",
                    config=train.TrainConfig(warmup_steps=warmup, lr_schedule=schedule))


def test_weight_average_follows_the_weights_and_gives_them_back() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ema = recipe.WeightAverage(model, decay=0.75)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    for k, v in model.state_dict().items():
        assert torch.allclose(ema.shadow[k], start[k] + 0.25)  # 0.75 * old + 0.25 * new
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied(model) as m:
        assert torch.allclose(m.weight, start["weight"] + 0.25)
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="ema_decay: 1.0"):
        recipe.WeightAverage(model, 1.0)


def test_bleu_pairs_add_the_longest_of_the_rest_in_their_order(tiny_corpus: Path) -> None:
    pairs = read_split(tiny_corpus / "train.jsonl")
    chosen = recipe.bleu_pairs(pairs, 4, 3)
    assert chosen[:4] == pairs[:4] and len(chosen) == 7
    rest_lengths = sorted((len(p.src_raw.split()) for p in pairs[4:]), reverse=True)
    assert sorted((len(p.src_raw.split()) for p in chosen[4:]), reverse=True) == rest_lengths[:3]
    assert [pairs.index(p, 4) for p in chosen[4:]] == sorted(pairs.index(p, 4) for p in chosen[4:])
    assert recipe.bleu_pairs(pairs, 4, 0) == pairs[:4]


def test_a_run_with_every_lever_keeps_checkpoints_averages_and_resumes(tiny_corpus: Path, tiny_tokenizers: Path,
                                                                      tmp_path: Path) -> None:
    """Warm-up with rsqrt, the weight average, long validation pairs and kept checkpoints in one
    run; killed at a validation and resumed it is the same run, the average included."""
    config = dict(minutes=5, max_epochs=100, batch_tokens=300, validate_steps=3, lr=5e-3, warmup_steps=4,
                  lr_schedule="rsqrt", ema_decay=0.9, bleu_slice=3, valid_long=2, keep_checkpoints=True)

    def run(name: str, steps: int, resume: bool = False) -> list[str]:
        logs: list[str] = []
        out = tmp_path / name
        train.train(tiny_corpus, tiny_tokenizers, out, model_config=None if resume else SMALL,
                    config=train.TrainConfig(**config, max_steps=steps),
                    resume=out / "last.pt" if resume else None, log=logs.append)
        return logs

    logs = run("whole", 9)
    whole = tmp_path / "whole"
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step-3.pt", "step-6.pt", "step-9.pt"]
    valid_lines = [line for line in logs if line.startswith("step ")]
    assert all("(first 3: " in line and ", 2 longest: " in line for line in valid_lines)
    rates = [5e-3 * 3 / 4, 5e-3 * math.sqrt(4 / 6), 5e-3 * math.sqrt(4 / 9)]  # warm-up, then rsqrt
    assert [line.rsplit("lr ", 1)[1] for line in valid_lines] == [f"{r:.2e}" for r in rates]
    last, ema = load_checkpoint(whole / "last.pt"), load_checkpoint(whole / "ema.pt")
    assert load_checkpoint(whole / "checkpoints" / "step-9.pt").weights["decoder.embed.weight"].dtype == torch.float16
    shadow = last.extra["ema"]["shadow"]
    assert all(torch.equal(ema.weights[k], shadow[k]) for k in shadow)
    assert any(not torch.equal(ema.weights[k], last.weights[k]) for k in shadow)  # an average, not a copy
    run("cut", 6)
    run("cut", 9, resume=True)
    cut = load_checkpoint(tmp_path / "cut" / "last.pt")
    assert all(torch.equal(cut.weights[k], last.weights[k]) for k in last.weights)
    assert all(torch.equal(cut.extra["ema"]["shadow"][k], shadow[k]) for k in shadow)


def test_release_averages_checkpoints_of_one_run(tiny_corpus: Path, tiny_tokenizers: Path, tmp_path: Path) -> None:
    train.train(tiny_corpus, tiny_tokenizers, tmp_path / "run", model_config=SMALL, log=lambda *_: None,
                config=train.TrainConfig(minutes=5, max_steps=4, batch_tokens=300, validate_steps=2,
                                         keep_checkpoints=True))
    kept = [tmp_path / "run" / "checkpoints" / f"step-{n}.pt" for n in (2, 4)]
    release(kept[0], tmp_path / "avg.pt", average=kept[1:])
    averaged = load_checkpoint(tmp_path / "avg.pt")
    a, b = (load_checkpoint(p).weights for p in kept)
    for k, v in averaged.weights.items():
        assert torch.allclose(v.float(), ((a[k].float() + b[k].float()) / 2).half().float())
    assert averaged.extra["averaged"] == [str(p) for p in kept]
    assert "optimizer" not in averaged.extra


@pytest.mark.parametrize("setting, flags, on, why", [
    ("auto", {"avx2", "amx_bf16", "amx_int8"}, True, "the CPU has amx_bf16"),
    ("auto", {"avx2", "avx512_bf16"}, True, "avx512_bf16"),
    ("auto", {"avx2", "avx512_vnni"}, False, "no AMX or AVX-512 BF16"),
    ("on", {"avx2"}, True, "emulated, slower"),
    ("off", {"amx_bf16"}, False, "--bf16 off"),
])
def test_bf16_autocast_follows_the_cpu_flags(setting: str, flags: set, on: bool, why: str) -> None:
    assert recipe.bf16_autocast(setting, flags)[0] is on and why in recipe.bf16_autocast(setting, flags)[1]


def test_a_bf16_run_trains_and_says_so(tiny_corpus: Path, tiny_tokenizers: Path, tmp_path: Path) -> None:
    """Under autocast the forward pass runs in bf16 (the weights and the optimizer stay fp32): the
    loss still falls, and the first log line says why autocast is on."""
    logs: list[str] = []
    train.train(tiny_corpus, tiny_tokenizers, tmp_path / "run", model_config=SMALL, log=logs.append,
                config=train.TrainConfig(minutes=5, max_steps=30, batch_tokens=300, validate_steps=15, lr=5e-3,
                                         bf16="on"))
    assert "bf16 autocast on (asked" in logs[0]
    losses = [float(line.split("valid loss ")[1].split()[0]) for line in logs if "valid loss" in line]
    assert losses[-1] < losses[0]
    weights = load_checkpoint(tmp_path / "run" / "last.pt").weights
    assert all(v.dtype == torch.float32 for v in weights.values())
    with pytest.raises(ValueError, match="bf16: 'fast'"):
        train.train(tiny_corpus, tiny_tokenizers, tmp_path / "x", config=train.TrainConfig(bf16="fast"))


def test_label_smoothing_is_a_flag_checked_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    from export.cli import train_parser, train_settings

    words = ["corpus", "--tokenizers", "tok", "--output", "run"]
    assert train_settings(train_parser().parse_args(words))[1].label_smoothing == 0.1  # OpenNMT-py's
    assert train_settings(train_parser().parse_args([*words, "--label-smoothing", "0"]))[1].label_smoothing == 0.0
    with pytest.raises(SystemExit):
        train_parser().parse_args([*words, "--label-smoothing", "1"])
    assert "--label-smoothing: must be in [0, 1), got 1" in capsys.readouterr().err
