"""The directory a server serves from: one model version, or ``<name>/<version>/`` dirs.

``scan`` lists the version directories and what is wrong with the others (one
line each); ``VersionDir.signature`` changes whenever a file in it does, so a
half-copied version is tried again once its copy goes on, and a broken one is
not reloaded (and logged) at every poll. ``Settling`` says when a directory has stopped
changing: the watcher tries a version only then, so a version copied in file by file (its
manifest first) is not refused for the files it does not have yet. ``Watcher`` runs the
rescans (``--model-control poll``) and never stops; its ``error`` says while they fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from service.errors import ModelRepositoryError
from service.models.manifest import MANIFEST

SETTLE_SECONDS = 1.0  # a version's files unchanged this long (and over two polls) is settled
SETTLE_SCANS = 2
BACKOFF_MAX_SECONDS = 30.0  # the longest wait between two failing rescans (or the poll, if longer)
CHANGING = ("changing",)  # the signature of a directory whose files moved while it was read


@dataclass(frozen=True)
class VersionDir:
    """``<root>/<name>/<version>/``; name and version empty when the root is one version itself."""

    name: str
    version: str
    path: Path

    @property
    def ref(self) -> str:
        return f"{self.name}/{self.version}" if self.name else str(self.path)

    def signature(self) -> tuple:
        """(file, size, mtime) of everything in the directory: changes while it is copied."""
        try:
            return tuple(sorted((str(p.relative_to(self.path)), p.stat().st_size, p.stat().st_mtime_ns)
                                for p in self.path.rglob("*") if p.is_file()))
        except OSError:  # a file vanished while we looked: it is changing
            return CHANGING


def is_version(name: str) -> bool:
    """A version number: ASCII digits only (``"²".isdigit()`` is true, but ``int("²")`` fails)."""
    return name.isascii() and name.isdigit()


def version_key(version: str) -> tuple[int, str]:
    """Orders versions by number (one not a number, the root's own "", before any)."""
    return (int(version), "") if is_version(version) else (-1, version)


def scan(root: Path) -> tuple[list[VersionDir], list[str]]:
    """The version directories under ``root``, and one line for each directory that is not one."""
    if (root / MANIFEST).is_file():
        return [VersionDir("", "", root)], []
    if not root.is_dir():
        raise ModelRepositoryError(f"{root}: model repository directory does not exist")
    found, problems = [], []
    for name_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for version_dir in sorted(p for p in name_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if not is_version(version_dir.name):
                problems.append(f"refused {version_dir}: a version directory's name must be a number, "
                                f"got {version_dir.name[:40]!r} (ASCII digits 0-9)")
            elif (version_dir / MANIFEST).is_file():
                found.append(VersionDir(name_dir.name, version_dir.name, version_dir))
            else:
                problems.append(f"{version_dir}: no {MANIFEST} yet (incomplete)")
    return found, problems


def latest(dirs: list[VersionDir]) -> list[VersionDir]:
    """The highest version of each name."""
    best: dict[str, VersionDir] = {}
    for d in dirs:
        if d.name not in best or int(d.version) > int(best[d.name].version):
            best[d.name] = d
    return [best[n] for n in sorted(best)]


class Settling:
    """Which version directories have stopped changing (pure state, one call per scan).

    Settled: the same signature at ``scans`` consecutive scans, the first of them at least
    ``seconds`` ago; so, whichever is longer, two polls in a row or ``seconds`` (1 s: a copy
    that pauses longer than that between two files and then goes on is tried, fails, and is
    tried again when it changes; ``ServedModels`` does not count a failure whose directory
    changed meanwhile).
    """

    def __init__(self, *, seconds: float = SETTLE_SECONDS, scans: int = SETTLE_SCANS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.scans, self.clock = seconds, scans, clock
        self._seen: dict[str, tuple[tuple, float, int]] = {}  # ref -> (signature, since, scans seen)

    def settled(self, ref: str, signature: tuple) -> bool:
        """Record this scan's ``signature`` of ``ref``; True once it has settled."""
        now = self.clock()
        seen, since, scans = self._seen.get(ref, ((), now, 0))
        if seen != signature or signature == CHANGING:
            since, scans = now, 0
        self._seen[ref] = (signature, since, scans + 1)
        return scans + 1 >= self.scans and now - since >= self.seconds

    def keep(self, refs: set[str]) -> None:
        """Forget the directories not in ``refs`` (gone, or loaded)."""
        for ref in [r for r in self._seen if r not in refs]:
            del self._seen[ref]


class Watcher:
    """Rescans every poll until cancelled, and never stops.

    A rescan that raises (the repository gone, an OSError, a bug) is one log line (again only
    when the error changes) and one ``failed()`` call; the next try waits twice as long as the
    last, up to ``max(poll, BACKOFF_MAX_SECONDS)``. ``error`` names the last failure until a
    rescan succeeds ("" then; ``/readyz`` answers 503 meanwhile).
    """

    def __init__(self) -> None:
        self.error = ""

    async def run(self, rescan: Callable[[], Awaitable[None]], seconds: float, *, failed: Callable[[], None],
                  describe: Callable[[Exception], str], log: logging.Logger) -> None:
        delay = seconds
        while True:
            await asyncio.sleep(delay)
            try:
                await rescan()
            except Exception as e:  # a bug here must not end hot reload for good
                error = describe(e)
                if error != self.error:
                    log.warning("rescan failed: %s", error)
                self.error, delay = error, min(2 * delay, max(seconds, BACKOFF_MAX_SECONDS))
                failed()
                continue
            if self.error:
                log.info("rescans succeed again (the last failure: %s)", self.error)
            self.error, delay = "", seconds
