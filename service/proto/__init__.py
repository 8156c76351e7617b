"""Generated gRPC/protobuf code for ``proto/nmt/v1/translation.proto``: do not edit.

Regenerate with ``make proto``; ``tests/test_proto.py`` fails when these files
are stale. Generated with ``-Iservice/proto=proto`` so that the imports inside
the generated code are ``service.proto.nmt.v1`` (no top-level ``nmt`` package).
"""
