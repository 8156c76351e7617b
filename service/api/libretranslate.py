"""LibreTranslate's HTTP API on the HTTP port, over the same front door: the tools that speak it
(Weblate's LibreTranslate backend, ``libretranslatepy``, npm's ``libretranslate``, browser
extensions) use nmt-serve with a changed URL and nothing else.

- ``POST /translate``: JSON or form body: ``q`` (a string or a list), ``source`` (a code or
  ``auto``), ``target``, ``format`` (``text``/``html``), ``alternatives``, ``api_key`` ->
  ``translatedText`` (a string or a list, as ``q`` was), ``alternatives`` when asked, and
  ``detectedLanguage`` (``{"language", "confidence"}``, a list of them for a list ``q``) with ``auto``
- ``GET|POST /languages``: ``[{"code", "name", "targets"}]``, the served directions
- ``POST /detect``: ``[{"language", "confidence"}]``, the served source languages ranked
- ``GET /frontend/settings``: limits and whether a key is required

Errors are ``{"error": "..."}`` with LibreTranslate's statuses: 400 (the front door's message,
naming the field, the limit and the value; ``texts`` reads ``q`` here), 403 (a missing or wrong
``api_key``, checked against the token file like ``Authorization: Bearer``, which is accepted
too; never logged nor echoed), 429 (the queue is full) and 500. ``/languages`` and
``/frontend/settings`` need no key, as in LibreTranslate (Weblate asks for the languages without
one); they tell only which languages are served. Translations use beam search
(``BEAM``, at most ``--max-beam``); ``alternatives`` asks for that many more hypotheses.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable, Sequence

from aiohttp import web

from service import languages
from service.api import http_json
from service.api.auth import Authorize
from service.api.frontend import OK, Frontend, status
from service.api.http_errors import HttpError, read_body
from service.errors import ErrorKind, NmtError, invalid
from service.options import DecodingOptions
from service.text import html_segments, language_id

log = logging.getLogger("nmt.libretranslate")

BEAM = 4
"""Beams per text (at most ``--max-beam``): localizers want the better translation."""
FORMATS = ("text", "html")
HTTP = {ErrorKind.INVALID_ARGUMENT: 400, ErrorKind.NOT_FOUND: 400, ErrorKind.UNAUTHENTICATED: 403,
        ErrorKind.RESOURCE_EXHAUSTED: 429}
"""LibreTranslate's statuses; every other kind is 500."""


class LtError(Exception):
    """An answer ``{"error": message}`` with ``http_status``."""

    def __init__(self, message: str, http_status: int = 400) -> None:
        super().__init__(message)
        self.http_status = http_status


