"""The Translator's method handlers, registered with deserializers that never raise.

The generated ``add_TranslatorServicer_to_server`` uses ``FromString``: bytes that are not
a valid message (corrupt wire format, invalid UTF-8 in a ``string`` field) make
``DecodeError`` escape into grpc.aio, which answers UNKNOWN ``Unexpected <class ...>``
and logs a traceback per call, before any of our code runs. Here a failed decode becomes
an ``Undecodable`` request; the servicer answers it INVALID_ARGUMENT, counts it and logs
one line (``grpc_server.TranslatorServicer._rpc``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import grpc
from google.protobuf.message import Message

from service.proto.nmt.v1 import translation_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Translator"].full_name  # "nmt.v1.Translator"


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that did not parse as ``message``."""

    message: str  # the full name of the expected message type
    reason: str  # what protobuf said (no request bytes in it)


def tolerant(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer for ``message_type`` that returns ``Undecodable`` instead of raising."""
    name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except Exception as e:  # DecodeError, or anything else hostile bytes provoke
            return Undecodable(message=name, reason=f"{type(e).__name__}: {str(e)[:120]}")
    return deserialize


def add_translator(servicer: Any, server: grpc.aio.Server) -> None:
    """Register the three RPCs, as the generated code does, with tolerant deserializers."""
    handlers = {
        "Translate": grpc.unary_unary_rpc_method_handler(
            servicer.Translate, request_deserializer=tolerant(pb.TranslateRequest),
            response_serializer=pb.TranslateResponse.SerializeToString),
        "TranslateStream": grpc.unary_stream_rpc_method_handler(
            servicer.TranslateStream, request_deserializer=tolerant(pb.TranslateRequest),
            response_serializer=pb.TranslateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=tolerant(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
