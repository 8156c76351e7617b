"""Locust load test for ``nmt serve`` over gRPC (``TranslatorUser``) and HTTP/JSON
(``HttpTranslatorUser``, the same task mix).

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 60s --host 127.0.0.1:50051
    NMT_LOCUST_PROTOCOL=http locust -f loadtest/locustfile.py --headless -u 8 -t 60s \
        --host http://127.0.0.1:8080
    make loadtest                       # starts a server, runs this headless, writes reports

A realistic mix of software messages: short and long texts (from a corpus
split: JSONL lines with ``src_raw``), greedy and beam search, some n-best,
some multi-text requests, some streamed. Every call is timed by a client
interceptor that fires Locust's ``request`` event, so Locust's statistics and
reports cover gRPC like HTTP. Configuration (environment variables):

- ``NMT_LOCUST_TEXTS``: the split to draw texts from (default: a small built-in list)
- ``NMT_LOCUST_WEIGHTS``: task weights, e.g. ``short=6,long=2,beam=2,nbest=1,batch=1,stream=1``
  (a weight of 0 turns a task off)
- ``NMT_LOCUST_BEAM`` (4), ``NMT_LOCUST_NBEST`` (3), ``NMT_LOCUST_BATCH_TEXTS`` (8)
- ``NMT_LOCUST_WAIT``: think time per user in seconds, ``min,max`` (``0,0``: closed loop)
- ``NMT_LOCUST_TIMEOUT``: gRPC deadline (HTTP: ``X-Request-Timeout``) per call in seconds (30)
- TLS and tokens, as ``nmt translate`` reads them: ``NMT_CLIENT_TLS_CA_FILE`` (set: TLS),
  ``NMT_CLIENT_TLS_CERT_FILE`` and ``NMT_CLIENT_TLS_KEY_FILE`` (mTLS),
  ``NMT_CLIENT_TLS_SERVER_NAME``, ``NMT_CLIENT_TOKEN_FILE`` (``authorization: Bearer``)
- ``NMT_LOCUST_PROTOCOL``: ``grpc`` (default), ``http`` or ``grpc,http`` (both user classes;
  then ``NMT_LOCUST_HTTP_HOST``, default ``http://127.0.0.1:8080``, is the HTTP users' host)
- targets, checked when the run ends (a miss makes Locust exit 1):
  ``NMT_LOCUST_MAX_FAIL_RATIO`` (0), ``NMT_LOCUST_MAX_P99_MS`` (unset = not checked)
"""

from __future__ import annotations

# gRPC's own threads would block gevent's loop: patch grpc before any channel exists.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import gevent  # noqa: E402
import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from locust import HttpUser, User, between, events  # noqa: E402
from locust.env import Environment  # noqa: E402

from service.clients.translate import auth_metadata, client_env, open_channel  # noqa: E402
from service.proto.nmt.v1 import translation_pb2 as pb  # noqa: E402
from service.proto.nmt.v1 import translation_pb2_grpc as pb_grpc  # noqa: E402

REQUEST_TYPE = "grpc"
PROTOCOLS = {p.strip() for p in os.environ.get("NMT_LOCUST_PROTOCOL", "grpc").split(",")}
LONG_CHARS = 60  # texts longer than this count as long (the split's median is ~35)
MAX_CHARS = 600  # keeps texts well under the server's 200-piece source limit
MIN_LONG_TEXTS = 10  # fewer long texts in the split: make some by joining short ones
DEFAULT_WEIGHTS = {"short": 6, "long": 2, "beam": 2, "nbest": 1, "batch": 1, "stream": 1}
FALLBACK_TEXTS = [
    "Open the file", "Save changes?", "File not found", "Permission denied", "Unknown option %s",
    "Delete %d selected items?", "Cannot open %(filename)s: %(reason)s",
    "The password must contain at least {0} characters.",
    "Your session has expired. Please log in again to continue working on this document.",
    "An error occurred while saving the file. Check that the disk is not full and try again.",
    "Print the version number and exit", "Show this help message and exit",
    "The server returned an invalid response while downloading %s; the download was cancelled.",
    "Are you sure you want to remove <b>%(name)s</b> from the list of trusted devices?",
]


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def parse_weights(spec: str) -> dict[str, int]:
    """``short=6,long=2`` over the defaults; unknown task names are an error."""
    weights = dict(DEFAULT_WEIGHTS)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in weights:
            raise ValueError(f"NMT_LOCUST_WEIGHTS: unknown task {name!r}; known: {sorted(weights)}")
        weights[name] = int(value)
    return weights


