"""Property-based fuzzing (``hypothesis``) of the request fields and of raw request bytes.

Against the in-process tiny server: whatever a client sends, the answer is never INTERNAL
or UNKNOWN (a bug or an unhandled exception), and the server stays up and correct.
Bounded: 150 examples each, no deadline (a 2-core machine under load is slow, not wrong).
"""

from __future__ import annotations

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harness import ServerThread, is_serving  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402

BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INT32 = st.integers(-(2 ** 31), 2 ** 31 - 1)

# texts: arbitrary unicode (no surrogates: protobuf strings are UTF-8), with the characters
# the server treats specially: placeholders, reserved-token brackets, invisible characters
SPECIAL = st.sampled_from(["%s", "%(name)s", "{0}", "{name}", "$HOME", "<b>", "</b>", "%%", "{{",
                           "\uff5f", "\uff60", "\uff5f3\uff60", "\u200b", "\ufeff", "\x00", " ", "\n"])
TEXT = st.lists(st.one_of(st.text(max_size=40), SPECIAL), max_size=12).map("".join)
OPTIONS = st.fixed_dictionaries({}, optional={
    "beam_size": st.one_of(st.integers(-2, 6), INT32),
    "num_hypotheses": st.one_of(st.integers(-1, 5), INT32),
    "length_penalty": st.floats(width=32),
    # long decodes of an untrained model are slow: mostly short, sometimes out of range
    "max_decoding_length": st.one_of(st.integers(-2, 12), st.sampled_from([0, 513, 2 ** 31 - 1])),
    "max_length_ratio": st.floats(width=32),
    "return_scores": st.booleans(), "return_attention": st.booleans()})
REQUEST = st.builds(lambda texts, model, options: pb.TranslateRequest(
    texts=texts, model=model, options=pb.DecodingOptions(**options)),
    st.lists(TEXT, max_size=10), st.one_of(st.just(""), st.just("en-fr"), st.text(max_size=30)), OPTIONS)


def status(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() not in BAD_CODES, (e.code(), e.details())
        return e.code()
    return grpc.StatusCode.OK


def still_serving(server: ServerThread) -> None:
    assert is_serving(server.channel)
    reply = server.api.Translate(pb.TranslateRequest(texts=["Open the file"]), timeout=60)
    assert len(reply.translations) == 1


@FUZZ
@given(request=REQUEST, stream=st.booleans())
def test_request_fields_never_internal_or_unknown(tiny_server: ServerThread, request: pb.TranslateRequest,
                                                  stream: bool) -> None:
    if stream:
        status(lambda: list(tiny_server.api.TranslateStream(request, timeout=60)))
    else:
        status(lambda: tiny_server.api.Translate(request, timeout=60))


def _mutate(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for index, value in flips:
        if out:
            out[index % len(out)] = value
    return bytes(out)


RAW = st.one_of(
    st.binary(max_size=300),
    st.builds(_mutate, REQUEST.map(lambda r: r.SerializeToString()),
              st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4)),
)


@FUZZ
@given(data=RAW, method=st.sampled_from(["Translate", "TranslateStream", "ListModels"]))
def test_raw_request_bytes_never_internal_or_unknown(tiny_server: ServerThread, data: bytes,
                                                     method: str) -> None:
    path = f"/nmt.v1.Translator/{method}"
    if method == "TranslateStream":
        call = tiny_server.channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        status(lambda: list(call(data, timeout=60)))
    else:
        call = tiny_server.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        status(lambda: call(data, timeout=60))


def test_the_server_is_still_up_and_correct_after_the_fuzzing(tiny_server: ServerThread) -> None:
    still_serving(tiny_server)
