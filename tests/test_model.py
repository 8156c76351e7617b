"""The model family (every attention kind): padding invariance, masks, the kinds' computation,
checkpoints."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from export.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from export.train.model import RNNSearch
from export.train.search import greedy
from export.train.training import collate
from service.models.attention import KINDS
from service.models.config import ModelConfig

CONFIG = ModelConfig(src_vocab_size=30, tgt_vocab_size=25, emb_size=12, enc_hidden_size=10,
                     dec_hidden_size=14, attn_size=9, out_size=6, dropout=0.0)


def config_of(kind: str) -> ModelConfig:
    """CONFIG with ``kind``'s attention (luong-dot scores h_t . h_j: dec_hidden = 2 x enc_hidden)."""
    return replace(CONFIG, attention=kind, dec_hidden_size=20 if kind == "luong-dot" else CONFIG.dec_hidden_size)


@pytest.fixture(params=KINDS)
def model(request: pytest.FixtureRequest) -> RNNSearch:
    torch.manual_seed(0)
    return RNNSearch(config_of(request.param)).eval()


def _batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(4, CONFIG.src_vocab_size, (n - 1,), generator=g).tolist() + [CONFIG.eos_id]
            for n in lengths]
    src, lens, _, _ = collate([(r, [CONFIG.eos_id]) for r in rows])
    return src, lens


