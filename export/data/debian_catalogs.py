"""French, German and Spanish catalogs of pinned Debian packages, for the corpus (``make model``).

    python -m export.data.debian_catalogs --output build/debian-packages coreutils=9.1-1 tar=1.34+dfsg-1.2+deb12u1 ...

Downloads each ``package=version`` with ``apt-get download`` (no root needed;
the ``.deb`` files are kept in ``--debs``, ``<output>-debs`` by default, and
not fetched again) and unpacks from it, like ``dpkg -x`` but only what the
corpus reads, into ``<output>/<package>/``: its catalogs of the languages
in ``catalogs.LANGUAGES`` (``*/fr/LC_MESSAGES/*.mo|po``, ``fr_FR`` too, and the same for de, es) and its
``usr/share/doc/*/copyright``. Each package's directory gets a
``debian-package.json`` (package, version, source package, sha256 of the
``.deb``, licence from the copyright file) that the corpus builder reads for
the manifest. A package named in ``export/data/heldout-exclude.txt`` is refused.
Directories of packages no longer asked for are removed, so ``<output>``
holds exactly the pinned set: ``nmt corpus --catalogs <output>`` reads it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from export.data.catalogs import (
    DEBIAN_MARKER,
    HELDOUT,
    LANGUAGE_DIRS,
    LANGUAGES,
    CorpusError,
    debian_license,
)
from service.models.manifest import sha256_file

_SPEC = re.compile(r"^([a-z0-9][a-z0-9+.-]+)=([0-9A-Za-z.+~:-]+)$")
_WANTED = re.compile(rf"(^|/)({'|'.join(LANGUAGE_DIRS)})/LC_MESSAGES/[^/]+\.(mo|po)$")
_COPYRIGHT = re.compile(r"^usr/share/doc/([^/]+)/copyright$")


def parse_specs(specs: list[str]) -> list[tuple[str, str]]:
    """``package=version`` pins; refuses unpinned, repeated and held-out packages."""
    out: dict[str, str] = {}
    for spec in specs:
        m = _SPEC.match(spec)
        if not m:
            raise CorpusError(f"{spec}: not a pinned Debian package (package=version)")
        name, version = m.groups()
        if HELDOUT.has_package(name):
            raise CorpusError(f"{name}: reserved for evaluation (export/data/heldout-exclude.txt)")
        if name in out:
            raise CorpusError(f"{name}: given twice")
        out[name] = version
    return sorted(out.items())


def _fields(deb: Path) -> dict[str, str]:
    text = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Source", "Architecture"],
                          capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    fields.setdefault("Source", fields.get("Package", ""))
    fields["Source"] = fields["Source"].split(" ")[0]  # "gcc-12 (12.2.0-14)" -> "gcc-12"
    return fields


def _deb_name(name: str, version: str) -> str:
    return f"{name}_{version.replace(':', '%3a')}_"  # apt-get download's file name, up to the architecture


def download(pins: list[tuple[str, str]], debs: Path, log=print) -> dict[str, Path]:
    """package -> its .deb in ``debs``, fetching the missing ones in one ``apt-get download``."""
    debs.mkdir(parents=True, exist_ok=True)

    def present() -> dict[str, Path]:
        found = {}
        for name, version in pins:
            hits = sorted(debs.glob(_deb_name(name, version) + "*.deb"))
            if hits:
                found[name] = hits[0]
        return found

    have = present()
    missing = [f"{n}={v}" for n, v in pins if n not in have]
    if missing:
        log(f"debian: downloading {len(missing)} packages into {debs}")
        run = subprocess.run(["apt-get", "download", "-q", *missing], cwd=debs, capture_output=True, text=True,
                             check=False)
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if line.startswith("E:")] or run.stderr.splitlines()
            message = f"apt-get download: {errors[0] if errors else f'exit status {run.returncode}'}"
            if errors and "was not found" in errors[0]:  # stale package lists, or a version the mirror dropped
                message += ("; the pinned version is not in this machine's package lists: run `apt-get update` "
                            "(as root) and retry; if `apt-cache policy <package>` still lacks it, the mirror "
                            "has dropped it and the pin must move")
            raise CorpusError(message)
        have = present()
        lost = [n for n, _ in pins if n not in have]
        if lost:
            raise CorpusError(f"{debs}: apt-get download gave no .deb for {', '.join(lost)}")
    return have


def unpack(deb: Path, target: Path) -> str | None:
    """The catalogs (every language of ``catalogs.LANGUAGES``) and copyright files of ``deb`` into ``target``;
    returns the package whose doc directory ``usr/share/doc/<package>`` links to, if it is a link."""
    doc_link = None
    with (subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as proc,
          tarfile.open(fileobj=proc.stdout, mode="r|") as tar):
        for member in tar:
            name = member.name.removeprefix("./")
            if member.issym() and re.fullmatch(r"usr/share/doc/[^/]+", name):
                doc_link = Path(member.linkname).name
                continue
            if not member.isfile() or not (_WANTED.search(name) or _COPYRIGHT.match(name)):
                continue
            member.name = name
            tar.extract(member, target, filter="data")
    if proc.returncode != 0:
        raise CorpusError(f"{deb}: dpkg-deb --fsys-tarfile failed (exit status {proc.returncode})")
    return doc_link


def fetch(specs: list[str], output: Path, debs: Path | None = None, log=print) -> list[dict]:
    """Download and unpack the pinned packages; returns their ``debian-package.json`` records."""
    pins = parse_specs(specs)
    debs = debs or output.with_name(output.name + "-debs")
    files = download(pins, debs, log=log)
    output.mkdir(parents=True, exist_ok=True)
    wanted = {n for n, _ in pins}
    for old in sorted(output.iterdir()):
        if old.is_dir() and old.name not in wanted and (old / DEBIAN_MARKER).is_file():
            shutil.rmtree(old)  # a package no longer pinned
    records, links = [], {}
    for name, version in pins:
        fields = _fields(files[name])
        if fields.get("Package") != name or fields.get("Version") != version:
            raise CorpusError(f"{files[name]}: is {fields.get('Package')}={fields.get('Version')}, "
                              f"expected {name}={version}")
        target = output / name
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        links[name] = unpack(files[name], target)
        records.append({"package": name, "version": version, "source": fields["Source"],
                        "architecture": fields.get("Architecture", ""), "deb": files[name].name,
                        "sha256": sha256_file(files[name])})
    for r in records:
        own = output / r["package"] / "usr/share/doc" / r["package"] / "copyright"
        if not own.is_file() and links[r["package"]]:  # doc directory is a link to another package's
            own = output / links[r["package"]] / "usr/share/doc" / links[r["package"]] / "copyright"
        if not own.is_file():  # any package of the same source package
            own = next((output / o["package"] / "usr/share/doc" / o["package"] / "copyright"
                        for o in records if o["source"] == r["source"] and
                        (output / o["package"] / "usr/share/doc" / o["package"] / "copyright").is_file()),
                       own)
        r["license"] = debian_license(own) if own.is_file() else "unknown"
        r["license_file"] = str(own.relative_to(output)) if own.is_file() else ""
        (output / r["package"] / DEBIAN_MARKER).write_text(json.dumps(r, indent=1) + "\n", encoding="utf-8")
    catalogs = sum(1 for r in records for _ in (output / r["package"]).rglob("LC_MESSAGES/*.[mp]o"))
    unknown = [r["package"] for r in records if r["license"] == "unknown"]
    log(f"debian: {len(records)} packages, {catalogs} catalogs ({', '.join(LANGUAGES)}) -> {output}"
        + (f" (licence unknown: {', '.join(unknown)})" if unknown else ""))
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.data.debian_catalogs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", "-o", type=Path, required=True, help="directory of unpacked packages")
    p.add_argument("--debs", type=Path, default=None, help="where the .deb files are kept (default: <output>-debs)")
    p.add_argument("packages", nargs="+", metavar="PACKAGE=VERSION")
    args = p.parse_args(argv)
    try:
        fetch(args.packages, args.output, args.debs)
    except CorpusError as e:
        print(f"debian catalogs: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"debian catalogs: {' '.join(map(str, e.cmd))}: exit status {e.returncode}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
