"""The server's plumbing, the base of :class:`~pyllama_kv.server.app.Server` (one object): its lifecycle
(the lifespan that starts and closes the engine, the graceful shutdown), routes that authenticate and
map errors, and the request body read within its bounds (size, time) and decoded off the event loop.
The endpoints are app.py's."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from . import messages, protocol
from .config import ServerConfig
from .metrics import Metrics
from .protocol import APIError
from .relay import error_response as _error

if TYPE_CHECKING:
    from ..engine import Engine
    from .kvevents import KVEventPublisher

log = logging.getLogger("pyllama_kv.server")


class _Gone(Exception):
    """The client went away (``stage``: "body" while its request body was being read)."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


async def read_body(request: HTTPRequest, cap: int, timeout: float) -> bytearray:
    """A request's body, at most ``cap`` bytes (an APIError 413 beyond, from its Content-Length when
    it says so), sent within ``timeout`` seconds (an APIError 408 after: a client that stops sending,
    slowloris, must not hold its connection and handler for ever); _Gone("body") when the client
    closed the connection before it was all sent. The server's, and ``serve --replicas``' ingress's."""
    too_big = APIError(413, f"the request body is larger than {cap} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    data = bytearray()

    async def read() -> None:
        async for part in request.stream():
            data.extend(part)
            if len(data) > cap:
                raise too_big

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds", code="timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:   # it closed the connection before its Content-Length was sent
        raise _Gone("body") from None
    return data


class ServerBase:
    """Lifecycle and plumbing of a :class:`~pyllama_kv.server.app.Server`, whose ``__init__`` sets what
    is declared here."""

    engine: Engine
    config: ServerConfig
    metrics: Metrics
    shutting_down: bool
    _grace: threading.Timer | None
    _key_digest: bytes
    kv_events: KVEventPublisher | None

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine's loop (the app's lifespan does; a host that calls the app without its
        lifespan, such as a Ray Serve replica, calls this and :meth:`close` itself)."""
        self.engine.start(on_step=self.kv_events.on_step if self.kv_events is not None else None)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app) -> AsyncIterator[None]:
        self.start()
        try:
            yield
        finally:
            self.shutting_down = True
            await run_in_threadpool(self.close)

    def close(self) -> None:
        """Close the engine (and its context), after a grace timer that may be stopping it: the app's
        lifespan ends with it, and :func:`run` calls it again (a no-op then) for a server whose
        lifespan never started."""
        if self._grace is not None:   # not two threads stopping the engine at once
            self._grace.cancel()
            self._grace.join()
        self.engine.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def begin_shutdown(self) -> None:
        """The first SIGINT/SIGTERM: refuse new requests; cancel what still runs after the grace time."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self._grace = threading.Timer(self.config.shutdown_grace, self.engine.stop, kwargs={"cancel": True})
        self._grace.daemon = True
        self._grace.start()

    # -- plumbing -------------------------------------------------------------------------------

    def _route(self, path: str, fn, method: str, auth: bool = True, errors=_error) -> Route:
        """``path`` answered by ``fn`` (errors written by ``errors``: OpenAI's object, or Anthropic's on
        its endpoints), counted per path and status in ``pyllama_kv_http_requests_total``."""
        async def handler(request: HTTPRequest) -> Response:
            response = await self._handle(request, fn, auth, errors)
            self.metrics.http_requests.labels(path, str(response.status_code)).inc()
            return response
        return Route(path, handler, methods=[method])

    async def _handle(self, request: HTTPRequest, fn, auth: bool, errors) -> Response:
        try:
            if auth:
                self._auth(request)
            return await fn(request)
        except APIError as e:
            return errors(e)
        except _Gone as e:   # nobody is there to read an answer, and nothing went wrong here
            self.metrics.client_disconnects.labels(e.stage).inc()
            return Response(status_code=499)
        except Exception:
            log.exception("error while serving %s %s", request.method, request.url.path)
            self.metrics.internal_errors.inc()
            return errors(APIError(500, "internal server error (see the server's log)", "server_error"))

    def _auth(self, request: HTTPRequest) -> None:
        """The API key, as ``Authorization: Bearer KEY`` or (Anthropic's clients) ``x-api-key: KEY``."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        # compared as digests: in constant time, and without giving away the key's length
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        if not hmac.compare_digest(digest, self._key_digest):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _http_error(self, request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        errors = messages.error_response if request.url.path.startswith("/v1/messages") else _error
        return errors(APIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})))

    async def _internal_error(self, request: HTTPRequest, exc: Exception) -> Response:
        log.error("error while serving %s %s", request.method, request.url.path, exc_info=exc)
        self.metrics.internal_errors.inc()
        return _error(APIError(500, "internal server error (see the server's log)", "server_error"))

    async def _body(self, request: HTTPRequest):
        cfg = self.config
        data = await read_body(request, cfg.max_body, cfg.body_timeout)
        return await run_in_threadpool(self._json, data)   # (per-item work: never on the event loop)

    @staticmethod
    def _json(data: bytes | bytearray):
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            raise protocol.bad(None, "the request body is not valid JSON", code="invalid_json") from None