@torch.inference_mode()
def test_encoder_and_step_are_padding_invariant(model: RNNSearch) -> None:
    src, lens = _batch([4, 9, 6])
    ann, keys, state = model.encoder(src, lens)
    for b, n in enumerate(lens.tolist()):
        a1, k1, s1 = model.encoder(src[b:b + 1, :n], lens[b:b + 1])
        torch.testing.assert_close(ann[b, :n], a1[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(keys[b, :n], k1[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(state[b], s1[0], atol=1e-6, rtol=0)  # backward h_1 saw no padding
        prev = torch.tensor([CONFIG.bos_id])
        lp_alone, st_alone, al_alone = model.step_log_probs(prev, s1, a1, k1, src[b:b + 1, :n] != 0)
        lp, st, al = model.step_log_probs(prev, state[b:b + 1], ann[b:b + 1], keys[b:b + 1], src[b:b + 1] != 0)
        torch.testing.assert_close(lp, lp_alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(st, st_alone, atol=1e-6, rtol=0)
        torch.testing.assert_close(al[:, :n], al_alone, atol=1e-6, rtol=0)
        assert float(al[:, n:].abs().sum()) == 0.0  # no attention on padding


@torch.inference_mode()
def test_all_padding_row_gives_no_nan(model: RNNSearch) -> None:
    src, lens = _batch([3, 5])
    ann, keys, state = model.encoder(src, lens)
    mask = torch.zeros_like(src, dtype=torch.bool)
    lp, st, al = model.step_log_probs(torch.tensor([2, 2]), state, ann, keys, mask)
    assert torch.isfinite(lp).all() and torch.isfinite(al).all() and torch.isfinite(st).all()


def test_greedy_is_batch_invariant(model: RNNSearch) -> None:
    src, lens = _batch([4, 9, 6, 2], seed=3)
    together = greedy(model, src, lens, max_len=12)
    for b, n in enumerate(lens.tolist()):
        alone = greedy(model, src[b:b + 1, :n], lens[b:b + 1], max_len=12)[0]
        assert alone.tokens == together[b].tokens
        assert alone.score == pytest.approx(together[b].score, abs=1e-4)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="dec_hidden_size must be > 0, got 0"):
        ModelConfig(src_vocab_size=5, tgt_vocab_size=5, dec_hidden_size=0)
    with pytest.raises(ValueError, match="dropout"):
        ModelConfig(src_vocab_size=5, tgt_vocab_size=5, dropout=1.5)


def test_checkpoint_round_trip_and_bad_files(model: RNNSearch, tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    save_checkpoint(path, model, {"source.model": b"x", "target.model": b"y"})
    ckpt = load_checkpoint(path)
    assert ckpt.config == model.config and ckpt.tokenizers["source.model"] == b"x"
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt.model().state_dict()[k], v)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt: not a PyTorch checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": {}}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="foreign.pt: not an nmt-serve RNNsearch checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    raw = torch.load(path, weights_only=True)
    raw["config"]["emb_size"] = 13  # another config than the weights'
    torch.save(raw, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="other.pt: weights do not fit the config"):
        load_checkpoint(tmp_path / "other.pt")


def test_a_checkpoint_of_one_kind_under_another_kinds_config_names_both(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "m.pt", RNNSearch(config_of("bahdanau")), {})
    raw = torch.load(tmp_path / "m.pt", weights_only=True)
    raw["config"]["attention"] = "luong-general"
    torch.save(raw, tmp_path / "mixed.pt")
    with pytest.raises(CheckpointError, match="mixed.pt: the weights are an attention 'bahdanau' model's, "
                                              "but the config says attention 'luong-general'"):
        load_checkpoint(tmp_path / "mixed.pt")
    raw["config"]["attention"] = "luong-concat"
    torch.save(raw, tmp_path / "unknown.pt")
    with pytest.raises(CheckpointError, match="attention must be one of bahdanau, luong-general, luong-dot, "
                                              "none; got 'luong-concat'"):
        load_checkpoint(tmp_path / "unknown.pt")
    with pytest.raises(ValueError, match="luong-dot needs dec_hidden_size == 2 x enc_hidden_size"):
        replace(CONFIG, attention="luong-dot")


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["luong-general", "luong-dot"])
def test_luong_attends_from_the_current_state_and_feeds_its_output(kind: str) -> None:
    """Luong's order, written out: h_t = GRU([E y; h~_{t-1}], h_{t-1}); score from h_t;
    h~_t = tanh(W_c [c_t; h_t]); p = softmax(W_s h~_t + b); the next step reads h~_t."""
    torch.manual_seed(1)
    model = RNNSearch(config_of(kind)).eval()
    dec, H = model.decoder, model.config.dec_hidden_size
    src, lens = _batch([5, 3])
    ann, keys, state = model.encoder(src, lens)
    assert torch.equal(state[:, H:], torch.zeros(2, H))  # h~_0 = 0
    mask = src != 0
    prev = torch.tensor([5, 7])
    for _ in range(3):
        h_prev, fed = state[:, :H], state[:, H:]
        h = dec.cell(torch.cat([dec.embed(prev), fed], 1), h_prev)
        scored = ann @ model.encoder.keys.weight.T if kind == "luong-general" else ann  # W_a h_j, or h_j
        energy = torch.einsum("bsh,bh->bs", scored, h).masked_fill(~mask, -1e9)
        alpha = torch.softmax(energy, 1)
        context = torch.einsum("bs,bsc->bc", alpha, ann)
        h_tilde = torch.tanh(dec.combine(torch.cat([context, h], 1)))
        expected = torch.log_softmax(dec.output(h_tilde), 1)
        log_probs, state, al = model.step_log_probs(prev, state, ann, keys, mask)
        torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(al, alpha, atol=1e-6, rtol=0)
        torch.testing.assert_close(state, torch.cat([h, h_tilde], 1), atol=1e-6, rtol=0)
        prev = log_probs.argmax(1)


@torch.inference_mode()
def test_rnnencdec_reads_one_fixed_summary() -> None:
    """``none``: c = [forward h_T; backward h_1] at every step, no attention."""
    torch.manual_seed(2)
    model = RNNSearch(config_of("none")).eval()
    H, half = model.config.dec_hidden_size, model.config.enc_hidden_size
    src, lens = _batch([6, 2, 4])
    ann, keys, state = model.encoder(src, lens)
    assert keys.shape == (3, src.shape[1], 0)
    summary = torch.stack([torch.cat([ann[b, n - 1, :half], ann[b, 0, half:]]) for b, n in enumerate(lens.tolist())])
    torch.testing.assert_close(state[:, H:], summary, atol=0, rtol=0)
    torch.testing.assert_close(state[:, :H], torch.tanh(model.encoder.init_state(summary)), atol=1e-6, rtol=0)
    prev = torch.tensor([5, 6, 7])
    for _ in range(3):
        log_probs, state, alpha = model.step_log_probs(prev, state, ann, keys, src != 0)
        assert torch.equal(state[:, H:], summary) and float(alpha.abs().sum()) == 0.0
        prev = log_probs.argmax(1)


def test_release_halves_weights_and_drops_optimizer(model: RNNSearch, tmp_path: Path) -> None:
    from export.train.checkpoint import release

    save_checkpoint(tmp_path / "train.pt", model, {"source.model": b"x", "target.model": b"y"},
                    extra={"optimizer": {"state": {}}, "train_state": {"step": 7}})
    release(tmp_path / "train.pt", tmp_path / "new" / "ship.pt")  # a directory not made yet
    shipped = load_checkpoint(tmp_path / "new" / "ship.pt")
    assert all(v.dtype == torch.float16 for v in shipped.weights.values() if v.is_floating_point())
    assert "optimizer" not in shipped.extra and shipped.extra["train_state"] == {"step": 7}
    src, lens = _batch([5, 3])
    with torch.inference_mode():
        full = model.encoder(src, lens)[0]
        half = shipped.model().encoder(src, lens)[0]
    torch.testing.assert_close(half, full, atol=5e-3, rtol=0)  # fp16 rounding only


def test_token_logits_are_forward_on_the_real_positions(model: RNNSearch) -> None:
    """The trainer's path (rows longest first, padding never computed) gives ``forward``'s
    logits on every real target position, and only those."""
    src, lens = _batch([4, 9, 6, 2], seed=5)
    g = torch.Generator().manual_seed(6)
    tgt_lengths = [3, 1, 6, 4]
    tgt_out = torch.zeros(4, 6, dtype=torch.long)
    for b, n in enumerate(tgt_lengths):
        tgt_out[b, :n] = torch.randint(4, CONFIG.tgt_vocab_size, (n,), generator=g)
    tgt_in = torch.zeros_like(tgt_out)
    tgt_in[:, 0] = CONFIG.bos_id
    tgt_in[:, 1:] = tgt_out[:, :-1]
    tgt_in[tgt_out == 0] = 0
    with torch.inference_mode():
        full, _ = model(src, lens, tgt_in)
        logits, targets = model.token_logits(src, lens, tgt_in, tgt_out)
    assert len(targets) == sum(tgt_lengths) and bool((targets != 0).all())
    order = sorted(range(4), key=lambda b: -tgt_lengths[b])
    expected = [(b, i) for i in range(6) for b in order if i < tgt_lengths[b]]  # step-major
    torch.testing.assert_close(logits, torch.stack([full[b, i] for b, i in expected]), atol=1e-5, rtol=0)
    assert targets.tolist() == [int(tgt_out[b, i]) for b, i in expected]
