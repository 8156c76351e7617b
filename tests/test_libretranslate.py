"""LibreTranslate's API on the HTTP port, tried with clients nobody here wrote: ``libretranslatepy``,
and the requests Weblate's LibreTranslate backend sends (``weblate/machinery/libretranslate.py``,
Weblate 5.14: ``GET /languages`` with no key, ``POST /translate`` with a JSON body
``{"api_key", "q": [...], "source", "target"}``), replayed; LibreTranslate's documented examples
(simple, auto, html, alternatives) and every bad input of the issue."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from libretranslatepy import LibreTranslateAPI

from harness import ServerThread, config_for
from service.api.libretranslate import BEAM
from service.options import DecodingOptions

WEBLATE_HEADERS = {"User-Agent": "Weblate/5.14.3", "Referer": "http://weblate.example/",
                   "Accept": "application/json; charset=utf-8"}
TOKEN = "lt-secret-token-1234"


@pytest.fixture(scope="module")
def best(reversal_engine):
    """What the engine answers alone, with LibreTranslate's beam: the reference of every answer."""
    def answer(*texts: str) -> list[str]:
        return [t.hypotheses[0].text for t in reversal_engine.translate(texts, DecodingOptions(beam_size=BEAM))]
    return answer


def _recording(server: ServerThread) -> list[str]:
    """The model each admitted request went to (the front door, wrapped)."""
    routed: list[str] = []
    door = server.app.frontend
    admit = door.admit_request

    def recorded(**kwargs):
        admitted = admit(**kwargs)
        routed.append(admitted.model.manifest.name)
        return admitted
    door.admit_request = recorded
    return routed


@pytest.fixture(scope="module")
def lt(languages_repository: Path):
    with ServerThread(config_for(languages_repository, "--default-model", "en-fr")) as s:
        s.routed = _recording(s)
        yield s


