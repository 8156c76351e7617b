"""TLS, mTLS and bearer tokens: who may call, with certificates made here (``cryptography``).

The matrix: a plaintext client against a TLS server fails, a client trusting another CA
fails, mTLS without (or with a foreign) client certificate fails, no or a wrong token is
UNAUTHENTICATED (never echoed nor logged, counted by reason), the right token works,
health answers without one, a rewritten token file or certificate takes effect without a
restart; and a bad TLS file stops ``nmt serve`` at once with one line naming it.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from harness import SERVING, ServerThread, config_for  # noqa: E402
from service.config import ConfigError, parse  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402

TOKEN, OTHER_TOKEN, WRONG_TOKEN = "s3cret-token-one", "s3cret-token-two", "wrong-token-xyz"
HOST = "localhost"  # the server certificate's name


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_cert(cn: str, issuer: tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
              *, ca: bool = False) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA (``issuer`` None, self-signed) or a certificate for ``cn`` signed by ``issuer``."""
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn))
               .issuer_name(issuer[1].subject if issuer else _name(cn))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(HOST), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer[2] if issuer else key, hashes.SHA256())
    pem = Pem(cert.public_bytes(serialization.Encoding.PEM),
              key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()))
    return pem, cert, key


@dataclass
class Pki:
    dir: Path
    ca: Pem
    other_ca: Pem
    client: Pem  # signed by ca
    foreign_client: Pem  # signed by other_ca
    issuers: dict

    def write(self, name: str, data: bytes) -> Path:
        """Write atomically (a new inode, as a rotated Kubernetes secret does)."""
        path, tmp = self.dir / name, self.dir / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = make_cert("test CA", ca=True), make_cert("other CA", ca=True)
    server = make_cert(HOST, ca)
    pki = Pki(dir=root, ca=ca[0], other_ca=other[0], client=make_cert("client", ca)[0],
              foreign_client=make_cert("client", other)[0], issuers={"ca": ca, "other": other})
    pki.write("server.crt", server[0].cert)
    pki.write("server.key", server[0].key)
    pki.write("ca.crt", ca[0].cert)
    pki.write("tokens", f"# tokens of the tests\n{TOKEN}\n\n".encode())
    return pki


def channel(address: str, ca: Pem | None, client: Pem | None = None) -> grpc.Channel:
    """A TLS channel trusting ``ca`` (None: plaintext), presenting ``client`` if given."""
    if ca is None:
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(root_certificates=ca.cert,
                                         private_key=client.key if client else None,
                                         certificate_chain=client.cert if client else None)
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", HOST)])


def translate(ch: grpc.Channel, token: str | None = TOKEN) -> grpc.StatusCode:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        pb_grpc.TranslatorStub(ch).Translate(pb.TranslateRequest(texts=["Open the file"]),
                                             metadata=metadata, timeout=20)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def tls_server(tiny_repository: Path, pki: Pki):
    """TLS (no client certificates) with tokens."""
    config = config_for(tiny_repository, "--tls-cert-file", str(pki.dir / "server.crt"),
                        "--tls-key-file", str(pki.dir / "server.key"),
                        "--auth-token-file", str(pki.dir / "tokens"))
    with ServerThread(config) as s:
        yield s


def test_plaintext_client_and_client_trusting_another_ca_fail(tls_server: ServerThread, pki: Pki) -> None:
    with channel(tls_server.address, None) as plain:
        assert translate(plain) == grpc.StatusCode.UNAVAILABLE
    with channel(tls_server.address, pki.other_ca) as foreign:
        assert translate(foreign) == grpc.StatusCode.UNAVAILABLE


def test_tokens_no_or_wrong_is_unauthenticated_never_echoed_and_counted(
        tls_server: ServerThread, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    before = {r: tls_server.metric("nmt_auth_failures_total", reason=r) for r in ("missing", "invalid")}
    with caplog.at_level(logging.DEBUG), channel(tls_server.address, pki.ca) as ch:
        assert translate(ch, None) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.TranslatorStub(ch).ListModels(pb.ListModelsRequest(), timeout=20,
                                                  metadata=[("authorization", f"Bearer {WRONG_TOKEN}")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert WRONG_TOKEN not in e.value.details() and "Bearer <token>" in e.value.details()
        assert translate(ch, TOKEN) == grpc.StatusCode.OK
    assert not any(WRONG_TOKEN in r.getMessage() for r in caplog.records)
    assert tls_server.metric("nmt_auth_failures_total", reason="missing") == before["missing"] + 1
    assert tls_server.metric("nmt_auth_failures_total", reason="invalid") == before["invalid"] + 1
    assert tls_server.metric("nmt_requests_total", method="ListModels", code="UNAUTHENTICATED") >= 1


def test_health_needs_no_token_reflection_does(tls_server: ServerThread, pki: Pki) -> None:
    with channel(tls_server.address, pki.ca) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
        assert health.status == SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter(ask), timeout=20))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.ServerReflectionInfo(iter(ask), timeout=20,
                                                 metadata=[("authorization", f"Bearer {TOKEN}")]))
        names = {s.name for s in replies[0].list_services_response.service}
        assert "nmt.v1.Translator" in names


def test_a_rewritten_token_file_takes_effect_without_restart(tls_server: ServerThread, pki: Pki) -> None:
    try:
        (pki.dir / "tokens").write_text(f"# rotated\n{OTHER_TOKEN}\n")  # in place: same inode
        with channel(tls_server.address, pki.ca) as ch:
            assert translate(ch, TOKEN) == grpc.StatusCode.UNAUTHENTICATED
            assert translate(ch, OTHER_TOKEN) == grpc.StatusCode.OK
    finally:
        (pki.dir / "tokens").write_text(f"{TOKEN}\n")