class LibreTranslate:
    """LibreTranslate's routes over one front door and the HTTP transport's token check."""

    def __init__(self, frontend: Frontend, authorize: Authorize, *, keys_required: bool) -> None:
        self.frontend, self.authorize, self.keys_required = frontend, authorize, keys_required

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/translate", self._observed("LibreTranslate.translate", self._translate)),
                web.post("/detect", self._observed("LibreTranslate.detect", self._detect)),
                web.get("/languages", self._observed("LibreTranslate.languages", self._languages, key=False)),
                web.post("/languages", self._observed("LibreTranslate.languages", self._languages, key=False)),
                web.get("/frontend/settings", self._observed("LibreTranslate.settings", self._settings,
                                                             key=False))]

    # ------------------------------------------------------------------ plumbing

    def _observed(self, method: str, handler: Callable[[dict], Awaitable[Any]], *, key: bool = True
                  ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def observed(request: web.Request) -> web.Response:
            metrics, code = self.frontend.metrics, OK
            try:
                with metrics.request_duration.labels(method=method, protocol="http").time():
                    params = await _params(request)
                    if key:
                        self._check_key(params, request)
                    params["client"] = self._client(params, request)
                    return web.json_response(await handler(params), dumps=_dumps)
            except (LtError, HttpError) as e:  # HttpError: a body that cannot be read
                code = "INVALID_ARGUMENT" if e.http_status == 400 else str(e.http_status)
                return _error(str(e), e.http_status, close=isinstance(e, HttpError) and e.close)
            except web.HTTPRequestEntityTooLarge:
                code = status(ErrorKind.RESOURCE_EXHAUSTED).name
                return _error(f"request body must be at most {request.app._client_max_size} bytes", 413)
            except Exception as e:  # NmtError by its kind; anything else is a bug (logged)
                error = self.frontend.failure(e, method=method)
                code = status(error.kind).name
                return _error(_lt_fields(error.message), HTTP.get(error.kind, 500))
            finally:
                metrics.requests.labels(method=method, code=code, protocol="http").inc()
        return observed

    def _check_key(self, params: dict, request: web.Request) -> None:
        """``api_key`` against the token file (or the Authorization header when there is none)."""
        key = params.get("api_key")
        headers = {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else request.headers
        try:
            self.authorize(headers)
        except NmtError:
            raise LtError("Invalid API key" if key else "Missing api_key (or Authorization: Bearer)", 403) from None

    def _client(self, params: dict, request: web.Request) -> str:
        key = params.get("api_key")
        authorization = f"Bearer {key}" if isinstance(key, str) and key else request.headers.get("Authorization")
        return self.frontend.client(authorization=authorization, peer=request.remote or "",
                                    client_id=request.headers.get("X-Client-Id"))

    def _served(self) -> list[tuple[str, str]]:
        return [m.manifest.languages for m in self.frontend.served()]

    # ------------------------------------------------------------------ routes

    async def _languages(self, params: dict) -> list[dict]:
        targets: dict[str, list[str]] = {}
        for source, target in self._served():
            if source and target and target not in targets.setdefault(source, []):
                targets[source].append(target)
        codes = list(dict.fromkeys([*targets, *(t for ts in targets.values() for t in ts)]))
        return [{"code": c, "name": languages.name(c), "targets": targets.get(c, [])} for c in codes]

    async def _settings(self, params: dict) -> dict:
        limits = self.frontend.config.limits
        pairs = self._served()
        source, target = pairs[0] if pairs else ("", "")
        return {"apiKeys": self.keys_required, "keyRequired": self.keys_required,
                "charLimit": limits.max_text_chars, "frontendTimeout": 500, "suggestions": False,
                "filesTranslation": False, "supportedFilesFormat": [],
                "language": {"source": {"code": source, "name": languages.name(source)},
                             "target": {"code": target, "name": languages.name(target)}}}

    async def _detect(self, params: dict) -> list[dict]:
        q = _texts(params)[0]
        await language_id.load()
        guesses = language_id.rank(" ".join(q), self._sources(""))
        if not guesses:
            raise LtError(f"q: the text matches none of the served source languages "
                          f"({', '.join(self._sources('')) or 'none'})")
        return [{"language": g.language, "confidence": g.confidence} for g in guesses]

    def _sources(self, target: str) -> list[str]:
        """Served source languages (the default model's first), of pairs into ``target`` if given."""
        return list(dict.fromkeys(s for s, t in self._served() if s and (not target or t == target)))

    async def _translate(self, params: dict) -> dict:
        texts, as_list = _texts(params)
        source, target = _code(params, "source"), _code(params, "target")
        fmt = params.get("format") or "text"
        if fmt not in FORMATS:
            raise LtError(f"format must be one of {', '.join(FORMATS)}, got {str(fmt)[:40]!r}")
        options = self._options(params.get("alternatives"))
        detected: list[dict] = []
        sources = [source] * len(texts)
        if source == "auto":
            await language_id.load()
            sources, detected = self._detect_each(texts, target)
        elif source == target:
            raise LtError(f"target must differ from source, got {target!r} for both")
        results = await self._run(texts, sources, target, fmt, options, params["client"])
        first = [r[0] for r in results]
        answer: dict[str, Any] = {"translatedText": first if as_list else first[0]}
        if options.num_hypotheses > 1:
            alternatives = [r[1:] for r in results]
            answer["alternatives"] = alternatives if as_list else alternatives[0]
        if detected:
            answer["detectedLanguage"] = detected if as_list else detected[0]
        return answer

    def _options(self, alternatives: Any) -> DecodingOptions:
        max_beam = self.frontend.config.limits.max_beam_size
        try:
            wanted = int(alternatives or 0)
        except (TypeError, ValueError):
            raise LtError(f"alternatives must be an integer from 0 to {max_beam - 1}, "
                          f"got {str(alternatives)[:40]!r}") from None
        if not 0 <= wanted <= max_beam - 1:
            raise LtError(f"alternatives must be an integer from 0 to {max_beam - 1} (the server's beam "
                          f"limit, --max-beam {max_beam}, less one), got {wanted}")
        beam = min(max(BEAM, wanted + 1), max_beam)
        return DecodingOptions(beam_size=beam, num_hypotheses=wanted + 1)

    def _detect_each(self, texts: Sequence[str], target: str) -> tuple[list[str], list[dict]]:
        candidates = self._sources(target)
        if not candidates:
            raise LtError(f"target must be one of the served targets "
                          f"({', '.join(languages.served_pairs(self._served()))}), got {target!r}")
        sources, detected = [], []
        for i, text in enumerate(texts):
            guesses = language_id.rank(text, candidates)
            if not guesses:
                raise LtError(f"q{f'[{i}]' if len(texts) > 1 else ''}: source auto: the text matches none of "
                              f"the served source languages into {target} ({', '.join(candidates)})")
            sources.append(guesses[0].language)
            detected.append({"language": guesses[0].language, "confidence": guesses[0].confidence})
        return sources, detected

    async def _run(self, texts: Sequence[str], sources: Sequence[str], target: str, fmt: str,
                   options: DecodingOptions, client: str) -> list[list[str]]:
        """Hypotheses of every text, best first; texts of one source language in one request."""
        results: list[list[str]] = [[] for _ in texts]
        for source in dict.fromkeys(sources):
            indexes = [i for i, s in enumerate(sources) if s == source]
            if fmt == "html":
                for i in indexes:
                    results[i] = await self._html(texts[i], source, target, options, client)
                continue
            for i, hyps in zip(indexes, await self._translate_texts([texts[i] for i in indexes], source,
                                                                    target, options, client)):
                results[i] = hyps
        return results

    async def _translate_texts(self, texts: Sequence[str], source: str, target: str,
                               options: DecodingOptions, client: str) -> list[list[str]]:
        admitted = self.frontend.admit_request(texts=texts, options=options, source_language=source,
                                               target_language=target, client=client)
        translations = await self.frontend.translate(admitted, timeout=None)
        return [[h.text for h in t.hypotheses] for t in translations]

    async def _html(self, fragment: str, source: str, target: str, options: DecodingOptions,
                    client: str) -> list[str]:
        """One HTML fragment's hypotheses: hypothesis k joins every segment's k-th (or best)."""
        doc = html_segments.split(fragment)
        if not doc.segments:
            return [fragment] * options.num_hypotheses
        chunk = self.frontend.config.limits.max_texts
        segments: list[list[str]] = []
        for at in range(0, len(doc.segments), chunk):
            segments += await self._translate_texts(doc.segments[at:at + chunk], source, target, options, client)
        return [doc.join([hyps[min(k, len(hyps) - 1)] for hyps in segments])
                for k in range(options.num_hypotheses)]


# ---------------------------------------------------------------------- request parsing


async def _params(request: web.Request) -> dict:
    """The body's fields (JSON object, or a form), then the query string's."""
    params: dict[str, Any] = dict(request.query)
    if request.method != "POST" or not request.can_read_body:
        return params
    if request.content_type == "application/json":
        try:
            body = http_json.loads(await read_body(request))
        except ValueError:
            raise LtError("Invalid request: the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise LtError("Invalid request: the JSON body must be an object")
        params.update(body)
    elif request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
        form = await read_body(request, request.post)
        for name in form:
            values = form.getall(name)
            params[name] = values if len(values) > 1 else values[0]
    return params


def _texts(params: dict) -> tuple[list[str], bool]:
    """``q`` as a list of texts, and whether it was a list."""
    q = params.get("q")
    if q is None or q == "" or q == []:
        raise LtError("q must be a non-empty text or list of texts, got nothing")
    if isinstance(q, list):
        bad = next((i for i, x in enumerate(q) if not isinstance(x, str)), None)
        if bad is not None:
            raise LtError(f"q[{bad}] must be a string, got {type(q[bad]).__name__}")
        return q, True
    if not isinstance(q, str):
        raise LtError(f"q must be a string or a list of strings, got {type(q).__name__}")
    return [q], False


def _code(params: dict, name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value.strip():
        raise LtError(f"{name} must be a language code{' or auto' if name == 'source' else ''}, got "
                      f"{'nothing' if value is None else repr(str(value)[:40])}")
    return "auto" if value.strip().lower() == "auto" else languages.normalize(value)


def _lt_fields(message: str) -> str:
    """The front door's message with LibreTranslate's field names (``texts[2]`` -> ``q[2]``)."""
    for ours, theirs in (("texts", "q"), ("source_language", "source"), ("target_language", "target")):
        if message.startswith(ours):
            return theirs + message[len(ours):]
    return message


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _error(message: str, http_status: int, *, close: bool = False) -> web.Response:
    response = web.json_response({"error": message}, status=http_status, dumps=_dumps)
    if close:  # the rest of the request cannot be framed
        response.force_close()
    return response