def load_texts(path: str | None) -> tuple[list[str], list[str]]:
    """(short, long) texts from a JSONL split with ``src_raw`` (or one text per line)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines() if path else FALLBACK_TEXTS
    texts = [json.loads(line)["src_raw"] if line.lstrip().startswith("{") else line for line in lines]
    texts = [t for t in texts if t.strip() and len(t) <= MAX_CHARS]
    short = [t for t in texts if len(t) <= LONG_CHARS] or texts
    long = [t for t in texts if len(t) > LONG_CHARS]
    rng = random.Random(0)
    while len(long) < MIN_LONG_TEXTS:
        long.append(" ".join(rng.sample(short, min(3, len(short)))))
    return short, long


class _Timed:
    """Fires one Locust request event per call: at the answer, or when a stream ends."""

    def __init__(self, environment: Environment, name: str) -> None:
        self.environment, self.name, self.started = environment, name, time.perf_counter()
        self.length = 0

    def fire(self, exception: BaseException | None) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=self.name, response_length=self.length,
            response_time=(time.perf_counter() - self.started) * 1000, exception=exception,
            context={})


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Times every RPC made on the channel and reports it to Locust as ``<method> <label>``."""

    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self.label = ""  # the user's current task: one statistics row per method and task

    def _timed(self, details: grpc.ClientCallDetails) -> _Timed:
        method = details.method.rsplit("/", 1)[-1]
        return _Timed(self.environment, f"{method} {self.label}".strip())

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        timed = self._timed(details)
        call = continuation(details, request)
        try:
            timed.length = call.result().ByteSize()
        except grpc.RpcError as e:
            timed.fire(e)
            return call
        timed.fire(None)
        return call

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails,
                               request: Any) -> Iterator[Any]:
        return self._stream(self._timed(details), continuation(details, request))

    @staticmethod
    def _stream(timed: _Timed, call: Iterator[Any]) -> Iterator[Any]:
        try:
            for message in call:
                timed.length += message.ByteSize()
                yield message
        except grpc.RpcError as e:
            timed.fire(e)
            raise
        timed.fire(None)


