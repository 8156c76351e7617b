"""The engine's inputs and settings: placeholders, bad requests, invalid repositories, engine
settings, and no torch (split from tests/test_engine.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_SENTENCES
from service.text import placeholders
from service.decoding.engine import Engine
from service.errors import ErrorKind, ModelRepositoryError, NmtError
from service.models.manifest import MANIFEST, checksums, write_manifest
from service.options import DecodingOptions, Limits, validate_request
from service.errors import ProviderUnavailableError


@pytest.fixture(scope="module")
def engine(reversal_repository: Path) -> Engine:
    return Engine(reversal_repository, intra_op_threads=1)


@pytest.mark.parametrize("beam", [1, 3])
def test_placeholders_are_kept_exactly(tiny_repository: Path, beam: int) -> None:
    engine = Engine(tiny_repository, intra_op_threads=1)
    sources = [src for src, _ in TINY_SENTENCES]
    got = engine.translate(sources, DecodingOptions(beam_size=beam, num_hypotheses=beam))
    with_placeholders = 0
    for src, t in zip(sources, got):
        wanted = sorted(placeholders.find(src))
        with_placeholders += bool(wanted)
        for h in t.hypotheses:
            assert sorted(placeholders.find(h.text)) == wanted, (src, h.text)
    assert with_placeholders >= 6


LONG = " ".join(["7"] * 300)


@pytest.mark.parametrize("text, options, match", [
    ("", DecodingOptions(), r"texts\[0\] must be a non-empty, non-whitespace string, got ''"),
    (" \t\n", DecodingOptions(), r"texts\[0\] must be a non-empty, non-whitespace string"),
    (LONG, DecodingOptions(), r"texts\[0\] must be at most 200 source tokens .*got 301"),
    ("1" * 2001, DecodingOptions(), r"texts\[0\] length must be at most 2000 characters, got 2001"),
    ("1 2", DecodingOptions(beam_size=0), r"options\.beam_size must be between 1 and 16, got 0"),
    ("1 2", DecodingOptions(beam_size=17), r"options\.beam_size must be between 1 and 16, got 17"),
    ("1 2", DecodingOptions(beam_size=2, num_hypotheses=3),
     r"options\.num_hypotheses must be between 1 and beam_size \(2\), got 3"),
    ("1 2", DecodingOptions(max_decoding_length=-1), r"options\.max_decoding_length must be between 1 and 512, got -1"),
    ("1 2", DecodingOptions(max_decoding_length=10**9), r"options\.max_decoding_length .* got 1000000000"),
    ("1 2", DecodingOptions(max_length_ratio=-2.0), r"options\.max_length_ratio must be in \(0, 10\.0\], got -2\.0"),
    ("1 2", DecodingOptions(max_length_ratio=1e6), r"options\.max_length_ratio .* got 1000000\.0"),
    ("1 2", DecodingOptions(length_penalty=-1.0), r"options\.length_penalty must be between 0 and 10, got -1\.0"),
])
def test_bad_input_names_field_limit_and_value(engine: Engine, text: str, options: DecodingOptions,
                                               match: str) -> None:
    """The request's one validation, then the model's source-length check at tokenizing."""
    with pytest.raises(NmtError, match=match) as err:
        validate_request([text], options, engine.limits)
        engine.prepare_text(text, options, 0)
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT


def test_translate_names_the_bad_text_by_index(engine: Engine) -> None:
    with pytest.raises(NmtError, match=r"texts\[2\] must be a non-empty"):
        engine.translate(["1 2", "3", "   "])
    small = Engine(engine.manifest, limits=Limits(max_source_tokens=4))
    with pytest.raises(NmtError, match=r"texts\[0\] must be at most 4 source tokens .*got 6"):
        small.prepare_text("1 2 3 5 6", DecodingOptions(), 0)


def edited_copy(repo: Path, tmp_path: Path, edit) -> Path:
    copy = Path(shutil.copytree(repo, tmp_path / "repo"))
    raw = json.loads((copy / MANIFEST).read_text())
    edit(copy, raw)
    raw["files"] = checksums(copy, list(raw["files"]))
    write_manifest(copy, raw)
    return copy


def test_invalid_repositories_are_refused(tiny_repository: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelRepositoryError, match="does not exist"):
        Engine(tmp_path / "missing")
    tampered = Path(shutil.copytree(tiny_repository, tmp_path / "tampered"))
    with (tampered / "decoder_step.onnx").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelRepositoryError, match=r"decoder_step\.onnx: sha256 mismatch"):
        Engine(tampered)
    garbage = edited_copy(tiny_repository, tmp_path / "g",
                          lambda root, raw: (root / "encoder.onnx").write_bytes(b"not onnx"))
    with pytest.raises(ModelRepositoryError, match=r"encoder\.onnx: cannot be loaded by ONNX Runtime"):
        Engine(garbage)

    def swap(root: Path, raw: dict) -> None:
        raw["graphs"]["fp32"] = {"encoder": "decoder_step.onnx", "decoder_step": "encoder.onnx"}

    with pytest.raises(ModelRepositoryError, match="do not match the contract"):
        Engine(edited_copy(tiny_repository, tmp_path / "s", swap))
    no_int8 = edited_copy(tiny_repository, tmp_path / "n", lambda root, raw: raw["graphs"].pop("int8"))
    with pytest.raises(ModelRepositoryError, match=r"no 'int8' graphs \(the manifest has \['fp32'\]\)"):
        Engine(no_int8, precision="int8")
    bad_tok = edited_copy(tiny_repository, tmp_path / "t",
                          lambda root, raw: (root / "target.model").write_bytes(b"junk"))
    with pytest.raises(ModelRepositoryError, match=r"target\.model: not a SentencePiece model"):
        Engine(bad_tok)


def test_bad_engine_settings(tiny_repository: Path) -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        Engine(tiny_repository, precision="int4")
    with pytest.raises(ValueError, match="provider must be one of"):
        Engine(tiny_repository, provider="tpu")
    with pytest.raises(ValueError, match="intra_op_threads must be >= 1, got 0"):
        Engine(tiny_repository, intra_op_threads=0)
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ProviderUnavailableError, match="onnxruntime-gpu"):
            Engine(tiny_repository, provider="cuda")


def test_the_engine_never_imports_torch(tiny_repository: Path) -> None:
    code = (
        "import sys\n"
        "from service.decoding.engine import Engine\n"
        "from service.options import DecodingOptions\n"
        f"e = Engine({str(tiny_repository)!r}, intra_op_threads=1)\n"
        "t = e.translate(['Delete %s files?', 'Open the file'], DecodingOptions(beam_size=2, return_attention=True))\n"
        "assert t[0].hypotheses[0].text and '%s' in t[0].hypotheses[0].text\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'export')))\n"
        "print('imported:', bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "imported: []"


def test_cuda_sessions_ask_for_tf32_off_and_the_cpu_for_what_cuda_lacks() -> None:
    from service.decoding.runtime import provider_list

    assert provider_list("cpu") == ["CPUExecutionProvider"]
    (cuda, options), cpu = provider_list("cuda")
    assert (cuda, cpu) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert options == {"use_tf32": "0"}  # loadtest/results/bench_cuda.md
    with pytest.raises(ValueError, match="provider must be one of"):
        provider_list("rocm")
