"""``nmt translate-po`` beyond the happy path: the pure catalog parts (format flags, lines,
encodings), bad input refused in one line naming the file or entry with nothing written, and
TLS with a client certificate and a bearer token against a stand-in server.

The workflow with the tiny model's server is ``tests/test_po.py``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import polib
import pytest

from harness import ROOT, ServerThread, config_for, free_port
from po_helpers import FIXTURE, by_key, ours, stand_in, translate_po
from service.clients import po_catalog as catalogs
from service.proto.nmt.v1 import translation_pb2 as pb
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc


# ---- pure parts --------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, source, translation, broken", [
    ("c-format", "Copy %s to %d", "Copier %s vers %d", False),
    ("c-format", "Copy %s to %d", "Vers %d copier %s", True),  # plain directives keep their order
    ("c-format", "Copy %1$s to %2$d", "Vers %2$d copier %1$s", False),  # positional may move
    ("c-format", "size %-7ld bytes", "taille %-7ld octets", False),
    ("c-format", "size %-7ld bytes", "taille %ld octets", True),  # a changed directive
    ("c-format", "100%% done: %s", "%s : fait à 100%%", False),  # %% is no directive
    ("c-format", "Open %s", "Ouvrir", True),
    ("python-format", "%(count)d of %(total)d", "%(total)d : %(count)d", False),  # named may move
    ("python-format", "%s of %d", "%d de %s", True),
    ("python-format", "%(name)s", "%(name)s %(name)s", True),  # an invented repeat
    ("python-brace-format", "{0} of {1}", "{1} : {0}", False),
    ("python-brace-format", "{name} was saved", "{name} enregistré", False),
    ("python-brace-format", "{} and {}", "{} et {}", False),
    ("python-brace-format", "{} and {:>3}", "{:>3} et {}", True),  # auto-numbered keep their order
    ("python-brace-format", "{{literal}} {x}", "{x} {{littéral}}", False),
    (None, "Copy %s to %d", "Vers %d copier", False),  # no flag, nothing to break
])
def test_format_flags(flag: str | None, source: str, translation: str, broken: bool) -> None:
    problem = catalogs.format_problem([flag] if flag else [], source, translation)
    assert (problem is not None) == broken, problem
    if problem:
        assert problem[0] == f"would break {flag}"


def test_lines_keep_breaks_and_whitespace() -> None:
    text = "  Usage: app [OPTIONS]\n\n\tPrint the version.  \n"
    cores = [core for _, core, _ in catalogs.lines(text)]
    assert cores == ["Usage: app [OPTIONS]", "", "Print the version.", ""]
    upper = {core: core.upper() for _, core, _ in catalogs.lines(text) if core}
    assert catalogs.rejoin(text, upper) == "  USAGE: APP [OPTIONS]\n\n\tPRINT THE VERSION.  \n"


def test_fill_leaves_out_what_the_catalog_encoding_cannot_hold() -> None:
    entry = polib.POEntry(msgid="Open the file", msgstr="")
    how = catalogs.Filling(nplurals=2, comment="machine", fuzzy=True, encoding="ascii")
    problem = catalogs.fill(entry, {"Open the file": "Ouvrir le fichier… œuvre"}, how)
    assert problem == "not representable in ascii" and entry.msgstr == ""
    assert ours(entry) == "left as it is: the machine translation is not representable in ascii"


# ---- bad input: one line naming the file or entry, nothing written -----------------------------

@pytest.mark.parametrize("content, problem", [
    (b'{"msgid": "not a catalog"}\n', "not a gettext catalog"),
    (b"\xde\x12\x04\x95" + bytes(24), "a compiled .mo catalog"),
    (b'msgid ""\nmsgstr "Content-Type: text/plain; charset=UTF-8\\n"\n\nmsgid "caf\xe9"\nmsgstr ""\n',
     ":4: not UTF-8 as its header says (byte 0xe9)"),
    ('msgid ""\nmsgstr "Content-Type: text/plain; charset=ISO-8859-1\\n"\n\n'
     'msgid "café"\nmsgstr ""\n'.encode(),
     ": UTF-8, not ISO-8859-1 as its header says"),
])
def test_a_file_that_is_not_a_catalog(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      content: bytes, problem: str) -> None:
    bad, out = tmp_path / "bad.po", tmp_path / "out.po"
    bad.write_bytes(content)
    code, _, err = translate_po(capsys, bad, "-o", out, "--server", f"127.0.0.1:{free_port()}")
    assert code == 2
    assert err.startswith(f"nmt translate-po: {bad}") and problem in err and err.count("\n") == 1
    assert not out.exists()


def test_missing_server(tmp_path: Path) -> None:
    """Through the ``nmt`` command (the subcommand is registered): the server is named, exit 1."""
    out, server = tmp_path / "out.po", f"127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "service.cli", "translate-po", str(FIXTURE), "-o", str(out),
                           "--server", server, "--timeout", "5"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith(f"nmt translate-po: {server}: cannot list the models: UNAVAILABLE")
    assert done.stderr.count("\n") == 1 and not out.exists()


def test_a_server_error_names_the_entry_and_writes_nothing(tiny_repository: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    catalog, out = tmp_path / "app.po", tmp_path / "out.po"
    long = "Open the file and save it " * 6  # 156 characters: over this server's 100
    catalog.write_text(f'msgid "Open the file"\nmsgstr ""\n\nmsgid "Save the file"\nmsgstr ""\n\n'
                       f'#: app.py:3\nmsgid "{long}"\nmsgstr ""\n')
    out.write_text("the previous catalog\n")
    with ServerThread(config_for(tiny_repository, "--max-text-chars", "100")) as server:
        code, _, err = translate_po(capsys, catalog, "-o", out, "--server", server.address)
    assert code == 1
    assert err.startswith(f"nmt translate-po: {catalog}:7: msgid 'Open the file and save it ")
    assert "the server answered INVALID_ARGUMENT: texts[2] length must be at most 100 characters" in err
    assert err.count("\n") == 1
    assert out.read_text() == "the previous catalog\n"


# ---- arguments, the output as a link, another target language -------------------------------

@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf", "-inf", "soon"])
def test_a_timeout_that_is_no_positive_number_is_an_argument_error(tmp_path: Path, timeout: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's exit, before any connection
        translate_po(capsys, FIXTURE, "-o", tmp_path / "out.po", "--server", f"127.0.0.1:{free_port()}",
                     f"--timeout={timeout}")
    assert exited.value.code == 2
    assert "argument --timeout: must be a" in capsys.readouterr().err
    assert not (tmp_path / "out.po").exists()


def test_an_output_that_is_a_link_stays_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Written at the link's target (a chain of relative links), atomically: the link is kept."""
    (tmp_path / "catalogs").mkdir()
    target = tmp_path / "catalogs" / "fr.po"
    target.write_text("the previous catalog\n")
    target.chmod(0o640)
    (tmp_path / "middle.po").symlink_to("catalogs/fr.po")
    link = tmp_path / "link.po"
    link.symlink_to("middle.po")
    with stand_in() as server:
        code, stdout, err = translate_po(capsys, FIXTURE, "-o", link, "--server", server)
        assert code == 0, err
        assert stdout.startswith(f"{link}: ")
        assert link.is_symlink() and (tmp_path / "middle.po").is_symlink()
        assert by_key(polib.pofile(str(target)))[(None, "Open the file", False)].msgstr == "[Open the file]"
        assert target.stat().st_mode & 0o777 == 0o640
        assert sorted(p.name for p in (tmp_path / "catalogs").iterdir()) == ["fr.po"]  # no temporary file
        dangling = tmp_path / "new.po"  # a link to a file not there yet: the file is created
        dangling.symlink_to("catalogs/new.po")
        assert translate_po(capsys, FIXTURE, "-o", dangling, "--server", server)[0] == 0
        assert dangling.is_symlink() and (tmp_path / "catalogs" / "new.po").is_file()
        nowhere = tmp_path / "nowhere.po"  # a link into a directory that does not exist
        nowhere.symlink_to("missing/fr.po")
        code, _, err = translate_po(capsys, FIXTURE, "-o", nowhere, "--server", server)
        assert code == 1 and err == (f"nmt translate-po: {nowhere} (a link to {tmp_path / 'missing/fr.po'}): "
                                     f"cannot write: no directory {tmp_path / 'missing'}\n")
        loop = tmp_path / "loop.po"
        loop.symlink_to("loop.po")
        code, _, err = translate_po(capsys, FIXTURE, "-o", loop, "--server", server)
        assert code == 1 and "too many levels of symbolic links" in err


