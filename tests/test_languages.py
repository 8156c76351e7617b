"""Several directions from one repository: ListModels names each model's languages, and a request
may name languages instead of a model (``TranslateRequest.source_language``/``target_language``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from harness import ServerThread, config_for
from service import languages
from service.proto.nmt.v1 import translation_pb2 as pb


@pytest.fixture(scope="module")
def served(languages_repository: Path):
    with ServerThread(config_for(languages_repository, "--default-model", "en-fr")) as s:
        yield s


def test_normalize_and_pairs() -> None:
    assert [languages.normalize(c) for c in ("fr", "FR", "fr-FR", "fr_FR", " de ")] == ["fr"] * 4 + ["de"]
    assert languages.pair({"languages": {"source": "en", "target": "fr-CA"}}) == ("en", "fr")
    assert languages.pair({"languages": ["fr", "en"]}) == ("fr", "en")
    assert languages.pair({}) == ("", "")
    assert languages.served_pairs([("en", "fr"), ("en", "fr"), ("fr", "en"), ("", "")]) == ["en-fr", "fr-en"]


def test_list_models_reports_each_direction(served: ServerThread) -> None:
    listing = served.api.ListModels(pb.ListModelsRequest(), timeout=30)
    pairs = {m.name: (m.source_language, m.target_language) for m in listing.models}
    assert pairs == {"en-fr": ("en", "fr"), "en-de": ("en", "de"), "en-es": ("en", "es"), "fr-en": ("fr", "en")}
    assert listing.models[0].name == "en-fr" and listing.models[0].is_default
    http = served.http("GET", "/v1/models").json()
    assert {m["name"]: m["target_language"] for m in http["models"]}["en-de"] == "de"


@pytest.mark.parametrize(("source", "target", "model"), [
    ("en", "de", "en-de"), ("en", "es", "en-es"), ("fr-FR", "en", "fr-en"), ("", "es", "en-es"),
    ("fr", "", "fr-en"), ("en", "", "en-fr"), ("", "", "en-fr")])
def test_a_request_is_routed_by_its_languages(served: ServerThread, source: str, target: str,
                                              model: str) -> None:
    reply = served.api.Translate(pb.TranslateRequest(texts=["1 2 3"], source_language=source,
                                                     target_language=target), timeout=60)
    assert reply.model == model
    assert reply.translations[0].hypotheses[0].text == "3 2 1"
    http = served.http("POST", "/v1/translate", {"texts": ["4 5"], "source_language": source,
                                                 "target_language": target})
    assert http.status == 200 and http.json()["model"] == model


@pytest.mark.parametrize(("fields", "named"), [
    ({"source_language": "de", "target_language": "fr"}, "source_language"),
    ({"source_language": "en", "target_language": "it"}, "target_language"),
    ({"source_language": "en", "target_language": "en"}, "target_language"),
    ({"model": "en-de", "target_language": "fr"}, "target_language")])
def test_an_unserved_pair_is_refused_naming_the_served_pairs(served: ServerThread, fields: dict,
                                                             named: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        served.api.Translate(pb.TranslateRequest(texts=["1"], **fields), timeout=30)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    message = refused.value.details()
    assert message.startswith(f"{named} must be a pair served")
    assert ("en-de" in message) and ("fr-en" in message or "model 'en-de'" in message)
    http = served.http("POST", "/v1/translate", {"texts": ["1"], **fields})
    assert http.status == 400 and http.json()["message"] == message
