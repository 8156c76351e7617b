"""Protobuf <-> dataclasses, for the transports that speak the proto's messages (gRPC, and
HTTP in their JSON mapping); the front door (``frontend``) and everything below it see only
dataclasses."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from service.app import Model
from service.interface import Hypothesis, Partial, Prepared, Translation
from service.models.manifest import Manifest
from service.options import DecodingOptions
from service.proto.nmt.v1 import translation_pb2 as pb

OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(DecodingOptions))
DEFAULT_OPTIONS = DecodingOptions()  # frozen: shared by every request that sets none


def options(message: pb.DecodingOptions) -> DecodingOptions:
    """Set fields override the defaults; unset ones (``optional``) keep them."""
    given = {field.name: value for field, value in message.ListFields() if field.name in OPTION_FIELDS}
    return dataclasses.replace(DEFAULT_OPTIONS, **given) if given else DEFAULT_OPTIONS


def hypothesis(h: Hypothesis) -> pb.Hypothesis:
    return pb.Hypothesis(text=h.text, score=h.score, tokens=h.tokens, alignments=[
        pb.Alignment(target_index=a.target_index, source_index=a.source_index,
                     source_token=a.source_token, weights=a.weights) for a in h.alignments])


def response(translations: Sequence[Translation], manifest: Manifest) -> pb.TranslateResponse:
    """The final answer, in request order, naming the model version that made it."""
    return pb.TranslateResponse(kind=pb.RESULT_KIND_FINAL, model=manifest.name,
                                model_version=manifest.version, translations=[
        pb.Translation(hypotheses=[hypothesis(h) for h in t.hypotheses],
                       source_tokens=t.source_tokens) for t in translations])


def partial(event: Partial, prepared: Sequence[Prepared], manifest: Manifest) -> pb.TranslateResponse:
    """A streaming update: per text one hypothesis holding the text decided so far."""
    return pb.TranslateResponse(kind=pb.RESULT_KIND_PARTIAL, model=manifest.name,
                                model_version=manifest.version, translations=[
        pb.Translation(hypotheses=[pb.Hypothesis(text=text)], source_tokens=p.source_pieces[:-1])
        for text, p in zip(event.texts, prepared)])


def model_list(models: Sequence[Model], *, provider: str) -> pb.ListModelsResponse:
    """``ListModels``' answer: the served versions, the first one the default."""
    return pb.ListModelsResponse(models=[
        model_info(m.manifest, precision=m.engine.precision, provider=provider, is_default=i == 0,
                   int8_form=getattr(m.engine, "int8_form", ""), shortlist=getattr(m.engine, "shortlist", False))
        for i, m in enumerate(models)])


def model_info(manifest: Manifest, *, precision: str, provider: str, is_default: bool,
               int8_form: str = "", shortlist: bool = False) -> pb.ModelInfo:
    languages = manifest.raw.get("languages") or {}
    if isinstance(languages, dict):
        languages = [languages.get("source", ""), languages.get("target", "")]
    source, target = manifest.languages
    return pb.ModelInfo(source_language=source, target_language=target, name=manifest.name, version=manifest.version, sha256=manifest.sha256,
                        precision=precision, provider=provider, languages=[str(x) for x in languages],
                        quality=flatten_numbers(manifest.raw.get("quality") or {}),
                        is_default=is_default, attention=manifest.attention, int8_form=int8_form,
                        shortlist=shortlist)


def flatten_numbers(tree: Any, prefix: str = "") -> dict[str, float]:
    """{"fp32": {"bleu": 30.1}} -> {"fp32.bleu": 30.1}; non-numbers dropped."""
    out: dict[str, float] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten_numbers(value, f"{prefix}{key}."))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool) and math.isfinite(tree):
        out[prefix.rstrip(".")] = float(tree)
    return out