POLISH = ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n"Language: pl\\n"\n'
          '"Plural-Forms: nplurals=3; plural=(n==1 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) '
          '? 1 : 2);\\n"\n\n'
          'msgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] "Jeden plik"\nmsgstr[1] "%d pliki"\n'
          'msgstr[2] "%d plik\u00f3w"\n\n'
          '#, fuzzy\nmsgid "Open the file"\nmsgstr "Otw\u00f3rz plik"\n\n'
          '#~ msgid "Old"\n#~ msgstr "Stary"\n')


def test_retargeting_writes_the_new_languages_plural_forms(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    polish, out = tmp_path / "pl.po", tmp_path / "fr.po"
    polish.write_text(POLISH)
    with stand_in() as server:
        code, _, err = translate_po(capsys, polish, "-o", out, "--server", server)
        assert code == 2 and "Language is 'pl': no served model translates en into pl (serves en-fr;" in err
        code, _, err = translate_po(capsys, polish, "-o", out, "--server", server, "--model", "echo")
        assert code == 2 and "Language is 'pl', the model translates into 'fr' (--overwrite" in err
        code, _, err = translate_po(capsys, polish, "-o", out, "--server", server, "--language", "fr",
                                    "--overwrite")
    assert code == 0, err
    result = polib.pofile(str(out))
    assert (result.metadata["Language"], result.metadata["Plural-Forms"]) == ("fr", "nplurals=2; plural=(n > 1);")
    files = by_key(result)[(None, "One file", False)]
    assert files.msgstr_plural == {0: "[One file]", 1: "[%d files]"}  # two forms, none left in Polish
    assert by_key(result)[(None, "Old", True)].msgstr == "Stary"  # obsolete: kept
    if shutil.which("msgfmt"):
        done = subprocess.run(["msgfmt", "--check", "-o", "/dev/null", str(out)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_a_language_the_model_does_not_produce(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ru.po"
    with stand_in(("en", "fr")) as server:
        code, _, err = translate_po(capsys, FIXTURE, "-o", out, "--server", server, "--language", "ru")
        assert code == 2 and err == ("nmt translate-po: --language ru: no served model translates en into ru "
                                     "(serves en-fr; --model to choose one)\n")
        code, _, err = translate_po(capsys, FIXTURE, "-o", out, "--server", server, "--language=ru", "--model=echo")
    assert code == 2 and err == "nmt translate-po: --language ru: model echo/7 translates into fr, not ru\n"
    assert not out.exists()
    template = tmp_path / "app.pot"
    template.write_text('msgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] ""\nmsgstr[1] ""\n')
    with stand_in(("", "")) as server:  # a manifest without languages: --language trusted, with a warning
        code, _, err = translate_po(capsys, template, "-o", out, "--server", server)
        assert code == 2 and "model echo names no target language: pass --language" in err
        code, _, err = translate_po(capsys, template, "-o", out, "--server", server, "--language", "ru")
    assert code == 0
    assert err == "nmt translate-po: warning: model echo/7 names no target language: trusting --language ru\n"
    result = polib.pofile(str(out))
    assert result.metadata["Plural-Forms"] == catalogs.PLURAL_FORMS["ru"]
    assert result[0].msgstr_plural == {0: "[One file]", 1: "[%d files]", 2: "[%d files]"}


# ---- TLS and a bearer token --------------------------------------------------------------------

class EchoTranslator(pb_grpc.TranslatorServicer):
    """A stand-in server that wants a bearer token: its "translation" is the text in brackets."""

    def ListModels(self, request, context):
        self._check(context)
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="echo", version="7", languages=["en", "fr"],
                                                          is_default=True)])

    def Translate(self, request, context):
        self._check(context)
        return pb.TranslateResponse(translations=[pb.Translation(hypotheses=[pb.Hypothesis(text=f"[{t}]")])
                                                  for t in request.texts])

    def _check(self, context) -> None:
        if dict(context.invocation_metadata()).get("authorization") != "Bearer s3cret":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required")


def make_certificates(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    crypto = pytest.importorskip("cryptography")
    del crypto
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(name: str, issuer: tuple | None, *, ca: bool = False, san: list | None = None) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        signer_name, signer_key = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(signer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(signer_key, hashes.SHA256())
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return cert, key

    ca = issue("ca", None, ca=True)
    issue("server", ca, san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    issue("client", ca)


def test_tls_client_certificate_and_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_certificates(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TranslatorServicer_to_server(EchoTranslator(), server)
    credentials = grpc.ssl_server_credentials(
        [((tmp_path / "server.key").read_bytes(), (tmp_path / "server.crt").read_bytes())],
        root_certificates=(tmp_path / "ca.crt").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        (tmp_path / "token").write_text("s3cret\n")
        tls = ["--server", f"127.0.0.1:{port}", "--tls-ca-file", tmp_path / "ca.crt",
               "--tls-cert-file", tmp_path / "client.crt", "--tls-key-file", tmp_path / "client.key"]
        out = tmp_path / "fr.po"
        code, _, err = translate_po(capsys, FIXTURE, "-o", out, *tls, "--token-file", tmp_path / "token")
        assert code == 0, err
        entries = by_key(polib.pofile(str(out)))
        opened = entries[(None, "Open the file", False)]
        assert opened.msgstr == "[Open the file]"
        assert ours(opened) == "machine translation by model echo version 7"
        assert entries[(None, "  File not found  ", False)].msgstr == "  [File not found]  "
        code, _, err = translate_po(capsys, FIXTURE, "-o", out, *tls)  # no token
        assert code == 1 and "UNAUTHENTICATED: a bearer token is required" in err
        code, _, err = translate_po(capsys, FIXTURE, "-o", out, *tls[:4], "--token-file", tmp_path / "token")
        assert code == 1 and "UNAVAILABLE" in err  # no client certificate: the handshake fails
    finally:
        server.stop(None)
