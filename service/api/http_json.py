"""The HTTP API's bodies: protobuf's JSON mapping (proto field names, zero values included).

``to_json`` is ``json_format.MessageToDict`` for any message, with a fast path for
``TranslateResponse`` (every answer and stream event), which builds the same dictionary from
the fields directly: MessageToDict's reflection costs about 0.1 ms of event-loop time per
answer. ``tests/test_http.py`` checks that the two agree on real answers.
"""

from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf import json_format
from google.protobuf.internal.type_checkers import ToShortestFloat
from google.protobuf.message import Message

from service.errors import ErrorKind
from service.proto.nmt.v1 import translation_pb2 as pb

KIND_NAMES = {value.number: value.name for value in pb.ResultKind.DESCRIPTOR.values}
MAX_JSON_DEPTH = 32  # a TranslateRequest nests 3 deep, a LibreTranslate body 2
_STRINGS_AND_BRACKETS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class BodyError(ValueError):
    """A request body that is no ``TranslateRequest``; the message names the problem."""

    kind = ErrorKind.INVALID_ARGUMENT


def dump(tree: Any) -> bytes:
    return json.dumps(tree, ensure_ascii=False, separators=(",", ":")).encode()


def message_dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def response_dict(message: pb.TranslateResponse) -> dict[str, Any]:
    """``message_dict`` of a ``TranslateResponse``, field by field."""
    return {"translations": [{
        "hypotheses": [{
            "text": h.text, "score": ToShortestFloat(h.score), "tokens": list(h.tokens),
            "alignments": [{"target_index": a.target_index, "source_index": a.source_index,
                            "source_token": a.source_token,
                            "weights": [ToShortestFloat(w) for w in a.weights]} for a in h.alignments]}
            for h in t.hypotheses],
        "source_tokens": list(t.source_tokens)} for t in message.translations],
        "kind": KIND_NAMES.get(message.kind, message.kind),
        "model": message.model, "model_version": message.model_version}


def to_json(message: Message) -> bytes:
    """A message in protobuf's JSON mapping."""
    if isinstance(message, pb.TranslateResponse):
        return dump(response_dict(message))
    return dump(message_dict(message))


def nested_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep (brackets inside strings do not
    count). Checked before ``json.loads``, which would otherwise recurse to the interpreter's
    limit: a garbage collection at that depth fails the finalizers it runs, in any thread."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for token in _STRINGS_AND_BRACKETS.finditer(body):
        first = token.group()[0]
        if first in b"[{":
            depth += 1
            if depth > limit:
                return True
        elif first in b"]}":
            depth -= 1
    return False


def loads(body: bytes) -> Any:
    """``json.loads`` of a request body; ``ValueError`` when it nests more than ``MAX_JSON_DEPTH``."""
    if nested_too_deep(body):
        raise ValueError(f"arrays and objects nested more than {MAX_JSON_DEPTH} deep (the limit)")
    return json.loads(body)


def parse_request(body: bytes) -> pb.TranslateRequest:
    """A ``TranslateRequest`` from its JSON mapping; ``BodyError`` naming the problem."""
    try:
        body.decode("utf-8")
        tree = loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise BodyError(f"request body must be JSON: {e}") from None
    if not isinstance(tree, dict):
        raise BodyError(f"request body must be a JSON object (a TranslateRequest), got {type(tree).__name__}")
    try:
        return json_format.ParseDict(tree, pb.TranslateRequest())
    except (json_format.ParseError, ValueError, TypeError) as e:
        raise BodyError(f"request body: {e}") from None
    except RecursionError:
        raise BodyError("request body is not valid JSON: nested too deep") from None


def sse(event: str, data: bytes) -> bytes:
    """One server-sent event."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
