"""What the service answers to bad input, overload, deadlines and cancellation.

Bad input is refused with a status naming the field, the limit and the value, on
both RPCs, and the server keeps serving. Deadlines, cancellation and overload use
``slow_server`` (conftest.py): the reversal model whose decoder steps take 50 ms,
admitting one long text at a time.
"""

from __future__ import annotations

import logging
import re
import time

import grpc
import pytest

from harness import LONG_DIGITS, ServerThread, wait_until
from service.decoding.engine import Engine
from service.proto.nmt.v1 import translation_pb2 as pb

# ---- bad input ------------------------------------------------------------------------------

BAD = [
    (dict(texts=[]), "INVALID_ARGUMENT", r"texts must be at least one text, got 0"),
    (dict(texts=["ok", "   "]), "INVALID_ARGUMENT", r"texts\[1\] must be a non-empty"),
    (dict(texts=["x" * 3000]), "INVALID_ARGUMENT", r"texts\[0\] length must be at most 2000 characters, got 3000"),
    (dict(texts=["file " * 300]), "INVALID_ARGUMENT", r"texts\[0\] must be at most \d+ source tokens"),
    (dict(texts=["a"] * 9), "INVALID_ARGUMENT", r"texts must be at most 8 texts, got 9"),
    (dict(texts=["a"], model="de-en"), "NOT_FOUND", r"model must be one of \['en-fr'\] \(or name/version of a loaded version\), got 'de-en'"),
    (dict(texts=["a"], options=dict(beam_size=0)), "INVALID_ARGUMENT",
     r"options.beam_size must be between 1 and 4, got 0"),
    (dict(texts=["a"], options=dict(beam_size=5)), "INVALID_ARGUMENT",
     r"options.beam_size must be between 1 and 4, got 5"),
    (dict(texts=["a"], options=dict(beam_size=2, num_hypotheses=3)), "INVALID_ARGUMENT",
     r"options.num_hypotheses must be between 1 and beam_size \(2\), got 3"),
    (dict(texts=["a"], options=dict(max_decoding_length=100000)), "INVALID_ARGUMENT",
     r"options.max_decoding_length must be between 1 and 512, got 100000"),
    (dict(texts=["a"], options=dict(max_length_ratio=1e9)), "INVALID_ARGUMENT",
     r"options.max_length_ratio must be in \(0, 10.0\], got 1000000000.0"),
    (dict(texts=["a"], options=dict(length_penalty=-1)), "INVALID_ARGUMENT",
     r"options.length_penalty must be between 0 and 10, got -1.0"),
    (dict(texts=["x" * 70_000]), "RESOURCE_EXHAUSTED", r"larger than max \(\d+ vs. 65536\)"),
]


@pytest.mark.parametrize("fields, code, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_input_names_field_limit_and_value(tiny_server: ServerThread, fields: dict, code: str,
                                               message: str) -> None:
    request = pb.TranslateRequest(**{**fields, "options": pb.DecodingOptions(**fields.get("options", {}))})
    api = tiny_server.api
    for call in (api.Translate, lambda r, timeout: list(api.TranslateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=10)
        assert e.value.code().name == code
        assert re.search(message, e.value.details()), e.value.details()


def test_server_keeps_serving_after_bad_input(tiny_server: ServerThread) -> None:
    before = tiny_server.metric("nmt_requests_total", method="Translate", code="INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError):
        tiny_server.api.Translate(pb.TranslateRequest(texts=[]), timeout=10)
    reply = tiny_server.api.Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=30)
    assert len(reply.translations) == 1
    assert tiny_server.metric("nmt_requests_total", method="Translate", code="INVALID_ARGUMENT") == before + 1


# ---- deadlines, cancellation, overload (a server whose steps take 50 ms) ---------------------

def rows_left(server: ServerThread, removed: int) -> None:
    """Waits until one more text's rows left the batch; then no decoder step runs any more."""
    engine = server.engine
    wait_until(lambda: engine.removed == removed + 1, timeout=30, what="the text's rows removed from the batch")
    steps = engine.steps
    time.sleep(5 * engine.step_seconds)
    assert engine.steps == steps and server.metric("nmt_inflight_rows") == 0


def test_deadline_expiring_mid_decode_stops_decoding(slow_server: ServerThread) -> None:
    before, removed = slow_server.metric("nmt_deadline_exceeded_total"), slow_server.engine.removed
    with pytest.raises(grpc.RpcError) as e:
        slow_server.api.Translate(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    rows_left(slow_server, removed)
    assert slow_server.metric("nmt_deadline_exceeded_total") == before + 1


def test_cancelled_call_frees_its_rows(slow_server: ServerThread) -> None:
    before, removed = slow_server.metric("nmt_cancelled_total"), slow_server.engine.removed
    call = slow_server.api.Translate.future(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    wait_until(lambda: slow_server.metric("nmt_inflight_rows") == 1, timeout=30, what="the call decoding")
    call.cancel()
    rows_left(slow_server, removed)
    assert slow_server.metric("nmt_cancelled_total") == before + 1
    assert slow_server.metric("nmt_requests_total", method="Translate", code="CANCELLED") >= 1


def test_overload_is_refused_at_once_while_accepted_calls_finish(slow_server: ServerThread,
                                                                 reversal_engine: Engine) -> None:
    api = slow_server.api
    accepted = api.Translate.future(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    wait_until(lambda: slow_server.metric("nmt_inflight_rows") == 1, timeout=30, what="the call decoding")
    with pytest.raises(grpc.RpcError) as e:
        api.Translate(pb.TranslateRequest(texts=[LONG_DIGITS]), timeout=60)
    assert not accepted.done()  # refused at once: while the accepted call still decodes, not after it
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.search(r"queued work would be \d+ .* above the limit max_queued_work=\d+", e.value.details())
    expected = reversal_engine.translate([LONG_DIGITS])[0].hypotheses[0].text
    assert accepted.result().translations[0].hypotheses[0].text == expected


def test_status_send_to_a_closed_call_logs_no_traceback(tiny_server: ServerThread,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """gRPC core's failed status send after the client closed the call (the hostile soak's
    cancel racing a stream's end, seen once in CI) is one DEBUG line; other errors keep theirs."""
    from grpc._cython import cygrpc

    core = logging.getLogger("grpc._cython.cygrpc")  # the filter is the server's, installed by it

    def failed(error: Exception, message: str) -> None:
        try:
            raise error
        except Exception:
            core.exception(message)

    closed = cygrpc.ExecuteBatchError('Failed "execute_batch": (<grpc._cython.cygrpc.'
                                      'SendStatusFromServerOperation object at 0x7f>,)')
    method = "ExecuteBatchError raised in core by servicer method [/nmt.v1.Translator/TranslateStream]"
    caplog.set_level(logging.INFO)
    failed(closed, method)
    assert "Traceback" not in caplog.text and "TranslateStream" not in caplog.text
    caplog.set_level(logging.DEBUG)
    failed(closed, method)
    [record] = [r for r in caplog.records if "TranslateStream" in r.getMessage()]
    assert record.levelno == logging.DEBUG and record.exc_info is None
    assert "client closed the call before its status was sent" in record.getMessage()
    failed(ValueError("a servicer bug"), "Unexpected [ValueError] raised by servicer method [/x]")
    assert "Traceback" in caplog.text and "a servicer bug" in caplog.text
