"""Which served model fills a catalog (``nmt translate-po``), and into which language.

``--model`` names one (the check that it produces the catalog's language is ``target_language``).
Without it, the catalog's ``Language`` header (or ``--language``) picks the served model of that
direction from ``ListModels`` (``source_language``/``target_language``, an older server's
``languages`` list): a ``Language: de_DE`` catalog goes to the ``en-de`` model; a language no
served model produces is refused (exit 2) naming the served directions. A template without a
``Language`` gets the server's default model, as does a server whose models name no languages.
"""

from __future__ import annotations

import argparse
from typing import TextIO

import grpc
import polib

from service.clients import po_catalog as catalogs
from service.clients.po_catalog import Failure
from service.clients.po_channel import Metadata
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc


def direction(model: pb.ModelInfo) -> tuple[str, str]:
    """(source, target) primary codes of a listed model ("" where it names none)."""
    listed = [*model.languages, "", ""]
    source = model.source_language or listed[0]
    target = model.target_language or ([x for x in model.languages[1:] if x] or [""])[-1]
    return catalogs.primary(source), catalogs.primary(target)


def list_models(stub: pb_grpc.TranslatorStub, args: argparse.Namespace,
                metadata: Metadata) -> list[pb.ModelInfo]:
    try:
        return list(stub.ListModels(pb.ListModelsRequest(), timeout=args.timeout, metadata=metadata).models)
    except grpc.RpcError as e:
        raise Failure(1, f"{args.server}: cannot list the models: {e.code().name}: {e.details()}") from None


def by_name(models: list[pb.ModelInfo], args: argparse.Namespace) -> pb.ModelInfo:
    """The served model ``--model`` names ("name" or "name/version"; empty: the default)."""
    name, _, wanted_version = args.model.partition("/")
    for m in models:
        if (m.name == name and wanted_version in ("", m.version)) or (not name and m.is_default):
            return m
    served = ", ".join(f"{m.name}/{m.version}" for m in models) or "none"
    raise Failure(1, f"{args.server}: no model {args.model or '(default)'!r} (serves {served})")


def by_language(models: list[pb.ModelInfo], *, source: str, target: str, asked: str) -> pb.ModelInfo | None:
    """The served model (the default first) translating ``source`` into ``target``; None when
    no model names its languages (the caller falls back to the default). ``asked`` says where
    the target came from, for the refusal."""
    directions = [direction(m) for m in models]
    named = [d for d in directions if d[1]]
    if not named:
        return None
    source, target = catalogs.primary(source), catalogs.primary(target)
    ordered = sorted(zip(models, directions), key=lambda md: not md[0].is_default)
    for m, (s, t) in ordered:
        if t == target and s in ("", source):
            return m
    served = ", ".join(dict.fromkeys(f"{s or '?'}-{t}" for s, t in named))
    raise Failure(2, f"{asked}: no served model translates {source} into {target} (serves {served}; "
                     f"--model to choose one)")


def choose(stub: pb_grpc.TranslatorStub, args: argparse.Namespace, metadata: Metadata,
           catalog: polib.POFile, path: str) -> pb.ModelInfo:
    """``--model``'s model; without it, the model of the catalog's (or ``--language``'s) direction."""
    models = list_models(stub, args, metadata)
    header = catalog.metadata.get("Language", "").strip()
    wanted = args.language or header
    if args.model or not wanted:
        return by_name(models, args)
    asked = f"--language {args.language}" if args.language else f"{path}: the catalog's Language is {header!r}"
    found = by_language(models, source=args.source_language, target=wanted, asked=asked)
    return found if found is not None else by_name(models, args)


def target_language(model: pb.ModelInfo, wanted: str, stderr: TextIO) -> str:
    """``--language``, or the model's target; Failure(2) for a language the model does not
    translate into (its ListModels languages are [source, target, ...]): the catalog would say
    one language and hold another. A model that names no languages gets a warning."""
    produced = [language for language in model.languages[1:] if language]  # a manifest without: ""
    if model.target_language and model.target_language not in produced:
        produced.append(model.target_language)
    if not wanted:
        if not produced:
            raise Failure(2, f"model {model.name} names no target language: pass --language")
        return produced[-1]
    if not produced:
        stderr.write(f"nmt translate-po: warning: model {model.name}/{model.version} names no target "
                     f"language: trusting --language {wanted}\n")
    elif catalogs.primary(wanted) not in {catalogs.primary(p) for p in produced}:
        raise Failure(2, f"--language {wanted}: model {model.name}/{model.version} translates into "
                         f"{', '.join(produced)}, not {wanted}")
    return wanted
