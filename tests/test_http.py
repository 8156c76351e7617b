"""The HTTP/JSON API (``service.api.http_server``) beside gRPC, in the same process.

Answers are compared with gRPC's for the same request: the same translations, the same
error codes and messages. Bad input of HTTP's own (not JSON, wrong types, unknown fields,
too large, wrong content type, unknown path or method) gets a 4xx with a JSON error body
naming the problem, and the server keeps serving.
"""

from __future__ import annotations

import re
import threading

import grpc
import pytest
from google.protobuf import json_format

from conftest import SlowEngine
from harness import LONG_DIGITS, HttpAnswer, ServerThread, config_for, sse_events, wait_until
from service.proto.nmt.v1 import translation_pb2 as pb

TRANSLATE = "/v1/translate"
STREAM = "/v1/translate:stream"


def as_message(body: dict, message_type: type) -> object:
    return json_format.ParseDict(body, message_type())


def assert_error(answer: HttpAnswer, status: int, code: str, message: str) -> None:
    assert answer.status == status, (answer.status, answer.body)
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    assert body["code"] == code and re.search(message, body["message"]), body


# ---- answers: the same as gRPC's --------------------------------------------------------------

def test_translate_answers_what_grpc_answers(server: ServerThread) -> None:
    request = {"texts": ["1 2 3 4", "5 6 7"], "options": {"beam_size": 3, "num_hypotheses": 2,
                                                          "return_attention": True}}
    answer = server.http("POST", TRANSLATE, request)
    assert answer.status == 200 and answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    assert body["translations"][0]["hypotheses"][0]["text"] == "4 3 2 1"
    alignment = body["translations"][0]["hypotheses"][0]["alignments"][0]
    assert {"target_index", "source_index", "source_token", "weights"} <= set(alignment)  # proto names
    assert body["kind"] == "RESULT_KIND_FINAL"
    expected = server.api.Translate(as_message(request, pb.TranslateRequest), timeout=60)
    assert as_message(body, pb.TranslateResponse) == expected


def test_stream_sends_partials_then_the_final_answer(server: ServerThread) -> None:
    request = {"texts": ["1 2 3 4 5 6 7 8 9 0 1 2"]}
    answer = server.http("POST", STREAM, request)
    assert answer.status == 200 and answer.headers["content-type"] == "text/event-stream"
    events = sse_events(answer.body)
    names = [name for name, _ in events]
    assert names[-1] == "final" and set(names[:-1]) == {"partial"} and len(names) > 2
    partials = [data["translations"][0]["hypotheses"][0]["text"] for _, data in events[:-1]]
    final = as_message(events[-1][1], pb.TranslateResponse)
    assert final.translations[0].hypotheses[0].text == "2 1 0 9 8 7 6 5 4 3 2 1"
    assert all(final.translations[0].hypotheses[0].text.startswith(p) for p in partials)
    assert final == server.api.Translate(as_message(request, pb.TranslateRequest), timeout=60)
    assert events[0][1]["kind"] == "RESULT_KIND_PARTIAL"


def test_fast_json_is_protobufs_json_mapping(server: ServerThread) -> None:
    """``to_json``'s field-by-field path for TranslateResponse equals ``MessageToDict``."""
    import json

    from service.api.http_json import message_dict, to_json

    request = pb.TranslateRequest(texts=["1 2 3", "4 5 6 7 8"], options=pb.DecodingOptions(
        beam_size=3, num_hypotheses=3, return_attention=True))
    answers = [server.api.Translate(request, timeout=60), *server.api.TranslateStream(request, timeout=60)]
    assert {a.kind for a in answers} == {pb.RESULT_KIND_PARTIAL, pb.RESULT_KIND_FINAL}
    for answer in answers:
        assert json.loads(to_json(answer)) == message_dict(answer)


def test_models_health_and_readiness(server: ServerThread) -> None:
    answer = server.http("GET", "/v1/models")
    assert answer.status == 200
    expected = server.api.ListModels(pb.ListModelsRequest(), timeout=10)
    assert as_message(answer.json(), pb.ListModelsResponse) == expected
    assert answer.json()["models"][0]["is_default"] is True
    assert server.http("GET", "/healthz").json() == {"status": "alive"}
    assert server.http("GET", "/readyz").status == 200


