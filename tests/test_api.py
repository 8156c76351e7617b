"""The gRPC API's answers: Translate, TranslateStream, ListModels, reflection, health;
shared batches under load, the metrics a known sequence of requests moves, the
request log line, and the ``nmt translate`` client.

Servers run in-process on port 0 (``harness.ServerThread``, the ``server`` and
``tiny_server`` fixtures); tests talk to them with ordinary blocking gRPC clients.
"""

from __future__ import annotations

import io
import logging
import random
import re
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from harness import LONG_DIGITS, SERVING, ServerThread, wait_until
from service.api.grpc_server import SERVICE_NAME
from service.clients import translate as client
from service.decoding.engine import Engine
from service.models.manifest import sha256_file
from service.options import DecodingOptions
from service.proto.nmt.v1 import translation_pb2 as pb


def best(engine: Engine, texts: list[str], **options: object) -> list[str]:
    """What the engine alone answers: the reference for every served answer."""
    return [t.hypotheses[0].text for t in engine.translate(texts, DecodingOptions(**options))]


# ---- translate, stream, list models, reflection, health -----------------------------------

def test_translate_answers_like_the_engine_alone_in_input_order(server: ServerThread,
                                                                reversal_engine: Engine) -> None:
    texts = ["3 1 4", "1 5 9 2 6", "2 7 1 8 2 8 1"]
    reply = server.api.Translate(pb.TranslateRequest(texts=texts), timeout=60)
    assert reply.kind == pb.RESULT_KIND_FINAL
    assert [t.hypotheses[0].text for t in reply.translations] == [best(reversal_engine, [t])[0] for t in texts]
    first = reply.translations[0]
    assert list(first.source_tokens) == list(reversal_engine.prepare_text("3 1 4", DecodingOptions(), 0).source_pieces[:-1])
    assert first.hypotheses[0].score < 0 and first.hypotheses[0].tokens
    assert not first.hypotheses[0].alignments


def test_beam_nbest_and_alignments(server: ServerThread, reversal_engine: Engine) -> None:
    options = pb.DecodingOptions(beam_size=4, num_hypotheses=3, return_attention=True)
    reply = server.api.Translate(pb.TranslateRequest(texts=["1 2 3 4"], options=options), timeout=60)
    t = reply.translations[0]
    assert len(t.hypotheses) == 3
    assert t.hypotheses[0].text == best(reversal_engine, ["1 2 3 4"], beam_size=4, num_hypotheses=3)[0]
    top = t.hypotheses[0]
    assert len(top.alignments) == len(top.tokens)
    assert all(abs(sum(a.weights) - 1) < 1e-3 for a in top.alignments)
    assert t.source_tokens[top.alignments[0].source_index] == top.alignments[0].source_token


@pytest.mark.parametrize("beam_size", [1, 3])
def test_stream_sends_agreed_prefixes_then_the_final_answer(server: ServerThread, beam_size: int) -> None:
    request = pb.TranslateRequest(texts=[LONG_DIGITS, "1 2"], options=pb.DecodingOptions(beam_size=beam_size))
    responses = list(server.api.TranslateStream(request, timeout=60))
    partials, final = responses[:-1], responses[-1]
    assert final.kind == pb.RESULT_KIND_FINAL and partials
    assert all(p.kind == pb.RESULT_KIND_PARTIAL and len(p.translations) == 2 for p in partials)
    assert final == server.api.Translate(request, timeout=60)
    answer = final.translations[0].hypotheses[0].text
    texts = [p.translations[0].hypotheses[0].text for p in partials]
    assert all(answer.startswith(t) for t in texts) and texts == sorted(texts, key=len)
    both = [tuple(t.hypotheses[0].text for t in p.translations) for p in partials]
    assert len(set(both)) == len(both)  # an update only when some text's agreed prefix grew
    if beam_size == 1:  # greedy: every step decides one more token
        assert len(partials) >= len(final.translations[0].hypotheses[0].tokens) - 1


def test_list_models(server: ServerThread, reversal_repository: Path) -> None:
    models = server.api.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert [(m.name, m.version, m.precision, m.provider, m.is_default) for m in models] == [
        ("reversal", "1", "fp32", "cpu", True)]
    assert models[0].sha256 == sha256_file(reversal_repository / "manifest.json")
    assert list(models[0].languages) == ["en", "fr"]


def test_reflection_lists_the_services(server: ServerThread) -> None:
    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = db.get_services()
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(services)
    assert db.FindFileContainingSymbol(SERVICE_NAME).package == "nmt.v1"


def test_health_is_serving_for_the_server_and_the_service(server: ServerThread) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", SERVICE_NAME):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == SERVING


# ---- load, metrics, logs, client ------------------------------------------------------------

def test_200_concurrent_requests_answered_correctly_in_shared_batches(server: ServerThread,
                                                                      reversal_engine: Engine) -> None:
    rng = random.Random(5)
    texts = [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 10))) for _ in range(200)]
    steps_before = server.metric("nmt_batch_rows_count")
    single_before = server.metric("nmt_batch_rows_bucket", le="1.0")
    calls = [server.api.Translate.future(pb.TranslateRequest(texts=[t]), timeout=120) for t in texts]
    answers = [c.result().translations[0].hypotheses[0].text for c in calls]
    assert answers == best(reversal_engine, texts)  # batching never changes an answer
    reversed_ = [" ".join(reversed(t.split())) for t in texts]
    assert sum(a == r for a, r in zip(answers, reversed_)) >= 190  # and the model does reverse
    steps = server.metric("nmt_batch_rows_count") - steps_before
    multi_row = steps - (server.metric("nmt_batch_rows_bucket", le="1.0") - single_before)
    assert multi_row > 0 and server.metric("nmt_batch_rows_sum") / server.metric("nmt_batch_rows_count") > 1


