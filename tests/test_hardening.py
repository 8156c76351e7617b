"""Regression tests for the defects a hostile client found (the security issue, defects 1-8).

Each test sends what the hostile client sent and asserts what the server must answer now.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import grpc
import pytest

from harness import LONG_DIGITS, ServerThread, config_for
from service.errors import ModelRepositoryError
from service.models.manifest import MANIFEST, load_manifest, sha256_file
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc
from service.text import placeholders


def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


# ---- 1. a flood gets counted RESOURCE_EXHAUSTED, never a silent CANCELLED --------------------

FLOOD_CALLS = 2000  # above gRPC core's default 1000 pending requests


async def _flood(address: str, calls: int) -> list[str]:
    request = pb.TranslateRequest(texts=[LONG_DIGITS], options=pb.DecodingOptions(beam_size=4))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TranslatorStub(channel)

        async def one() -> str:
            try:
                await stub.Translate(request, timeout=300)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name
        return await asyncio.gather(*(one() for _ in range(calls)))


def test_a_flood_on_one_channel_is_answered_ok_or_counted_resource_exhausted(
        reversal_repository: Path) -> None:
    with ServerThread(config_for(reversal_repository, "--max-queued-work", "4000")) as s:
        codes = Counter(s.run_client(_flood(s.address, FLOOD_CALLS)))
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes  # no CANCELLED, no UNKNOWN
        assert codes["OK"] >= 1 and codes["RESOURCE_EXHAUSTED"] >= 1, codes
        counted = s.metric("nmt_requests_total", method="Translate", code="RESOURCE_EXHAUSTED")
        assert counted == codes["RESOURCE_EXHAUSTED"]
        assert s.metric("nmt_requests_total", method="Translate", code="OK") == codes["OK"]


# ---- 2. bytes that are not a valid request: INVALID_ARGUMENT, counted, one log line ----------

UNDECODABLE = [
    ("Translate", b"\x0a\x02\xff\xfe"),  # texts[0] is invalid UTF-8
    ("Translate", b"\x0a\x01a\x12\x02\xc3\x28"),  # model is invalid UTF-8
    ("Translate", b"\x0a\x05ab"),  # truncated: length 5, 2 bytes follow
    ("TranslateStream", b"\x0a\x02\xff\xfe"),
    ("ListModels", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"),  # a tag varint that never ends
]


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    """Send ``data`` as the request of ``method`` (identity serializers: any bytes go)."""
    path = f"/nmt.v1.Translator/{method}"
    if method == "TranslateStream":
        call = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        return code_of(lambda: list(call(data, timeout=30)))
    call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    return code_of(lambda: call(data, timeout=30))


def test_undecodable_requests_are_invalid_argument_counted_and_logged_once(
        server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    before = {m: server.metric("nmt_requests_total", method=m, code="INVALID_ARGUMENT")
              for m in ("Translate", "TranslateStream", "ListModels")}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for method, data in UNDECODABLE:
            code, details = raw_call(server.channel, method, data)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, data, code, details)
            assert "must be a valid nmt.v1." in details and "class" not in details
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == len(UNDECODABLE)  # one line each, no traceback
    assert all(r.name == "nmt.server" and not r.exc_info and "undecodable" in r.getMessage()
               for r in warnings)
    wanted = Counter(m for m, _ in UNDECODABLE)
    for method, n in wanted.items():
        assert server.metric("nmt_requests_total", method=method, code="INVALID_ARGUMENT") == \
            before[method] + n
    assert server.api.Translate(pb.TranslateRequest(texts=["1 2 3"]), timeout=30).translations


# ---- 3. long values are echoed shortened ------------------------------------------------------

def test_a_60_kb_model_name_is_not_found_with_a_short_message(server: ServerThread) -> None:
    code, details = code_of(lambda: server.api.Translate(
        pb.TranslateRequest(texts=["1 2"], model="m" * 60_000), timeout=30))  # the tests allow 64 KB
    assert code == grpc.StatusCode.NOT_FOUND
    assert "model must be one of ['reversal']" in details and "got 'mmm" in details
    assert "(60000 characters)" in details and len(details) < 300


# ---- 4. more placeholders than reserved tokens: INVALID_ARGUMENT naming the limit ----------------

@pytest.mark.parametrize("text, count", [(" ".join(f"{{p{i}}}" for i in range(20)), 20),
                                         ("Copy" + " %s" * 18, 18)])
def test_more_placeholders_than_reserved_tokens_is_invalid_argument(
        tiny_server: ServerThread, text: str, count: int) -> None:
    code, details = code_of(lambda: tiny_server.api.Translate(pb.TranslateRequest(texts=[text]),
                                                              timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (f"texts[0] placeholders must be at most {placeholders.MAX_PLACEHOLDERS} format "
                       f"placeholders (the model's reserved tokens; split the message), got {count}")


def test_sixteen_placeholders_all_come_back_none_invented(tiny_server: ServerThread) -> None:
    found = [f"{{p{i}}}" for i in range(16)]
    reply = tiny_server.api.Translate(pb.TranslateRequest(texts=[" ".join(found)]), timeout=60)
    assert sorted(placeholders.find(reply.translations[0].hypotheses[0].text)) == sorted(found)


# ---- 5. a request larger than --max-queued-work alone: INVALID_ARGUMENT on an idle server ------

def test_work_above_the_queue_limit_alone_is_invalid_argument(reversal_repository: Path,
                                                              reversal_engine) -> None:
    from service.options import DecodingOptions

    work = reversal_engine.prepare_text(LONG_DIGITS, DecodingOptions(beam_size=4), 0).work
    assert work > 100
    with ServerThread(config_for(reversal_repository, "--max-queued-work", "100")) as s:
        code, details = code_of(lambda: s.api.Translate(pb.TranslateRequest(
            texts=[LONG_DIGITS], options=pb.DecodingOptions(beam_size=4)), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("request work must be at most max_queued_work=100 ")
        assert details.endswith(f", got {work}")  # on an idle server: no retry can succeed
        assert s.api.Translate(pb.TranslateRequest(texts=["1 2"]), timeout=30).translations


# ---- 6. literal reserved-token characters survive ---------------------------------------------

@pytest.mark.parametrize("text", ["Delete \uff5f0\uff60 file", "a \uff60 b \uff5f c"])
def test_literal_reserved_token_characters_are_kept(tiny_server: ServerThread, text: str) -> None:
    protected = placeholders.protect(text)
    assert placeholders.restore(protected.text, protected.placeholders) == text
    reply = tiny_server.api.Translate(pb.TranslateRequest(texts=[text]), timeout=60)
    out = reply.translations[0].hypotheses[0].text
    for literal in protected.placeholders:
        assert out.count(literal) == text.count(literal), out


# ---- 7. invisible-only texts are refused like whitespace-only ones ----------------------------

@pytest.mark.parametrize("text", ["\u200b", "\ufeff\u200b ", "\x00\x01\x7f", "\u2028\u200e"])
def test_texts_of_invisible_characters_are_invalid_argument(tiny_server: ServerThread, text: str) -> None:
    code, details = code_of(lambda: tiny_server.api.Translate(
        pb.TranslateRequest(texts=["Open the file", text]), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("texts[1] must be a non-empty, non-whitespace string")


# ---- 8. manifest checks -----------------------------------------------------------------------

def _edit(tiny_repository: Path, tmp_path: Path, change) -> Path:
    root = tmp_path / "en-fr" / "1"
    shutil.copytree(tiny_repository, root)
    raw = json.loads((root / MANIFEST).read_text())
    change(root, raw)
    (root / MANIFEST).write_text(json.dumps(raw))
    return root


def _swap_target_tokenizer(root: Path, raw: dict) -> None:
    shutil.copy(root / raw["tokenizers"]["source"], root / raw["tokenizers"]["target"])
    raw["files"][raw["tokenizers"]["target"]] = sha256_file(root / raw["tokenizers"]["target"])


def _outside(root: Path, raw: dict) -> None:
    raw["files"]["../../../../etc/hostname"] = "0" * 64


def _double_hidden(root: Path, raw: dict) -> None:
    raw["model_config"]["dec_hidden_size"] *= 2


@pytest.mark.parametrize("change, message", [
    (_outside, r"file '\.\./\.\./\.\./\.\./etc/hostname' must be a relative path inside the repository"),
    (lambda root, raw: raw["files"].update({"/etc/hostname": "0" * 64}),
     r"file '/etc/hostname' must be a relative path inside"),
    (lambda root, raw: raw.update(graphs=["encoder.onnx"]),
     r"graphs must be an object precision -> \{\"encoder\": file, \"decoder_step\": file\}, "
     r"got \"\['encoder.onnx'\]\""),
    (lambda root, raw: raw["graphs"]["fp32"].pop("encoder"), r"graphs must be an object"),
    (lambda root, raw: raw.update(special_ids=[0, 1, 2, 3]),
     r"special_ids must be an object with integer pad, unk, bos, eos, got '\[0, 1, 2, 3\]'"),
    (lambda root, raw: raw.update(model_config={"dec_hidden_size": "big"}),
     r"model_config.dec_hidden_size must be an integer, got 'big'"),
])
def test_malformed_manifests_are_refused_naming_the_field(tiny_repository: Path, tmp_path: Path,
                                                          change, message: str) -> None:
    root = _edit(tiny_repository, tmp_path, change)
    with pytest.raises(ModelRepositoryError, match=message) as e:
        load_manifest(root)
    assert str(root / MANIFEST) in str(e.value) and "Error" not in str(e.value)


@pytest.mark.parametrize("change, message", [
    (_double_hidden, r"axis 1 \(state_size\) is \d+, but .*manifest.json model_config gives \d+"),
    (_swap_target_tokenizer, r"target.model: the target tokenizer is the source one"),
    (lambda root, raw: raw["model_config"].update(tgt_vocab_size=raw["model_config"]["tgt_vocab_size"] + 1),
     r"axis 1 \(vocab_size\) is \d+, but"),
])
def test_graphs_and_tokenizers_must_agree_with_model_config(tiny_repository: Path, tmp_path: Path,
                                                            change, message: str) -> None:
    from service.app import load_engines

    root = _edit(tiny_repository, tmp_path, change)
    with pytest.raises(ModelRepositoryError, match=message):
        load_engines(config_for(root))


# ---- kill -9 under load: a restart serves, nothing is left behind -----------------------------

def test_kill_9_under_load_then_a_restart_serves_and_nothing_is_left(tiny_repository: Path,
                                                                    tmp_path: Path) -> None:
    import signal
    import socket
    import threading

    from harness import ServerProcess, wait_until

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    first = ServerProcess(tiny_repository, tmp_path / "first.log", env=env)
    codes: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with grpc.insecure_channel(first.address) as ch:
            stub = pb_grpc.TranslatorStub(ch)
            while not stop.is_set():
                code, _ = code_of(lambda: stub.Translate(pb.TranslateRequest(
                    texts=["Open the file", "Delete %s files?"]), timeout=10))
                codes.append(code.name)
    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    wait_until(lambda: codes.count("OK") >= 10, timeout=120, what="load answered", process=first)
    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(30) == -signal.SIGKILL
    wait_until(lambda: codes[-1:] == ["UNAVAILABLE"], timeout=30, what="calls failing UNAVAILABLE")
    stop.set()
    for w in workers:
        w.join(30)
    assert set(codes) <= {"OK", "UNAVAILABLE"}, Counter(codes)
    for port in (first.port, first.metrics_port):  # nothing holds the ports
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    after_kill = sorted(p.name for p in scratch.iterdir())
    with ServerProcess(tiny_repository, tmp_path / "second.log", env=env) as second:
        reply = second.api.Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=60)
        assert len(reply.translations) == 1
        assert second.stop() == 0
    # the crash left nothing a clean stop does not (ONNX Runtime keeps a ".ses" id file)
    assert after_kill == sorted(p.name for p in scratch.iterdir())