def test_requests_are_counted_by_protocol(server: ServerThread) -> None:
    labels = dict(method="Translate", code="INVALID_ARGUMENT", protocol="http")
    before = server.metric("nmt_requests_total", **labels)
    server.http("POST", TRANSLATE, {"texts": []})
    assert server.metric("nmt_requests_total", **labels) == before + 1
    assert server.metric("nmt_request_duration_seconds_count", method="Translate", protocol="http") > 0


# ---- errors: the same kinds, codes and messages as gRPC ---------------------------------------

SHARED = [
    ({"texts": []}, 400, "INVALID_ARGUMENT"),
    ({"texts": ["a"], "model": "de-en"}, 404, "NOT_FOUND"),
    ({"texts": ["a"], "options": {"beam_size": 5}}, 400, "INVALID_ARGUMENT"),
    ({"texts": ["x" * 3000]}, 400, "INVALID_ARGUMENT"),
    ({"texts": ["a"] * 9}, 400, "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize("request_body, status, code", SHARED, ids=[c for _, _, c in SHARED])
@pytest.mark.parametrize("path", [TRANSLATE, STREAM])
def test_errors_carry_grpc_code_and_message(tiny_server: ServerThread, path: str, request_body: dict,
                                            status: int, code: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        tiny_server.api.Translate(as_message(request_body, pb.TranslateRequest), timeout=10)
    assert e.value.code().name == code
    assert_error(tiny_server.http("POST", path, request_body), status, code, re.escape(e.value.details()))


BAD = [
    (b"{not json", {}, 400, "INVALID_ARGUMENT", r"request body must be JSON"),
    (b"\xff\xfe", {}, 400, "INVALID_ARGUMENT", r"request body must be JSON"),
    (b"[1, 2]", {}, 400, "INVALID_ARGUMENT", r"must be a JSON object .* got list"),
    (b'{"texts": "a"}', {}, 400, "INVALID_ARGUMENT", r"texts"),
    (b'{"texts": ["a"], "options": {"beam_size": "big"}}', {}, 400, "INVALID_ARGUMENT", r"beam_size"),
    (b'{"texts": ["a"], "textz": ["b"]}', {}, 400, "INVALID_ARGUMENT", r"no field named \\?\"textz"),
    (b'{"texts": ["' + b"x" * 70_000 + b'"]}', {}, 413, "RESOURCE_EXHAUSTED", r"at most 65536 bytes"),
    (b'{"texts": ["a"]}', {"Content-Type": "text/plain"}, 415, "INVALID_ARGUMENT",
     r"Content-Type must be application/json, got 'text/plain'"),
    (b'{"texts": ["a"]}', {"X-Request-Timeout": "soon"}, 400, "INVALID_ARGUMENT",
     r"X-Request-Timeout must be a number of seconds > 0, got 'soon'"),
    (b'{"texts": ["a"]}', {"X-Request-Timeout": "-1"}, 400, "INVALID_ARGUMENT", r"X-Request-Timeout"),
]


@pytest.mark.parametrize("body, headers, status, code, message", BAD, ids=[m[:30] for *_, m in BAD])
def test_bad_http_input_names_the_problem(tiny_server: ServerThread, body: bytes, headers: dict,
                                          status: int, code: str, message: str) -> None:
    for path in (TRANSLATE, STREAM):
        answer = tiny_server.http("POST", path, body, {"Content-Type": "application/json", **headers})
        assert_error(answer, status, code, message)


def test_unknown_path_and_method(tiny_server: ServerThread) -> None:
    assert_error(tiny_server.http("GET", "/v2/nothing"), 404, "NOT_FOUND", r"GET /v2/nothing: no such path")
    answer = tiny_server.http("GET", TRANSLATE)
    assert_error(answer, 405, "UNIMPLEMENTED", r"GET /v1/translate: method not allowed \(allowed: POST\)")
    assert answer.headers["allow"] == "POST"
    assert_error(tiny_server.http("DELETE", "/v1/models"), 405, "UNIMPLEMENTED", r"allowed: GET")


def test_server_keeps_serving_after_bad_input(tiny_server: ServerThread) -> None:
    for body, headers, *_ in BAD:
        tiny_server.http("POST", TRANSLATE, body, {"Content-Type": "application/json", **headers})
    answer = tiny_server.http("POST", TRANSLATE, {"texts": ["Open the file"]})
    assert answer.status == 200 and len(answer.json()["translations"]) == 1
    reply = tiny_server.api.Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=30)
    assert len(reply.translations) == 1


# ---- deadlines and overload (a server whose steps take 50 ms) ---------------------------------

def test_deadline_header_answers_504(slow_server: ServerThread) -> None:
    before = slow_server.metric("nmt_deadline_exceeded_total")
    answer = slow_server.http("POST", TRANSLATE, {"texts": [LONG_DIGITS]}, {"X-Request-Timeout": "0.3"})
    assert_error(answer, 504, "DEADLINE_EXCEEDED", r".")
    assert slow_server.metric("nmt_deadline_exceeded_total") == before + 1


def test_deadline_mid_stream_ends_it_with_an_error_event(slow_server: ServerThread) -> None:
    answer = slow_server.http("POST", STREAM, {"texts": [LONG_DIGITS]}, {"X-Request-Timeout": "0.5"})
    assert answer.status == 200
    events = sse_events(answer.body)
    assert events[-1][0] == "error" and events[-1][1]["code"] == "DEADLINE_EXCEEDED"
    assert {name for name, _ in events[:-1]} <= {"partial"}


def test_client_leaving_a_stream_frees_its_rows(slow_server: ServerThread) -> None:
    import http.client
    import json

    before, removed = slow_server.metric("nmt_cancelled_total"), slow_server.engine.removed
    conn = http.client.HTTPConnection("127.0.0.1", slow_server.http_port, timeout=60)
    conn.request("POST", STREAM, body=json.dumps({"texts": [LONG_DIGITS]}),
                 headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"event: partial")
    conn.close()  # mid-decode
    wait_until(lambda: slow_server.engine.removed == removed + 1, timeout=30, what="the rows removed")
    wait_until(lambda: slow_server.metric("nmt_cancelled_total") == before + 1, timeout=30, what="counted")
    assert slow_server.metric("nmt_requests_total", method="TranslateStream", code="CANCELLED",
                              protocol="http") >= 1


def test_overload_answers_429_with_retry_after(slow_server: ServerThread) -> None:
    accepted: list[HttpAnswer] = []
    thread = threading.Thread(target=lambda: accepted.append(
        slow_server.http("POST", TRANSLATE, {"texts": [LONG_DIGITS]})))
    thread.start()
    wait_until(lambda: slow_server.metric("nmt_inflight_rows") == 1, timeout=30, what="the call decoding")
    for path in (TRANSLATE, STREAM):
        answer = slow_server.http("POST", path, {"texts": [LONG_DIGITS]})
        assert_error(answer, 429, "RESOURCE_EXHAUSTED", r"queued work would be \d+")
        assert int(answer.headers["retry-after"]) >= 1
    thread.join(60)
    assert accepted[0].status == 200


# ---- off, and draining ------------------------------------------------------------------------

def test_port_zero_turns_http_off(tiny_repository) -> None:
    with ServerThread(config_for(tiny_repository, "--http-port", "0")) as s:
        assert s.app.http.port == 0
        assert len(s.api.Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=30).translations) == 1


def test_draining_server_is_not_ready_and_finishes_in_flight_requests(reversal_repository) -> None:
    from service.decoding.engine import Engine

    s = ServerThread(config_for(reversal_repository), [SlowEngine(Engine(reversal_repository), 0.05)])
    assert s.http("GET", "/readyz").json() == {"status": "SERVING"}
    in_flight: list[HttpAnswer] = []
    thread = threading.Thread(target=lambda: in_flight.append(s.http("POST", TRANSLATE, {"texts": [LONG_DIGITS]})))
    thread.start()
    wait_until(lambda: s.metric("nmt_inflight_rows") == 1, timeout=30, what="the call decoding")
    s.stop(grace=60, wait=False)
    ready: list[HttpAnswer] = []
    wait_until(lambda: ready.append(s.http("GET", "/readyz")) or b"shutting down" in ready[-1].body,
               timeout=30, what="/readyz 503 while draining")
    assert_error(ready[-1], 503, "UNAVAILABLE", r"server shutting down")
    assert_error(s.http("POST", TRANSLATE, {"texts": ["1 2"]}), 503, "UNAVAILABLE", r"shutting down")
    assert s.http("GET", "/healthz").status == 200
    thread.join(60)
    assert in_flight[0].status == 200 and len(in_flight[0].json()["translations"]) == 1
    s.thread.join(30)