def test_a_rotated_certificate_serves_new_connections_without_restart(tls_server: ServerThread,
                                                                       pki: Pki) -> None:
    new_ca = make_cert("rotated CA", ca=True)
    new_server = make_cert(HOST, new_ca)
    old_cert, old_key = (pki.dir / "server.crt").read_bytes(), (pki.dir / "server.key").read_bytes()
    try:
        pki.write("server.key", new_server[0].key)
        pki.write("server.crt", new_server[0].cert)
        with channel(tls_server.address, new_ca[0]) as ch:
            assert translate(ch) == grpc.StatusCode.OK
        with channel(tls_server.address, pki.ca) as ch:
            assert translate(ch) == grpc.StatusCode.UNAVAILABLE  # the old CA no longer matches
    finally:
        pki.write("server.key", old_key)
        pki.write("server.crt", old_cert)
    with channel(tls_server.address, pki.ca) as ch:
        assert translate(ch) == grpc.StatusCode.OK


def test_mtls_requires_a_client_certificate_from_the_client_ca(tiny_repository: Path, pki: Pki) -> None:
    config = config_for(tiny_repository, "--tls-cert-file", str(pki.dir / "server.crt"),
                        "--tls-key-file", str(pki.dir / "server.key"),
                        "--tls-client-ca-file", str(pki.dir / "ca.crt"), "--reflection", "off")
    with ServerThread(config) as s:
        with channel(s.address, pki.ca) as ch:
            assert translate(ch, None) == grpc.StatusCode.UNAVAILABLE
        with channel(s.address, pki.ca, pki.foreign_client) as ch:
            assert translate(ch, None) == grpc.StatusCode.UNAVAILABLE
        with channel(s.address, pki.ca, pki.client) as ch:
            assert translate(ch, None) == grpc.StatusCode.OK  # tokens off: none needed
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                    list_services="")]), timeout=20))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED  # --reflection off


@pytest.mark.parametrize("files, message", [
    (("missing.crt", "server.key"), r"missing.crt: cannot read the TLS certificate"),
    (("server.crt", "missing.key"), r"missing.key: cannot read the TLS private key"),
    (("server.key", "server.key"), r"server.key: not a PEM certificate"),
    (("server.crt", "other.key"), r"other.key: private key does not match the certificate .*server.crt"),
    (("server.crt", "tokens"), r"tokens: not a PEM private key"),
])
def test_a_bad_tls_file_stops_the_server_with_one_line_naming_it(
        tiny_repository: Path, pki: Pki, files: tuple[str, str], message: str,
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from service.api import main as serve_main

    pki.write("other.key", make_cert(HOST, pki.issuers["ca"])[0].key)
    for name in list(os.environ):
        if name.startswith("NMT_"):
            monkeypatch.delenv(name)
    rc = serve_main.main(["--model-repository", str(tiny_repository), "--port", "0",
                           "--tls-cert-file", str(pki.dir / files[0]),
                           "--tls-key-file", str(pki.dir / files[1])])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_half_a_tls_setting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--tls-cert-file needs --tls-key-file"):
        parse(["--tls-cert-file", "a.crt"], env={})
    with pytest.raises(ConfigError, match="--tls-client-ca-file needs --tls-cert-file"):
        parse(["--tls-client-ca-file", "ca.crt"], env={})
    assert parse([], env={"NMT_AUTH_TOKEN_FILE": "/run/t", "NMT_REFLECTION": "off",
                          "NMT_METRICS_HOST": "127.0.0.1"}).security.reflection is False


def test_nmt_translate_speaks_tls_and_sends_the_token(tls_server: ServerThread, pki: Pki,
                                                      capsys: pytest.CaptureFixture) -> None:
    from service.clients import translate

    args = ["--server", tls_server.address, "--tls-ca-file", str(pki.dir / "ca.crt"),
            "--tls-server-name", HOST]
    assert translate.main([*args, "--token-file", str(pki.dir / "tokens"), "Open the file"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert translate.main([*args, "Open the file"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_deploy_examples_mount_certificate_and_tokens_as_secrets() -> None:
    import shutil
    import subprocess

    import yaml

    from service.config import check_unknown

    deploy = Path(__file__).resolve().parents[1] / "deploy"
    compose = yaml.safe_load((deploy / "docker-compose.tls.yml").read_text())
    nmt = compose["services"]["nmt"]
    env = {k: str(v) for k, v in nmt["environment"].items()}
    check_unknown(env)  # every NMT_* is a setting (or a client's NMT_CLIENT_*)
    security = parse([], env={k: v for k, v in env.items() if not k.startswith("NMT_CLIENT_")}).security
    assert security.tls_client_ca_file and security.auth_token_file and not security.reflection
    assert set(nmt["secrets"]) == set(compose["secrets"])
    mounted = {f"/run/secrets/{name}" for name in nmt["secrets"]}
    assert {v for k, v in env.items() if k.endswith("_FILE")} <= mounted
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (kustomize)")
    out = subprocess.run([kubectl, "kustomize", str(deploy / "k8s" / "tls")], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    deployment = next(d for d in yaml.safe_load_all(out) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    check_unknown(env)
    secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
    mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] in secrets]
    for name, value in env.items():
        if name.endswith("_FILE") and name != "NMT_MODEL_REPOSITORY":
            assert any(value.startswith(m + "/") for m in mounts), (name, value)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe] and c[probe]["exec"]["command"][1] == "/opt/nmt/healthcheck.py"
