"""The web page's language selectors against a server of four directions (``languages_repository``:
en-fr, en-de, en-es, fr-en): they list the served directions, swap where the reverse pair is served,
and a translation picked with them names the languages (no model) and is routed to that direction's
model. Headless Chromium as in ``tests/test_web.py`` (skips without it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import ServerThread, config_for
from service import languages
from test_web import browser, console_errors, open_page, translate  # noqa: F401  (browser: a fixture)

# every body the page POSTs, recorded before it is sent
RECORD_REQUESTS = """
window.requests = [];
const fetched = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.requests.push(JSON.parse(init.body));
  return fetched(url, init);
};
"""


@pytest.fixture(scope="module")
def served(languages_repository: Path):
    with ServerThread(config_for(languages_repository, "--default-model", "en-fr")) as s:
        yield s


def options(driver, select_id: str) -> list[tuple[str, str]]:
    """(value, shown text) of each option of a select."""
    return driver.execute_script(
        "return [...document.getElementById(arguments[0]).options].map((o) => [o.value, o.textContent])", select_id)


def chosen(driver) -> tuple[str, str, str]:
    return tuple(driver.execute_script(
        "return ['source', 'target', 'model'].map((id) => document.getElementById(id).value)"))


def pick(driver, select_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select

    Select(driver.find_element(By.ID, select_id)).select_by_value(value)


def status(driver) -> str:
    return driver.execute_script("return document.getElementById('status').textContent")


def test_the_selectors_list_the_served_directions(browser, served: ServerThread) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    open_page(browser, served)
    assert browser.find_element(By.ID, "languages").is_displayed()
    assert options(browser, "source") == [["en", "English (en)"], ["fr", "French (fr)"]]
    assert options(browser, "target") == [["fr", "French (fr)"], ["de", "German (de)"], ["es", "Spanish (es)"]]
    assert chosen(browser) == ("en", "fr", "")  # the default model's direction, the model left to the server
    assert options(browser, "model")[0] == ["", "by the languages"]
    swap = browser.find_element(By.ID, "swap")
    assert swap.is_enabled()  # fr-en is served
    pick(browser, "target", "de")
    assert chosen(browser) == ("en", "de", "") and not swap.is_enabled()  # de-en is not
    pick(browser, "source", "fr")
    assert options(browser, "target") == [["en", "English (en)"]] and chosen(browser) == ("fr", "en", "")
    pick(browser, "model", "en-es/1")  # a model by name: the selectors show its direction
    assert chosen(browser) == ("en", "es", "en-es/1")
    assert not console_errors(browser)


def test_a_translation_picked_with_the_selectors_goes_to_that_model(browser,  # noqa: F811
                                                                    served: ServerThread) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served)
    browser.execute_script(RECORD_REQUESTS)
    pick(browser, "target", "de")
    translate(browser, "1 2 3", beam=1, nbest=1)
    assert status(browser).startswith("translated by en-de version 1 in ")
    assert browser.find_element(By.CSS_SELECTOR, "#hypotheses li .text").text == "3 2 1"
    pick(browser, "target", "fr")
    browser.find_element(By.ID, "swap").click()
    assert chosen(browser) == ("fr", "en", "")
    translate(browser, "4 5", beam=1, nbest=1)
    assert status(browser).startswith("translated by fr-en version 1 in ")
    pick(browser, "model", "en-es/1")  # picking by name still works
    translate(browser, "6 7", beam=1, nbest=1)
    assert status(browser).startswith("translated by en-es version 1 in ")
    sent = [{k: r.get(k) for k in ("model", "source_language", "target_language")}
            for r in browser.execute_script("return window.requests")]
    assert sent == [{"model": "", "source_language": "en", "target_language": "de"},
                    {"model": "", "source_language": "fr", "target_language": "en"},
                    {"model": "en-es/1", "source_language": None, "target_language": None}]
    assert not console_errors(browser)


def test_models_that_name_no_languages_are_picked_by_name(browser, reversal_repository: Path,  # noqa: F811
                                                          tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    version = shutil.copytree(reversal_repository, tmp_path / "unnamed" / "1")
    manifest = json.loads((version / "manifest.json").read_text())
    del manifest["languages"]
    manifest["name"] = "unnamed"
    (version / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with ServerThread(config_for(tmp_path)) as server:
        open_page(browser, server)
        assert not browser.find_element(By.ID, "languages").is_displayed()
        assert [value for value, _ in options(browser, "model")] == ["unnamed/1"]
        browser.execute_script(RECORD_REQUESTS)
        translate(browser, "1 2 3", beam=1, nbest=1)
        assert status(browser).startswith("translated by unnamed version 1 in ")
        assert "source_language" not in browser.execute_script("return window.requests")[0]


def test_language_names_mirror_the_server(browser, tiny_server: ServerThread) -> None:  # noqa: F811
    open_page(browser, tiny_server)
    assert browser.execute_script("return window.nmt.NAMES") == languages.NAMES
