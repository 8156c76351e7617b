"""One model config for both sides (``service.models.config.ModelConfig``): export writes it into
the checkpoint and the manifest, the server reads it back typed and checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import served_version
from service.errors import ModelRepositoryError
from service.models.config import ModelConfig
from service.models.manifest import MANIFEST, load_manifest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = served_version() / MANIFEST
SIZES = dict(src_vocab_size=30, tgt_vocab_size=25, emb_size=12, enc_hidden_size=10, dec_hidden_size=20,
             attn_size=14, out_size=8, dropout=0.0)
WRITTEN_BEFORE_THE_KINDS = {"src_vocab_size": 8000, "tgt_vocab_size": 8000, "emb_size": 256,
                            "enc_hidden_size": 256, "dec_hidden_size": 512, "attn_size": 512, "out_size": 256,
                            "dropout": 0.2, "pad_id": 0, "bos_id": 2, "eos_id": 3}  # models/en-fr/1's


def test_export_and_the_server_share_the_one_class(tiny_checkpoint: Path, tiny_repository: Path) -> None:
    from export.train import model
    from export.train.checkpoint import load_checkpoint

    assert model.ModelConfig is ModelConfig
    config = load_checkpoint(tiny_checkpoint).config
    served = load_manifest(tiny_repository).model_config
    assert type(config) is ModelConfig and type(served) is ModelConfig
    assert served == config


def test_a_manifest_round_trips_from_exports_writer_to_the_servers_loader(tiny_checkpoint: Path,
                                                                          tiny_repository: Path,
                                                                          tmp_path: Path) -> None:
    from export.graphs.repository import build_manifest, write_tokenizers
    from export.train.checkpoint import load_checkpoint
    from service.models.manifest import write_manifest

    ckpt = load_checkpoint(tiny_checkpoint)
    root = tmp_path / "en-fr" / "7"
    root.mkdir(parents=True)
    write_tokenizers(ckpt, tiny_checkpoint, root)
    for file in ("encoder.onnx", "decoder_step.onnx"):
        shutil.copy(tiny_repository / file, root / file)
    raw = build_manifest(ckpt, checkpoint=tiny_checkpoint, output=root, root=root, name="en-fr", version="7",
                         precisions=["fp32"], max_source_tokens=50)
    write_manifest(root, raw)
    assert json.loads((root / MANIFEST).read_text())["model_config"] == ckpt.config.to_dict()
    manifest = load_manifest(root)
    assert manifest.model_config == ckpt.config and manifest.attention == ckpt.config.attention


def test_the_shipped_manifests_config_loads_and_writes_back_the_same_json() -> None:
    raw = json.loads(SHIPPED.read_text())["model_config"]
    config = ModelConfig.from_dict(raw)
    assert config.to_dict() == raw
    assert (config.ctx_size, config.state_size, config.key_size) == (512, 512, 512)


def test_a_config_written_before_the_kinds_is_rnnsearch() -> None:
    config = ModelConfig.from_dict(WRITTEN_BEFORE_THE_KINDS)
    assert config.attention == "bahdanau" and config.has_attention
    assert config.to_dict() == {**WRITTEN_BEFORE_THE_KINDS, "attention": "bahdanau"}


@pytest.mark.parametrize("kind, state_size, key_size", [
    ("bahdanau", 20, 14), ("luong-general", 40, 20), ("luong-dot", 40, 0), ("none", 40, 0)])
def test_each_kinds_widths(kind: str, state_size: int, key_size: int) -> None:
    config = ModelConfig(**SIZES, attention=kind)
    assert (config.ctx_size, config.state_size, config.key_size) == (20, state_size, key_size)
    assert config.has_attention == (kind != "none")
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("change, message", [
    ({"emb_size": "12"}, r"model_config\.emb_size must be an integer, got '12'"),
    ({"emb_size": True}, r"model_config\.emb_size must be an integer, got True"),
    ({"src_vocab_size": 30.0}, r"model_config\.src_vocab_size must be an integer, got 30\.0"),
    ({"dropout": "0.1"}, r"model_config\.dropout must be a number, got '0\.1'"),
    ({"attention": None}, r"model_config\.attention must be a string, got None"),
    ({"attention": "luong-concat"}, r"model_config\.attention must be one of bahdanau, luong-general, "
                                    r"luong-dot, none; got 'luong-concat'"),
    ({"out_size": 0}, r"model_config\.out_size must be > 0, got 0"),
    ({"eos_id": 25}, r"model_config\.eos_id must be a token id of both vocabularies \(0 to 24\), got 25"),
    ({"dropout": 1.0}, r"model_config\.dropout must be in \[0, 1\), got 1\.0"),
    ({"heads": 4}, r"model_config has unknown fields \['heads'\]"),
])
def test_from_dict_refuses_a_bad_field_naming_it(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**ModelConfig(**SIZES).to_dict(), **change})


def test_from_dict_names_a_missing_field_and_a_non_object() -> None:
    raw = ModelConfig(**SIZES).to_dict()
    del raw["attn_size"]
    with pytest.raises(ValueError, match=r"^config\.attn_size is missing$"):
        ModelConfig.from_dict(raw, where="config")
    with pytest.raises(ValueError, match=r"model_config must be an object, got '\[1, 2\]'"):
        ModelConfig.from_dict([1, 2])
    assert ModelConfig.from_dict({**raw, "attn_size": 14, "dropout": 0}).dropout == 0.0  # JSON's 0


def test_the_constructor_checks_the_same_way() -> None:
    with pytest.raises(ValueError, match=r"ModelConfig\.enc_hidden_size must be an integer, got '10'"):
        ModelConfig(**{**SIZES, "enc_hidden_size": "10"})
    with pytest.raises(ValueError, match="luong-dot needs dec_hidden_size == 2 x enc_hidden_size"):
        ModelConfig(**{**SIZES, "dec_hidden_size": 30}, attention="luong-dot")


def test_the_manifest_loader_names_the_bad_field(tiny_repository: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(tiny_repository, tmp_path / "en-fr" / "1"))
    raw = json.loads((root / MANIFEST).read_text())
    raw["model_config"]["tgt_vocab_size"] = "60"
    (root / MANIFEST).write_text(json.dumps(raw))  # manifest.json itself has no checksum
    with pytest.raises(ModelRepositoryError, match=r"manifest\.json: model_config\.tgt_vocab_size must be "
                                                   r"an integer, got '60'"):
        load_manifest(root)


def test_a_checkpoint_with_a_mistyped_config_names_the_field(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import torch

    from export.train.checkpoint import CheckpointError, load_checkpoint

    raw = torch.load(tiny_checkpoint, weights_only=True)
    raw["config"]["dec_hidden_size"] = 32.0
    torch.save(raw, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=r"bad\.pt: bad model config \(config\.dec_hidden_size must be "
                                              r"an integer, got 32\.0\)"):
        load_checkpoint(tmp_path / "bad.pt")



def test_the_default_repository_is_the_highest_en_fr_version_shipped(tmp_path: Path) -> None:
    from service import config

    for name in ("3", "12", "notes"):
        (tmp_path / name).mkdir()
    assert config._served_en_fr(tmp_path) == tmp_path / "12"
    assert config.DEFAULT_MODEL_REPOSITORY == served_version()
