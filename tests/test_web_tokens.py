"""The web page with tokens on (``--auth-token-file``, issue 31 row 14): without a token its API
calls get 401 and it asks for one; the token typed in is kept in the tab's sessionStorage only
(never localStorage nor a cookie) and sent as ``Authorization: Bearer <token>``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from harness import ServerThread, config_for
from test_web import WAIT_SECONDS, browser, console_errors, translate  # noqa: F401 (browser: a fixture)

TOKEN = "page-token-0123456789"


@pytest.fixture(scope="module")
def token_server(reversal_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text(f"# the page's token\n{TOKEN}\n")
    with ServerThread(config_for(reversal_repository, "--auth-token-file", str(token_file))) as server:
        yield server


def test_the_page_asks_for_the_token_then_translates_with_it(browser, token_server: ServerThread) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    answer = token_server.http("GET", "/v1/models")
    assert answer.status == 401 and answer.headers["www-authenticate"] == "Bearer"
    browser.get(token_server.http_url + "/")
    WebDriverWait(browser, WAIT_SECONDS).until(lambda d: not d.find_element(By.ID, "error").get_attribute("hidden"))
    assert "needs an access token" in browser.find_element(By.ID, "error").text
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "use-token").click()
    WebDriverWait(browser, WAIT_SECONDS).until(
        lambda d: d.execute_script("return document.querySelectorAll('#model option').length") > 0)
    assert browser.find_element(By.ID, "error").get_attribute("hidden")
    translate(browser, "1 2 3 4", beam=1, nbest=1)
    shown = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#hypotheses li .text")]
    assert shown == ["4 3 2 1"]
    kept = browser.execute_script("return [sessionStorage.getItem('nmt.token'), JSON.stringify(localStorage), "
                                  "localStorage.length, document.cookie]")
    assert kept[0] == TOKEN and TOKEN not in kept[1] and kept[2] == 0 and TOKEN not in kept[3]
    browser.refresh()  # the same tab: the token is still there, the page works at once
    WebDriverWait(browser, WAIT_SECONDS).until(
        lambda d: d.execute_script("return document.querySelectorAll('#model option').length") > 0)
    # the refused calls before the token log "Failed to load resource ... 401": the only errors
    assert all("401" in e for e in console_errors(browser)), console_errors(browser)
