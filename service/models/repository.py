"""The directory a server serves from: one model version, or ``<name>/<version>/`` dirs.

``scan`` lists the version directories and what is wrong with the others (one
line each); ``VersionDir.signature`` changes whenever a file in it does, so a
half-copied version is tried again once its copy goes on, and a broken one is
not reloaded (and logged) at every poll.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.errors import ModelRepositoryError
from service.models.manifest import MANIFEST


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
            return ("changing",)


def is_version(name: str) -> bool:
    """A version number: ASCII digits only (``"²".isdigit()`` is true, but ``int("²")`` fails)."""
    return name.isascii() and name.isdigit()


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