def test_metrics_move_with_a_known_sequence_of_requests(server: ServerThread) -> None:
    names = [("nmt_requests_total", dict(method="Translate", code="OK")),
             ("nmt_requests_total", dict(method="Translate", code="INVALID_ARGUMENT")),
             ("nmt_requests_total", dict(method="TranslateStream", code="OK")),
             ("nmt_request_duration_seconds_count", dict(method="Translate")),
             ("nmt_source_tokens_count", {}), ("nmt_decoder_steps_count", {}),
             ("nmt_generated_tokens_total", {}), ("nmt_queue_wait_seconds_count", {})]
    before = [server.metric(n, **labels) for n, labels in names]
    api = server.api
    replies = [api.Translate(pb.TranslateRequest(texts=["1 2 3"]), timeout=30),
               api.Translate(pb.TranslateRequest(texts=["4 5", "6 7 8 9"]), timeout=30),
               list(api.TranslateStream(pb.TranslateRequest(texts=["5 6 7"]), timeout=30))[-1]]
    with pytest.raises(grpc.RpcError):
        api.Translate(pb.TranslateRequest(texts=["1"], options=pb.DecodingOptions(beam_size=99)), timeout=30)
    generated = sum(len(t.hypotheses[0].tokens) for r in replies for t in r.translations)
    after = [server.metric(n, **labels) for n, labels in names]
    assert [a - b for a, b in zip(after, before)] == [2, 1, 1, 3, 4, 3, generated, 4]
    assert server.metric("nmt_queue_depth") == 0 and server.metric("nmt_inflight_rows") == 0
    assert server.metric("nmt_model_info", name="reversal", version="1", precision="fp32") == 1
    assert server.metric("nmt_encode_duration_seconds_count") > 0
    assert server.metric("nmt_padding_ratio_count") == server.metric("nmt_batch_rows_count")


def test_one_debug_line_per_request(tiny_server: ServerThread, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="nmt.server")
    tiny_server.api.Translate(pb.TranslateRequest(texts=["Open the file", "Save"]), timeout=30)
    with pytest.raises(grpc.RpcError):
        tiny_server.api.Translate(pb.TranslateRequest(texts=[]), timeout=30)

    def server_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "nmt.server"]
    wait_until(lambda: len(server_lines()) >= 2, timeout=30, what="two nmt.server log lines")
    lines = server_lines()
    assert re.fullmatch(r"Translate peer=\S+ texts=2 code=OK \d+\.\d ms", lines[0])
    assert re.fullmatch(r"Translate peer=\S+ texts=0 code=INVALID_ARGUMENT \d+\.\d ms", lines[1])


def test_client_prints_translations_nbest_and_alignment(server: ServerThread, reversal_engine: Engine,
                                                        monkeypatch, capsys) -> None:
    assert client.main(["--server", server.address, "3 1 4", "1 5 9 2"]) == 0
    assert capsys.readouterr().out.splitlines() == best(reversal_engine, ["3 1 4", "1 5 9 2"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("1 2 3\n\n7 8\n"))
    assert client.main(["--server", server.address]) == 0
    first, last = best(reversal_engine, ["1 2 3", "7 8"])
    assert capsys.readouterr().out == f"{first}\n\n{last}\n"
    assert client.main(["--server", server.address, "--beam-size", "3", "--num-hypotheses", "2",
                        "--return-attention", "5 6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    top = reversal_engine.translate(["5 6"], DecodingOptions(beam_size=3, num_hypotheses=2))[0].hypotheses[0]
    assert re.fullmatch(rf"0 \|\|\| {re.escape(top.text)} \|\|\| -\d+\.\d{{4}}", lines[0])
    assert lines[1].split() == ["target", "source", "weight"]
    assert [line.split()[0] for line in lines[2:2 + len(top.tokens)]] == list(top.tokens)
    assert sum(line.startswith("1 ||| ") for line in lines) == 1
    assert client.main(["--server", server.address, "--beam-size", "0", "x"]) == 1
    assert "INVALID_ARGUMENT: options.beam_size must be between 1 and 4, got 0" in capsys.readouterr().err


def test_client_old_flag_names_still_work_and_say_they_are_deprecated(server: ServerThread, capsys) -> None:
    new = ["--beam-size", "3", "--num-hypotheses", "2", "--return-attention"]
    old = ["--beam", "3", "--nbest=2", "--alignment"]
    assert client.main(["--server", server.address, *new, "5 6 7"]) == 0
    answer = capsys.readouterr()
    assert client.main(["--server", server.address, *old, "5 6 7"]) == 0
    answer_old = capsys.readouterr()
    assert answer_old.out == answer.out and answer.out.startswith("0 ||| ") and answer.err == ""
    assert answer_old.err.splitlines() == ["nmt translate: --beam is deprecated, use --beam-size",
                                           "nmt translate: --nbest is deprecated, use --num-hypotheses",
                                           "nmt translate: --alignment is deprecated, use --return-attention"]
    for flag, name in client.DEPRECATED_FLAGS.items():
        assert client.parse([flag, *(["2"] if flag != "--alignment" else [])]) == client.parse(
            [name, *(["2"] if name != "--return-attention" else [])])


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf", "soon"])
def test_client_timeout_must_be_a_positive_number(timeout: str, capsys) -> None:
    """A timeout gRPC would take as given (-1, nan) is an argument error, exit 2 (issue 31 row 16's
    twin in nmt translate)."""
    with pytest.raises(SystemExit) as stop:
        client.parse([f"--timeout={timeout}", "text"])
    assert stop.value.code == 2
    assert "argument --timeout: must be a" in capsys.readouterr().err
    assert client.parse(["--timeout", "2.5", "text"]).timeout == 2.5
