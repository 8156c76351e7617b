"""The documentation shows what the shipped model answers today.

Every ```` ```console ```` block of ``README.md`` and ``docs/*.md`` is a session: a line
starting with ``$ `` is a command (a trailing ``\\`` continues it on the next line), and the
lines after it, up to the next command, are what it printed. Two commands are understood:
``nmt translate ...`` (its ``main`` against an in-process server of ``models/``, every shipped
direction, en-fr the default, over gRPC)
and ``curl ... localhost:8080/...`` (the same server's HTTP port). Numbers compare to the
precision shown; a JSON object shown may leave fields out, never add or change one.

Also: the README's flags table names every ``nmt serve`` flag, the README stays a front page
(at most 300 lines), and the files the pages point to exist.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from harness import ServerThread, config_for, http_request, served_version

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = served_version()
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "models" / "en-fr" / "README.md"]
NUMBER = re.compile(r"-?\d+\.\d+")


def sessions(page: Path) -> list[tuple[str, list[str]]]:
    """(command, printed lines) of every console block of ``page``."""
    found: list[list] = []
    in_block = continued = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_block, continued = line.strip() == "```console", False
        elif in_block and (line.startswith("$ ") or continued):
            text = line[2:] if line.startswith("$ ") and not continued else line.strip()
            if continued:
                found[-1][0] = found[-1][0][:-1].rstrip() + " " + text
            else:
                found.append([text, []])
            continued = line.endswith("\\")
        elif in_block:
            found[-1][1].append(line)
    return [(command, printed) for command, printed in found]


EXAMPLES = [(page, command, printed) for page in PAGES for command, printed in sessions(page)]


@pytest.fixture(scope="module")
def shipped_server():
    with ServerThread(config_for(ROOT / "models", "--max-beam", "16", "--default-model", "en-fr")) as server:
        yield server


def run_translate(words: list[str], server, capsys) -> list[str]:
    from service.clients import translate

    capsys.readouterr()
    assert translate.main([*words, "--server", server.address]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines()


def run_curl(words: list[str], server) -> list[str]:
    headers: dict[str, str] = {}
    body, url = None, None
    args = iter(words)
    for word in args:
        if word in ("-s", "-sS", "-sN"):
            continue
        if word == "-H":
            name, value = next(args).split(":", 1)
            headers[name.strip()] = value.strip()
        elif word == "-d":
            body = next(args).encode()
        elif word.startswith("-"):
            raise AssertionError(f"curl {word}: not an option tests/test_readme.py understands")
        else:
            url = word
    assert url and url.startswith("localhost:8080/"), f"curl to {url}: the examples talk to localhost:8080"
    path = url[len("localhost:8080"):]
    answer = http_request(server.http_port, "POST" if body is not None else "GET", path, body, headers)
    return answer.body.decode().splitlines()


def same_number(shown: str, actual: str) -> bool:
    """``actual`` rounds to ``shown`` (one unit of its last digit of slack)."""
    decimals = len(shown.split(".")[1])
    return abs(float(shown) - float(actual)) <= 1.01 * 10 ** -decimals


def same_line(shown: str, actual: str) -> bool:
    shown_parts, actual_parts = NUMBER.split(shown), NUMBER.split(actual)
    shown_numbers, actual_numbers = NUMBER.findall(shown), NUMBER.findall(actual)
    return (shown_parts == actual_parts and len(shown_numbers) == len(actual_numbers)
            and all(same_number(s, a) for s, a in zip(shown_numbers, actual_numbers)))


def same_json(shown, actual, where: str = "") -> None:
    """``shown`` is ``actual`` with fields possibly left out; floats to 1e-5 relative."""
    if isinstance(shown, dict):
        assert isinstance(actual, dict), f"{where}: shown an object, got {actual!r}"
        for key, value in shown.items():
            assert key in actual, f"{where}.{key}: shown, not in the answer"
            same_json(value, actual[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(actual, list) and len(actual) == len(shown), f"{where}: shown {shown!r}, got {actual!r}"
        for i, (s, a) in enumerate(zip(shown, actual)):
            same_json(s, a, f"{where}[{i}]")
    elif isinstance(shown, float):
        assert actual == pytest.approx(shown, rel=1e-5), f"{where}: shown {shown}, got {actual}"
    else:
        assert shown == actual, f"{where}: shown {shown!r}, got {actual!r}"


@pytest.mark.parametrize(("page", "command", "printed"), EXAMPLES,
                         ids=[f"{p.relative_to(ROOT)}:{c[:60]}" for p, c, _ in EXAMPLES])
def test_example_prints_what_the_shipped_model_answers(page: Path, command: str, printed: list[str],
                                                       shipped_server, capsys) -> None:
    words = shlex.split(command)
    if words[:2] == ["nmt", "translate"]:
        actual = run_translate(words[2:], shipped_server, capsys)
        assert len(actual) == len(printed) and all(map(same_line, printed, actual)), (
            f"{page.name}: `{command}` printed:\n" + "\n".join(actual))
    elif words[0] == "curl":
        actual = run_curl(words[1:], shipped_server)
        same_json(json.loads("\n".join(printed)), json.loads("\n".join(actual)), f"{page.name}: `{command}`")
    else:
        pytest.fail(f"{page.name}: `{command}`: only nmt translate and curl examples can be checked")


def test_the_pages_have_examples() -> None:
    assert len(sessions(README)) >= 4
    assert any("curl" in command for _, command, _ in EXAMPLES)


def test_the_flags_table_names_every_serve_flag() -> None:
    from service.config import FLAGS

    table = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("| `--")]
    listed = {flag for line in table for flag in re.findall(r"`(--[a-z0-9-]+)`", line.split("|")[1])}
    assert {flag for flag, *_ in FLAGS} - listed == set()
    assert listed - {flag for flag, *_ in FLAGS} == set()


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_files_a_page_names_exist(page: Path) -> None:
    """Links and backquoted paths into the tree (``docs/``, ``models/``, ``loadtest/``, ...):
    a file that left the tree is not named as if it were there."""
    text = page.read_text(encoding="utf-8")
    named = set(re.findall(r"\]\(([^)#:\s]+)\)", text))
    named |= {m for m in re.findall(r"`((?:docs|models|loadtest|deploy|tests|service|export|proto)/[^`\s*<>]+)`", text)}
    missing = sorted(n for n in named if not (page.parent / n).exists() and not (ROOT / n).exists()
                     and not n.startswith(("models/en-fr/1", "models/en-fr/2", "models/en-fr/3", "models/en-fr/checkpoint-")))
    assert missing == []
