"""The public API file: generated code up to date, every field commented, names shared."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.options import DecodingOptions
from service.proto.nmt.v1 import translation_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
PROTO = "proto/nmt/v1/translation.proto"
GENERATED = ("translation_pb2.py", "translation_pb2.pyi", "translation_pb2_grpc.py")


def protoc(out: Path) -> None:
    """The same command as ``make proto``, writing under ``out``."""
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iservice/proto=proto",
                    f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", PROTO],
                   cwd=ROOT, check=True, capture_output=True, text=True)


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    protoc(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "service/proto/nmt/v1" / name).read_bytes()
        checked_in = (ROOT / "service/proto/nmt/v1" / name).read_bytes()
        assert fresh == checked_in, f"service/proto/nmt/v1/{name} is stale: run `make proto`"


def test_decoding_options_have_the_same_names_in_proto_and_python() -> None:
    proto_fields = [f.name for f in pb.DecodingOptions.DESCRIPTOR.fields]
    assert proto_fields == [f.name for f in dataclasses.fields(DecodingOptions)]
    assert all(f.has_presence for f in pb.DecodingOptions.DESCRIPTOR.fields)  # 0 != unset


def test_enums_start_with_unspecified_zero() -> None:
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED"), enum.name


FIELD = re.compile(r"^\s*(optional |repeated )?[\w.<>, ]+ \w+ = \d+;")
DECLARATION = re.compile(r"^\s*(message|enum|service|rpc) ")


def test_every_field_and_declaration_has_a_comment() -> None:
    lines = (ROOT / PROTO).read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        if FIELD.match(line) or DECLARATION.match(line):
            if not lines[i - 1].strip().startswith("//"):
                missing.append(f"{i + 1}: {line.strip()}")
    assert not missing, "uncommented:\n" + "\n".join(missing)


def test_comment_check_sees_fields() -> None:
    assert FIELD.match("  map<string, double> quality = 7;")
    assert FIELD.match("  optional int32 beam_size = 1;")
    assert FIELD.match("  RESULT_KIND_FINAL = 2;")