@pytest.fixture(scope="module")
def lt_keys(languages_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    tokens = tmp_path_factory.mktemp("lt_tokens") / "tokens"
    tokens.write_text(f"# one per line\n{TOKEN}\n")
    with ServerThread(config_for(languages_repository, "--default-model", "en-fr",
                                 "--auth-token-file", str(tokens))) as s:
        yield s


def test_libretranslatepy_translate_languages_detect(lt: ServerThread, best) -> None:
    api = LibreTranslateAPI(lt.http_url)
    assert api.translate("1 2 3", "en", "de") == best("1 2 3")[0]
    assert lt.routed[-1] == "en-de"
    assert api.translate("4 5 6 7", "fr", "en") == best("4 5 6 7")[0] and lt.routed[-1] == "fr-en"
    listed = {x["code"]: x for x in api.languages()}
    assert sorted(listed["en"]["targets"]) == ["de", "es", "fr"] and listed["fr"]["targets"] == ["en"]
    assert listed["de"] == {"code": "de", "name": "German", "targets": []}
    english = api.detect("Delete the selected files from the disk")
    assert english[0]["language"] == "en" and english[0]["confidence"] > 90
    assert api.detect("Supprimer les fichiers sélectionnés du disque")[0]["language"] == "fr"


def test_weblate_requests_replayed(lt: ServerThread, best) -> None:
    languages = requests.get(f"{lt.http_url}/languages", headers=WEBLATE_HEADERS, timeout=30)
    assert languages.status_code == 200
    assert {"en", "fr", "de", "es"} <= {x["code"] for x in languages.json()}
    reply = requests.post(f"{lt.http_url}/translate", headers=WEBLATE_HEADERS, timeout=60, json={
        "api_key": "", "q": ["1 2", "3 4 5"], "source": "en", "target": "es"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["translatedText"] == best("1 2", "3 4 5") and lt.routed[-1] == "en-es"
    # Weblate's language codes: "pt_BR" is sent as "pt-BR"; "fr-FR" must reach the French model
    regional = requests.post(f"{lt.http_url}/translate", headers=WEBLATE_HEADERS, timeout=60, json={
        "api_key": "", "q": ["6 7"], "source": "en", "target": "fr-FR"})
    assert regional.json() == {"translatedText": best("6 7")} and lt.routed[-1] == "en-fr"


def test_documented_examples(lt: ServerThread, best) -> None:
    simple = lt.http("POST", "/translate", {"q": "1 2 3", "source": "en", "target": "fr", "format": "text"})
    assert (simple.status, simple.json()) == (200, {"translatedText": best("1 2 3")[0]})
    auto = lt.http("POST", "/translate", {"q": "Ouvrir le fichier sélectionné", "source": "auto", "target": "en"})
    assert auto.status == 200 and auto.json()["detectedLanguage"]["language"] == "fr"
    assert auto.json()["detectedLanguage"]["confidence"] > 50 and lt.routed[-1] == "fr-en"
    fragment = '<p class="intro">1 2 <b>3</b></p><ul><li>4 5 6</li></ul><!-- 9 -->'
    html = lt.http("POST", "/translate", {"q": fragment, "source": "en", "target": "fr", "format": "html"})
    text = html.json()["translatedText"]
    assert html.status == 200 and text.startswith('<p class="intro">') and "<b>" in text and "</b>" in text
    assert text.endswith(f"</p><ul><li>{best('4 5 6')[0]}</li></ul><!-- 9 -->")
    alternatives = lt.http("POST", "/translate", {"q": "1 2 3", "source": "en", "target": "fr",
                                                   "alternatives": 2})
    body = alternatives.json()
    assert body["translatedText"] == best("1 2 3")[0] and len(body["alternatives"]) == 2
    listed = lt.http("POST", "/translate", {"q": ["1 2", "Guten Tag 3"], "source": "auto", "target": "fr",
                                            "alternatives": 1})
    assert len(listed.json()["alternatives"]) == 2 and len(listed.json()["detectedLanguage"]) == 2


def test_form_bodies_and_settings(lt: ServerThread, best) -> None:
    form = requests.post(f"{lt.http_url}/translate", data={"q": "1 2 3", "source": "en", "target": "de"},
                         timeout=60)
    assert form.json() == {"translatedText": best("1 2 3")[0]}
    settings = lt.http("GET", "/frontend/settings").json()
    assert settings["keyRequired"] is False and settings["charLimit"] > 0
    assert settings["language"]["source"]["code"] == "en"


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"q": "1", "source": "xx", "target": "fr"}, 400, ["source must be a pair served", "en-fr", "fr-en"]),
    ({"q": "1", "source": "de", "target": "fr"}, 400, ["source must be a pair served", "'de-fr'", "en-es"]),
    ({"q": "1", "source": "en", "target": "en"}, 400, ["target must differ from source", "'en'"]),
    ({"q": "1", "source": "en", "target": "fr", "format": "pdf"}, 400, ["format must be one of text, html", "pdf"]),
    ({"q": "1", "source": "en", "target": "fr", "alternatives": 99}, 400, ["alternatives", "from 0 to 3", "99"]),
    ({"q": "1 " * 3000, "source": "en", "target": "fr"}, 400, ["q[0] length must be at most", "characters", "6000"]),
    ({"q": ["1"] * 9, "source": "en", "target": "fr"}, 400, ["q must be at most 8 texts", "9"]),
    ({"q": "", "source": "en", "target": "fr"}, 400, ["q must be a non-empty text"]),
    ({"source": "en", "target": "fr"}, 400, ["q must be a non-empty text"]),
    ({"q": "Привет, как дела у тебя сегодня", "source": "auto", "target": "fr"}, 400,
     ["matches none of the served source languages", "en"]),
    ({"q": "1", "target": "fr"}, 400, ["source must be a language code or auto"]),
])
def test_bad_input_is_400_naming_the_field_and_what_is_allowed(lt: ServerThread, body: dict, status: int,
                                                               says: list[str]) -> None:
    reply = lt.http("POST", "/translate", body)
    assert reply.status == status, reply.body
    assert set(reply.json()) == {"error"}
    for part in says:
        assert part in reply.json()["error"]


def test_api_key_is_checked_never_echoed_nor_logged(lt_keys: ServerThread, best,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    body = {"q": "1 2 3", "source": "en", "target": "fr"}
    assert lt_keys.http("POST", "/translate", {**body, "api_key": TOKEN}).json() == {"translatedText": best("1 2 3")[0]}
    assert LibreTranslateAPI(lt_keys.http_url, api_key=TOKEN).translate("3 4 5", "en", "de") == best("3 4 5")[0]
    wrong = lt_keys.http("POST", "/translate", {**body, "api_key": "wrong-key-5678"})
    assert (wrong.status, wrong.json()) == (403, {"error": "Invalid API key"})
    assert lt_keys.http("POST", "/translate", body).status == 403
    assert lt_keys.http("POST", "/detect", {"q": "hello there"}).status == 403
    header = lt_keys.http("POST", "/translate", body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert header.status == 200
    assert lt_keys.http("GET", "/languages").status == 200  # as LibreTranslate: no key for the list
    assert lt_keys.http("GET", "/frontend/settings").json()["keyRequired"] is True
    assert "wrong-key-5678" not in caplog.text and TOKEN not in caplog.text
