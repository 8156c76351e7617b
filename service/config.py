"""``nmt serve`` configuration: one frozen dataclass, from flags and ``NMT_*`` variables.

Every flag has an environment variable (``--max-rows`` <- ``NMT_MAX_ROWS``);
a flag given on the command line wins over the variable, the variable over the
default. A bad variable stops the server at once with a one-line reason: a
typo in a deployment must not become a silently ignored setting.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

# the enum-like settings, imported here where they were first defined (service.choices)
from service.choices import Precision, Provider, Batching, ModelControl, ModelVersions, LogLevel, Int8Form, Shortlist, Switch  # noqa: F401
from service.choices import EngineProcess, SchedBatch
from service.choices import converter as _choice
from service.options import Limits

REPO_ROOT = Path(__file__).resolve().parents[1]


def _served_en_fr(models: Path = REPO_ROOT / "models" / "en-fr") -> Path:
    """The highest en-fr version the checkout ships (one is tracked at a time), e.g. models/en-fr/4."""
    versions = [int(p.name) for p in models.iterdir() if p.name.isdigit()] if models.is_dir() else []
    return models / str(max(versions, default=1))


DEFAULT_MODEL_REPOSITORY, MAX_PORT = _served_en_fr(), 65535


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching budgets and admission control."""

    max_rows: int = 128  # decoder rows per step
    max_tokens: int = 8192  # rows x padded source length of the running batch
    max_wait: float = 0.002  # seconds a queued text may wait for others to share its encoder run
    max_queued_work: int = 200_000  # estimated rows x steps, queued or decoding
    step_level: bool = True  # False (Batching.REQUEST): a batch starts once the running one is empty
    small_rows: int = 0  # a request of at most this many rows decodes in the small lane (0: one lane)


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call: TLS (with client certificates: mTLS), bearer tokens, reflection."""

    tls_cert_file: Path | None = None  # PEM certificate chain; with tls_key_file: serve TLS
    tls_key_file: Path | None = None  # PEM private key
    tls_client_ca_file: Path | None = None  # PEM CAs; set: client certificates required (mTLS)
    auth_token_file: Path | None = None  # one token per line; set: nmt.v1 and reflection need one
    reflection: bool = True

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP port's connection limits (service.api.http_limits), like those gRPC core keeps."""
    header_timeout: float = 10.0  # seconds to a request's whole headers, from its first byte or connect (0: none)
    idle_timeout: float = 30.0  # seconds a keep-alive connection may idle between requests (0: no keep-alive)
    max_connections: int = 512  # open at once; more are closed at once (0: no cap but the open-files limit)


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``nmt serve`` needs; validated once, passed whole."""

    model_repository: Path  # one model version dir, or a dir of <name>/<version>/
    default_model: str  # name served when a request leaves `model` empty ("" = first)
    host: str  # address the gRPC port binds to
    port: int  # gRPC port (0 = any free port)
    metrics_host: str  # address the metrics port binds to ("" = host)
    metrics_port: int  # Prometheus /metrics port (0 = any free port)
    precision: Precision  # graph variant: fp32, int8, or auto (each model's measured choice)
    provider: Provider  # ONNX Runtime provider
    threads: int  # ONNX Runtime intra-op threads per engine (0: the cores, divided among the models served)
    decoder_spinning: bool  # decoder-step thread pool spins between operators (see service.decoding.runtime)
    scheduler: SchedulerConfig  # batching budgets and admission control
    limits: Limits  # per-request limits
    max_message_bytes: int  # largest request accepted (gRPC answers RESOURCE_EXHAUSTED)
    grace_period: float  # seconds in-flight calls get to finish after SIGTERM
    max_connection_age: float  # seconds before a client connection is asked to reconnect (0 = never)
    log_level: LogLevel  # debug logs one line per request
    model_control: ModelControl = ModelControl.NONE  # poll: rescan every poll_seconds (and on SIGHUP)
    poll_seconds: float = 30.0
    model_versions: ModelVersions = ModelVersions.LATEST  # latest: one version per name; all: every one
    security: SecurityConfig = SecurityConfig()  # TLS, mTLS, tokens, reflection
    http_port: int = 0  # HTTP/JSON API and web page (service.api.http_server); 0 = off
    http_limits: HttpLimits = HttpLimits()  # the HTTP port's timeouts and connection cap
    int8_form: Int8Form = Int8Form.AUTO  # the int8 products' form (auto: from the CPU's flags)
    shortlist: Shortlist = Shortlist.AUTO  # project each step onto the texts' candidate pieces
    trust_client_id: bool = False  # fairness: the x-client-id header names the client (else token / peer)
    fairness: bool = True  # rows shared between clients (off: one arrival-ordered queue)
    engine_process: bool | None = None  # batches decode in a child process per model (service.scheduling.remote);
    # None: auto (``service.process.engine_process``)
    fused_attention: bool = True  # the int8 step's attention by the compiled kernel (service.decoding.fused)
    fused_encoder: bool = True  # the int8 encoder's GRU by the compiled kernel (service.decoding.fused_encoder)
    sched_batch: bool | None = None  # threads under SCHED_BATCH (``service.process.sched_batch``); None: auto


SMALL_REQUEST_ROWS = 8
"""With --fairness on, a request of at most this many decoder rows (texts x beam size) decodes in
the small lane (``service.scheduling.lanes``)."""


class ConfigError(ValueError):
    """A bad setting; the message names the flag or variable and the value."""


def _int_at_least(low: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return convert


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port in 0..{MAX_PORT}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


_text = str  # the text as given


_DEFAULTS, _LIMITS = SchedulerConfig(), Limits()

# (flag, converter, default, help); the variable is NMT_ + the flag in upper case.
FLAGS: list[tuple[str, Callable[[str], object], object, str]] = [
    ("--model-repository", _text, str(DEFAULT_MODEL_REPOSITORY),
     "model version dir (with manifest.json) or a dir of <name>/<version>/ dirs"),
    ("--default-model", _text, "", "model name used when a request names none (default: first)"),
    # loopback by default: reaching the port is enough to call every RPC unless TLS and tokens
    # are on; the container image sets NMT_HOST=0.0.0.0 (its network is the boundary there)
    ("--host", _text, "127.0.0.1", "address the gRPC port binds to (0.0.0.0: every IPv4 interface)"),
    ("--port", _port, 50051, "gRPC port (0 = any free port)"),
    ("--metrics-host", _text, "", "address the metrics port binds to (empty: --host); 127.0.0.1 "
     "keeps /metrics off the network"),
    ("--metrics-port", _port, 9464, "Prometheus /metrics port (0 = any free port)"),
    ("--precision", _choice(Precision), Precision.AUTO,
     "graph precision; auto: int8 where the model's manifest shows it within 0.3 BLEU of fp32"),
    ("--provider", _choice(Provider), Provider.CPU, "ONNX Runtime execution provider"),
    ("--threads", _int_at_least(0), 0, "ONNX Runtime intra-op threads per engine (0: the cores, divided among models)"),
    ("--int8-form", _choice(Int8Form), Int8Form.AUTO,
     "int8 products: auto (u8s8 where the CPU has VNNI or AMX, checked against u8u8 at load), u8s8, u8u8"),
    ("--shortlist", _choice(Shortlist), Shortlist.AUTO,
     "lexical shortlist of target pieces: off, auto (where the manifest shows <= 0.3 BLEU lost), on; "
     "each row scored over its own text's words (docs/speed-round2.md)"),
    ("--decoder-spinning", _choice(Switch), Switch.ON,
     "decoder-step pool threads spin between operators (faster steps; off frees CPU between steps)"),
    ("--engine-process", _choice(EngineProcess), EngineProcess.AUTO, "on: each model's batches decode in a process of "
     "its own (no GIL shared with gRPC; docs/serving.md); auto: on for one model, CPU provider, 2+ cores, --threads 0; "
     "off: in process"),
    ("--fused-attention", _choice(Switch), Switch.ON, "int8 step attention by our compiled kernel (off: ONNX Runtime's)"),
    ("--fused-encoder", _choice(Switch), Switch.ON, "int8 encoder GRU by our compiled kernel, int8 recurrence "
     "(off: ONNX Runtime's fp32 GRU; docs/serving.md)"),
    ("--sched-batch", _choice(SchedBatch), SchedBatch.AUTO, "Linux: on: the server's threads and engine process run "
     "SCHED_BATCH (a waking thread waits for the tick, docs/serving.md); auto: on with the engine process; off: as started"),
    ("--max-rows", _int_at_least(1), _DEFAULTS.max_rows, "decoder rows per step"),
    ("--max-tokens", _int_at_least(1), _DEFAULTS.max_tokens, "rows x padded source length of the running batch"),
    ("--max-wait-ms", _seconds, _DEFAULTS.max_wait * 1000, "how long texts that arrive while a batch decodes wait "
     "for others to share their encoder run (an idle batch starts at once under step-level batching; "
     "request-level: how long a new batch waits to fill)"),
    ("--max-queued-work", _int_at_least(1), _DEFAULTS.max_queued_work,
     "estimated rows x steps queued or decoding; above it RESOURCE_EXHAUSTED"),
    ("--fairness", _choice(Switch), Switch.ON,
     "on: free decoder rows go to the client with the fewest (its oldest text first); off: one queue in "
     "arrival order for everyone (docs/serving.md)"),
    ("--trust-client-id", _choice(Switch), Switch.OFF,
     "fairness between clients: on: a request's x-client-id header (gRPC metadata) names its client; "
     "off: a token's identity where tokens are on, else the peer address"),
    ("--batching", _choice(Batching), Batching.STEP,
     "step: texts join/leave between decoder steps; request: a batch runs to its end"),
    ("--max-texts", _int_at_least(1), _LIMITS.max_texts, "texts per request"),
    ("--max-beam", _int_at_least(1), _LIMITS.max_beam_size, "largest beam_size"),
    ("--max-text-chars", _int_at_least(1), _LIMITS.max_text_chars, "characters per text"),
    ("--max-message-bytes", _int_at_least(1024), 1 << 20, "largest request message"),
    ("--grace-period", _seconds, 10.0, "seconds in-flight calls get to finish on SIGTERM"),
    ("--max-connection-age", _seconds, 0.0,
     "seconds after which a client connection gets GOAWAY and reconnects, so that clients spread "
     "over new replicas; its calls get --grace-period to finish (0 = never)"),
    ("--log-level", _choice(LogLevel), LogLevel.INFO, "debug logs one line per request"),
    ("--model-control", _choice(ModelControl), ModelControl.NONE,
     "poll: rescan the repository every --poll-seconds for new or removed <name>/<version>/ dirs "
     "(SIGHUP rescans in either mode)"),
    ("--poll-seconds", _seconds, 30.0, "seconds between rescans with --model-control poll"),
    ("--model-versions", _choice(ModelVersions), ModelVersions.LATEST,
     "latest: the newest version of each name serves; all: every version found (pin with name/version)"),
    ("--tls-cert-file", _text, "", "PEM certificate chain: serve gRPC over TLS (with --tls-key-file); "
     "re-read when the file changes"),
    ("--tls-key-file", _text, "", "PEM private key of --tls-cert-file"),
    ("--tls-client-ca-file", _text, "", "PEM CA certificates: client certificates are required and "
     "verified against them (mTLS)"),
    ("--auth-token-file", _text, "", "bearer tokens, one per line (# comments); set: every nmt.v1 "
     "RPC and reflection need 'authorization: Bearer <token>' (health does not); re-read on change"),
    ("--reflection", _choice(Switch), Switch.ON, "gRPC server reflection"),
    # HTTP/JSON beside gRPC (service.api.http_server); its body limit is --max-message-bytes
    ("--http-port", _port, 8080, "HTTP/JSON API and web page port (0 = off)"),
    ("--http-header-timeout", _seconds, HttpLimits.header_timeout, "seconds an HTTP connection gets to "
     "send a request's whole headers, from its first byte or the connect (0 = no limit)"),
    ("--http-idle-timeout", _seconds, HttpLimits.idle_timeout, "seconds an idle keep-alive HTTP connection stays open (0 = no keep-alive)"),
    ("--http-max-connections", _int_at_least(0), HttpLimits.max_connections, "HTTP connections open at "
     "once; more are closed at once (0 = no cap but the open-files limit)"),
]


def env_name(flag: str) -> str:
    return "NMT_" + flag.lstrip("-").replace("-", "_").upper()


OTHER_VARIABLES = ("NMT_SERVER", "NMT_LOCUST_", "NMT_SMOKE_", "NMT_CLIENT_", "NMT_TEST_")
"""``NMT_*`` variables (or prefixes) read by the other tools of this project (``nmt translate``,
the Locust and container-smoke scripts, the tests: ``NMT_TEST_HOSTILE``), not by ``nmt serve``."""


def check_unknown(env: Mapping[str, str]) -> None:
    """An ``NMT_*`` variable that is no setting (a typo such as ``NMT_PROT``) is an error."""
    known = [env_name(flag) for flag, *_ in FLAGS]
    for name in sorted(env):
        if name.startswith("NMT_") and name not in known and not name.startswith(OTHER_VARIABLES):
            close = difflib.get_close_matches(name[4:], [k[4:] for k in known], n=1)  # past "NMT_"
            hint = f"did you mean NMT_{close[0]}? " if close else ""
            raise ConfigError(f"{name}: not a setting of nmt serve ({hint}see nmt serve --help)")


def parse(argv: list[str], env: Mapping[str, str] | None = None) -> ServeConfig:
    """Flags over ``NMT_*`` variables over defaults; raises ConfigError on a bad or unknown
    variable."""
    env = os.environ if env is None else env
    check_unknown(env)
    parser = argparse.ArgumentParser(prog="nmt serve", description="Run the gRPC translation server.")
    for flag, convert, default, help_ in FLAGS:
        name = env_name(flag)
        if name in env:
            try:
                default = convert(env[name])
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"{name}: {e}") from None
        parser.add_argument(flag, type=convert, default=default, help=f"{help_} [{name}, default %(default)s]")
    args = parser.parse_args(argv)
    return ServeConfig(
        model_repository=Path(args.model_repository), default_model=args.default_model,
        host=args.host, port=args.port, metrics_host=args.metrics_host or args.host, metrics_port=args.metrics_port,
        precision=args.precision, provider=args.provider, threads=args.threads,
        decoder_spinning=args.decoder_spinning is Switch.ON, int8_form=args.int8_form, shortlist=args.shortlist,
        scheduler=SchedulerConfig(max_rows=args.max_rows, max_tokens=args.max_tokens, max_wait=args.max_wait_ms / 1000,
                                  max_queued_work=args.max_queued_work, step_level=args.batching is Batching.STEP,
                                  small_rows=SMALL_REQUEST_ROWS if args.fairness is Switch.ON else 0),
        limits=Limits(max_beam_size=args.max_beam, max_texts=args.max_texts, max_text_chars=args.max_text_chars),
        max_message_bytes=args.max_message_bytes, grace_period=args.grace_period,
        max_connection_age=args.max_connection_age, log_level=args.log_level, model_control=args.model_control,
        poll_seconds=max(args.poll_seconds, 0.1), model_versions=args.model_versions,
        security=security(args), http_port=args.http_port,
        http_limits=HttpLimits(header_timeout=args.http_header_timeout, idle_timeout=args.http_idle_timeout,
                               max_connections=args.http_max_connections),
        trust_client_id=args.trust_client_id is Switch.ON, fairness=args.fairness is Switch.ON,
        engine_process={EngineProcess.ON: True, EngineProcess.OFF: False}.get(args.engine_process),
        fused_attention=args.fused_attention is Switch.ON, fused_encoder=args.fused_encoder is Switch.ON,
        sched_batch={SchedBatch.ON: True, SchedBatch.OFF: False}.get(args.sched_batch))


def _path(text: str) -> Path | None:
    return Path(text) if text else None


def security(args: argparse.Namespace) -> SecurityConfig:
    """The TLS and token settings; a key without its certificate (or the reverse), or client
    CAs without TLS, is an error: half a TLS setting must not become plaintext."""
    cert, key, ca = _path(args.tls_cert_file), _path(args.tls_key_file), _path(args.tls_client_ca_file)
    if (cert is None) != (key is None):
        given, missing = ("--tls-cert-file", "--tls-key-file") if key is None else (
            "--tls-key-file", "--tls-cert-file")
        raise ConfigError(f"{given} needs {missing} ({env_name(missing)})")
    if ca is not None and cert is None:
        raise ConfigError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    return SecurityConfig(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=ca,
                          auth_token_file=_path(args.auth_token_file), reflection=args.reflection is Switch.ON)