class TranslatorUser(User):
    """One client with its own channel, sending a weighted mix of requests."""

    abstract = "grpc" not in PROTOCOLS
    host = "127.0.0.1:50051"
    wait_time = between(*(float(x) for x in os.environ.get("NMT_LOCUST_WAIT", "0,0.2").split(",")))
    short_texts, long_texts = load_texts(os.environ.get("NMT_LOCUST_TEXTS"))
    beam = int(os.environ.get("NMT_LOCUST_BEAM", 4))
    nbest = int(os.environ.get("NMT_LOCUST_NBEST", 3))
    batch_texts = int(os.environ.get("NMT_LOCUST_BATCH_TEXTS", 8))
    timeout = env_float("NMT_LOCUST_TIMEOUT", 30.0)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        env = {flag: os.environ.get(client_env(flag), "") for flag in
               ("--tls-ca-file", "--tls-cert-file", "--tls-key-file", "--tls-server-name", "--token-file")}
        self.channel = open_channel(self.host, ca_file=env["--tls-ca-file"],
                                    cert_file=env["--tls-cert-file"], key_file=env["--tls-key-file"],
                                    server_name=env["--tls-server-name"])
        self.metadata = auth_metadata(env["--token-file"])
        self.interceptor = LocustInterceptor(environment)
        self.stub = pb_grpc.TranslatorStub(grpc.intercept_channel(self.channel, self.interceptor))

    def on_stop(self) -> None:
        self.channel.close()

    def translate(self, label: str, texts: list[str], **options: Any) -> pb.TranslateResponse:
        self.interceptor.label = label
        request = pb.TranslateRequest(texts=texts, options=pb.DecodingOptions(**options))
        try:
            reply = self.stub.Translate(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError:
            return pb.TranslateResponse()  # already reported as a failure by the interceptor
        if len(reply.translations) != len(texts):
            raise AssertionError(f"{len(texts)} texts, {len(reply.translations)} translations")
        return reply

    def short_greedy(self) -> None:
        self.translate("short", [random.choice(self.short_texts)])

    def long_greedy(self) -> None:
        self.translate("long", [random.choice(self.long_texts)])

    def beam_search(self) -> None:
        self.translate("beam", [random.choice(self.short_texts + self.long_texts)], beam_size=self.beam)

    def nbest_list(self) -> None:
        reply = self.translate("nbest", [random.choice(self.short_texts)], beam_size=self.beam,
                               num_hypotheses=self.nbest, return_scores=True)
        if reply.translations and len(reply.translations[0].hypotheses) != self.nbest:
            raise AssertionError(f"asked for {self.nbest} hypotheses, got "
                                 f"{len(reply.translations[0].hypotheses)}")

    def batch_request(self) -> None:
        texts = random.choices(self.short_texts, k=self.batch_texts - 1) + [random.choice(self.long_texts)]
        self.translate("batch", texts)

    def streamed(self) -> None:
        self.interceptor.label = "long"
        request = pb.TranslateRequest(texts=[random.choice(self.long_texts)])
        try:
            last = None
            for last in self.stub.TranslateStream(request, timeout=self.timeout, metadata=self.metadata):
                pass
        except grpc.RpcError:
            return
        if last is None or last.kind != pb.RESULT_KIND_FINAL:
            raise AssertionError("stream ended without a final answer")

    # Locust reads `tasks` when the class is made: {task: weight}, weight 0 = off.
    _weights = parse_weights(os.environ.get("NMT_LOCUST_WEIGHTS", ""))
    tasks = {fn: weight for fn, weight in [
        (short_greedy, _weights["short"]), (long_greedy, _weights["long"]),
        (beam_search, _weights["beam"]), (nbest_list, _weights["nbest"]),
        (batch_request, _weights["batch"]), (streamed, _weights["stream"])] if weight > 0}


@events.init.add_listener
def refresh_clock(**_: Any) -> None:
    """gevent's loop caches "now" once per iteration: after a slow start (imports on a busy
    CPU) it is stale, and Locust's --run-time timer, set next, would fire that much early."""
    gevent.get_hub().loop.update_now()


@events.quitting.add_listener
def check_targets(environment: Environment, **_: Any) -> None:
    """Exit 1 when the run missed its targets (failure ratio, p99 latency)."""
    total = environment.stats.total
    max_fail_ratio = env_float("NMT_LOCUST_MAX_FAIL_RATIO", 0.0)
    max_p99_ms = os.environ.get("NMT_LOCUST_MAX_P99_MS")
    missed = []
    if total.fail_ratio > max_fail_ratio:
        missed.append(f"failure ratio {total.fail_ratio:.4f} > {max_fail_ratio}")
    if max_p99_ms and total.get_response_time_percentile(0.99) > float(max_p99_ms):
        missed.append(f"p99 {total.get_response_time_percentile(0.99):.0f} ms > {max_p99_ms} ms")
    if missed:
        print("targets missed: " + "; ".join(missed))
        environment.process_exit_code = 1


class HttpTranslatorUser(HttpUser):
    """The same mix over the HTTP/JSON API (``service/api/http_server.py``); Locust's own HTTP
    statistics, one row per endpoint and task."""

    abstract = "http" not in PROTOCOLS
    host = os.environ.get("NMT_LOCUST_HTTP_HOST", "http://127.0.0.1:8080")
    wait_time = TranslatorUser.wait_time
    short_texts, long_texts = TranslatorUser.short_texts, TranslatorUser.long_texts
    beam, nbest, batch_texts, timeout = (TranslatorUser.beam, TranslatorUser.nbest,
                                         TranslatorUser.batch_texts, TranslatorUser.timeout)

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        if "grpc" in PROTOCOLS:  # --host is the gRPC users' address then
            self.client.base_url = os.environ.get("NMT_LOCUST_HTTP_HOST", "http://127.0.0.1:8080")
        self.headers = {"X-Request-Timeout": str(self.timeout),
                        **dict(auth_metadata(os.environ.get(client_env("--token-file"), "")) or ())}
        ca_file = os.environ.get(client_env("--tls-ca-file"))
        if ca_file:  # https:// in NMT_LOCUST_HTTP_HOST; the same CA as the gRPC users'
            self.client.verify = ca_file

    def translate(self, label: str, texts: list[str], **options: Any) -> pb.TranslateResponse:
        with self.client.post("/v1/translate", json={"texts": texts, "options": options},
                              name=f"Translate {label}", headers=self.headers, timeout=self.timeout,
                              catch_response=True) as reply:
            if reply.status_code != 200:
                reply.failure(f"{reply.status_code}: {reply.text[:200]}")
                return pb.TranslateResponse()
            answer = json_format.ParseDict(reply.json(), pb.TranslateResponse())
            if len(answer.translations) != len(texts):
                reply.failure(f"{len(texts)} texts, {len(answer.translations)} translations")
            return answer

    def streamed(self) -> None:
        with self.client.post("/v1/translate:stream", json={"texts": [random.choice(self.long_texts)]},
                              name="TranslateStream long", headers=self.headers, timeout=self.timeout,
                              catch_response=True) as reply:  # timed to the stream's end
            events = [line for line in reply.iter_lines(decode_unicode=True) if line.startswith("event: ")]
            if reply.status_code != 200 or not events or events[-1] != "event: final":
                reply.failure(f"{reply.status_code}: stream ended with {events[-1:] or 'nothing'}")

    # the gRPC user's weighted task list (Locust expanded its weights), its stream task ours
    tasks = []
    for _task in TranslatorUser.tasks:
        tasks.append(streamed if _task.__name__ == "streamed" else _task)
    del _task
