"""The web page (``service/api/web/``) in a real headless Chromium, driven by Selenium.

Load the page, type a text, translate: the translation, its hypotheses and scores, the
partial results while it decodes, and the attention heatmap appear; placeholders show as
the user wrote them. Any JavaScript console error fails the test. Skips (with the reason)
when Chromium, its driver or Selenium is missing (``.ci/run`` installs them:
``apt-get install chromium chromium-driver``). ``NMT_WEB_SCREENSHOT=path`` keeps a screenshot.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from conftest import TINY_SENTENCES
from harness import ServerThread
from service.text import placeholders

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1100,900"]
WAIT_SECONDS = 60
# every change of the partial text, recorded as it happens (MutationObserver records each one)
RECORD_PARTIALS = """
window.partials = [];
new MutationObserver((records) => records.forEach((r) => r.addedNodes.forEach(
    (n) => window.partials.push(n.textContent)))).observe(document.getElementById("partial"),
    {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    os.environ.setdefault("SE_AVOID_STATS", "true")  # Selenium Manager stays quiet and offline
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_SECONDS)
    try:
        yield driver
    finally:
        driver.quit()


def shown_piece(piece: str) -> str:
    """A piece as the page labels it (no placeholders here): the word mark dropped."""
    return piece.replace("\u2581", " ").strip() or "\u2581"


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, server: ServerThread) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(server.http_url + "/")
    WebDriverWait(driver, WAIT_SECONDS).until(
        lambda d: d.execute_script("return document.querySelectorAll('#model option').length") > 0)


def translate(driver, text: str, *, beam: int, nbest: int) -> None:
    """Type ``text`` and the options, press Translate, wait for the heatmap of the answer."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for element_id, value in (("text", text), ("beam", str(beam)), ("nbest", str(nbest))):
        element = driver.find_element(By.ID, element_id)
        element.clear()
        element.send_keys(value)
    driver.execute_script(RECORD_PARTIALS)
    driver.find_element(By.ID, "translate").click()
    WebDriverWait(driver, WAIT_SECONDS).until(
        lambda d: d.execute_script("return !document.getElementById('translate').disabled "
                                   "&& document.getElementById('status').textContent.startsWith('translated') "
                                   "|| !document.getElementById('error').hidden"))
    assert driver.find_element(By.ID, "error").get_attribute("hidden"), driver.find_element(By.ID, "error").text


def test_page_translates_and_draws_the_attention(browser, server: ServerThread) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    text = "1 2 3 4 5 6 7 8 9"
    translate(browser, text, beam=2, nbest=2)
    answer = server.http("POST", "/v1/translate", {"texts": [text], "options": {
        "beam_size": 2, "num_hypotheses": 2, "return_attention": True}}).json()["translations"][0]
    items = browser.find_elements(By.CSS_SELECTOR, "#hypotheses li")
    shown = [li.find_element(By.CSS_SELECTOR, ".text").text for li in items]
    assert shown == [h["text"] for h in answer["hypotheses"]] and shown[0] == "9 8 7 6 5 4 3 2 1"
    scores = [li.find_element(By.CSS_SELECTOR, ".score").text for li in items]
    assert scores == [f"score {h['score']:.3f}" for h in answer["hypotheses"]]
    best = answer["hypotheses"][0]
    cells = browser.find_elements(By.CSS_SELECTOR, "#heatmap svg rect.cell")
    assert len(cells) == len(best["alignments"]) * len(best["alignments"][0]["weights"])
    sources = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#heatmap svg text.source")]
    assert sources == [shown_piece(p) for p in answer["source_tokens"]] + ["</s>"]
    assert "".join(sources[:-1]).replace("\u2581", "") == text.replace(" ", "")
    targets = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#heatmap svg text.target")]
    assert targets == [shown_piece(p) for p in best["tokens"]]
    partials = [p for p in browser.execute_script("return window.partials") if p]
    assert partials and all(best["text"].startswith(p) for p in partials), partials
    items[1].click()  # the second hypothesis' heatmap
    assert "(hypothesis 2)" in browser.find_element(By.ID, "heatmap-of").text
    if os.environ.get("NMT_WEB_SCREENSHOT"):
        browser.save_screenshot(os.environ["NMT_WEB_SCREENSHOT"])
    assert not console_errors(browser)


def test_placeholders_show_as_written(browser, tiny_server: ServerThread) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, tiny_server)
    translate(browser, "Delete %s files in {0}?", beam=1, nbest=1)
    sources = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#heatmap svg text.source")]
    assert "%s" in sources and "{0}" in sources and not any("\uff5f" in s for s in sources), sources
    assert not console_errors(browser)


def test_page_finds_placeholders_as_the_server_does(browser, tiny_server: ServerThread) -> None:
    open_page(browser, tiny_server)
    texts = [src for src, _ in TINY_SENTENCES] + [
        "100%% done", "{{literal}} {name!r:>10} {x.attr}", '<a href="x">link</a><br/>', "${HOME} and $PATH",
        "%(count)d of %(total)5.2f", "%1$s %*d %.3f %lld %hhx", "no placeholders here", "é%sé {ü}"]
    found = browser.execute_script("return arguments[0].map(window.nmt.findPlaceholders)", texts)
    assert found == [placeholders.find(t)[:placeholders.MAX_PLACEHOLDERS] for t in texts]
    assert not console_errors(browser)


def test_page_shows_the_error_of_a_refused_request(browser, tiny_server: ServerThread) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, tiny_server)
    element = browser.find_element(By.ID, "text")
    element.clear()
    element.send_keys("   ")
    browser.find_element(By.ID, "translate").click()
    WebDriverWait(browser, WAIT_SECONDS).until(lambda d: not d.find_element(By.ID, "error").get_attribute("hidden"))
    assert "INVALID_ARGUMENT: texts[0] must be a non-empty" in browser.find_element(By.ID, "error").text
    # a refused fetch logs "Failed to load resource ... 400" in Chromium's console: the only error
    assert all("400" in e for e in console_errors(browser)), console_errors(browser)


def test_static_files_come_from_the_package() -> None:
    from service.api.http_server import WEB

    assert {p.name for p in Path(WEB).iterdir()} >= {"index.html", "app.js", "style.css"}
