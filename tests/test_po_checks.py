"""``nmt translate-po`` beyond the happy path: the pure catalog parts (format flags, lines,
encodings), bad input refused in one line naming the file or entry with nothing written, and
TLS with a client certificate and a bearer token against a stand-in server.

The workflow with the tiny model's server is ``tests/test_po.py``.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import polib
import pytest

from harness import ROOT, ServerThread, config_for, free_port
from po_helpers import FIXTURE, by_key, ours, translate_po
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
