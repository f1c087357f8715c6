"""pyllama-kv on Ray Serve: N engine replicas behind one ingress, each request sent where its prompt
is cached (``pyllama-kv serve MODEL --replicas N``; needs the ``replicas`` extra, ``ray[serve]``).

Two deployments make one application (:func:`application`):

* :class:`EngineReplica` (N replicas): a whole ``pyllama-kv serve`` in-process — the model, the
  engine with its prefix cache, and the server's ASGI app, called without a socket
  (:meth:`EngineReplica.handle`: one HTTP request in, its response's start and body parts out, as a
  stream; the response names the replica in ``x-pyllama-kv-replica``: Ray Serve's replica id).
  Every endpoint, the API key, the limits, the errors and streaming are the server's own.
  Each replica reports to the routers, every ``stats_period`` seconds, its load (requests running and
  waiting) and every block of ``block_size`` tokens its prefix cache holds, on the device, in host
  memory and on disk (:meth:`EngineReplica.record_routing_stats`, the same chained block hashes as
  its KV events, :mod:`pyllama_kv.prefixcache.events`).
* :class:`Ingress` (one replica): Ray Serve's HTTP proxy hands it every request. It reads the body
  (at most ``max_body`` bytes), tokenizes its prompt as a replica would (:class:`RouteKeys`, on the
  model's vocabulary alone) and calls the engine replicas' handle with the tokens as the routing
  key (a request that continues, reads or deletes a stored Responses answer goes to the replica that
  stored it: the ingress remembers the last ``OWNERS_MAX`` ids). A replica that dies before its
  answer starts is a 503 with ``Retry-After`` (OpenAI's error object); one that dies mid-stream ends
  the stream with an ``error`` event: never a hang, and never a request without an answer.

The handle's request router is :class:`CacheRequestRouter` (``router="prefix"``): the ranking of
:class:`~pyllama_kv.replicas.routing.CacheRouter` — the longest cached run of the request's leading
blocks first, unless that replica's queue is ``max_imbalance`` longer than the least loaded one's;
new prefixes by rendezvous hash among the least loaded — over Ray's own queue lengths.
``"round-robin"`` and ``"pow2"`` (Ray's default: power of two choices by queue length) are there to
compare with.

In your own Ray Serve application: ``app = application(ReplicaSpec(model=PATH, ...))`` and
``serve.run(app)``, or bind :class:`EngineReplica` yourself and route to it with the router class
path ``"pyllama_kv.replicas.ray_serve.CacheRequestRouter"``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..server.base import _Gone, read_body
from ..server.protocol import APIError
from ..server.relay import error_response
from .routing import CacheRouter

log = logging.getLogger("pyllama_kv.replicas")

__all__ = ["ROUTERS", "CacheRequestRouter", "EngineReplica", "Ingress", "ReplicaSpec", "application"]

#: --router's choices (config.ROUTER_NAMES): their request router classes (None: Ray's default, power of
#: two choices)
ROUTERS = {"prefix": "pyllama_kv.replicas.ray_serve.CacheRequestRouter",
           "round-robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
           "pow2": None}
#: the application's name in Ray Serve
APP_NAME = "pyllama-kv"
#: the response header that names the replica that answered (Ray Serve's replica id)
REPLICA_HEADER = "x-pyllama-kv-replica"
#: Responses answers whose replica the ingress remembers (Ingress.owners)
OWNERS_MAX = 100_000
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')
#: seconds a client is told to wait before retrying a request whose replica died
RETRY_AFTER = 2


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica opens and serves: ``model`` (a GGUF path every node can read), the names
    a request's ``model`` may use (the first is the id /v1/models lists), the library, the engine's
    and the server's options (EngineConfig and ServerConfig fields; ``n_ctx`` None: the model's
    default), a chat template's source, and the routing's block size and load imbalance."""

    model: str
    names: tuple[str, ...] = ()
    lib: str | None = None
    engine: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    template: str | None = None
    template_name: str | None = None
    validate: str = "full"
    trust_unverified: bool = False
    n_gpu_layers: int | None = None
    block_size: int = 16
    max_imbalance: int = 4


def _kv_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Replica ``rank``'s KV-event endpoint: tcp://HOST:PORT+rank (ipc://PATH.rank)."""
    if endpoint is None:
        return None
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{endpoint}.{rank}"


class EngineReplica:
    """One engine replica: the model, the engine and the server's app in this process (see the
    module docstring)."""

    # long: the steps of `pyllama-kv serve` (model, config, engine, server), in a replica
    def __init__(self, spec: ReplicaSpec):
        from ..config import EngineConfig
        from ..core.model import Model
        from ..engine import Engine
        from ..engine.kvevents import KVEventSource
        from ..limits import default_n_ctx
        from ..server import ServerConfig
        from ..server.app import Server

        self.spec = spec
        rank, name = 0, f"pid{os.getpid()}"
        with contextlib.suppress(Exception):   # (outside a replica: rank 0)
            ctx = serve.get_replica_context()
            rank, name = int(getattr(ctx.rank, "rank", 0)), ctx.replica_id.unique_id
        self.rank = rank
        self.name = name   # Ray Serve's replica id (its actor's name ends with it)
        self.model = Model(spec.model, spec.n_gpu_layers, lib=spec.lib, validate=spec.validate,
                           trust_unverified=spec.trust_unverified)
        try:
            eopts = dict(spec.engine)
            if eopts.get("n_ctx") is None:
                eopts["n_ctx"] = default_n_ctx(self.model.n_ctx_train)
            sopts = dict(spec.server)
            sopts["kv_events"] = _kv_endpoint(sopts.get("kv_events"), rank)
            self.engine = Engine(self.model, EngineConfig(**eopts))
            names = list(spec.names) or [os.path.basename(spec.model)]
            self.server = Server(self.model, self.engine, ServerConfig(**sopts), names,
                                 library=self.model.library.get("variant"), template=spec.template,
                                 template_name=spec.template_name)
        except BaseException:
            self.model.close()
            raise
        self.source = KVEventSource(self.engine, spec.block_size)
        self.version = 0
        self.server.start()

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.shutting_down = True
            server.close()
        model = getattr(self, "model", None)
        if model is not None:
            model.close()

    def check_health(self) -> None:
        """Ray Serve's health check: an error when the engine's loop has stopped."""
        if not self.engine.alive:
            raise RuntimeError("the engine's loop is not running")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the routers read (``replica.routing_stats``): ``load`` (requests running and
        waiting), ``blocks`` (every block the prefix cache holds, by medium), ``block_size``,
        ``version`` (a new one for each report), ``rank`` and ``name`` (the replica id)."""
        def read(engine) -> tuple[dict[str, list[int]], int]:
            self.source.poll()   # (only when the cache changed: see KVEventSource)
            held = {m: list(blocks) for m, blocks in self.source.ledger.held.items() if blocks}
            return held, engine.running_requests + engine.waiting
        held, load = await asyncio.wrap_future(self.engine.between_steps(read))
        self.version += 1
        return {"load": load, "blocks": held, "block_size": self.spec.block_size, "version": self.version,
                "rank": self.rank, "name": self.name}

    # long: an ASGI call without a socket: the scope, the receive and send channels, and the relay of
    # the response's parts until the last one (or the caller's cancellation, which is the client leaving)
    async def handle(self, route: dict | None, req: dict) -> AsyncIterator[dict]:
        """Serve one HTTP request (``req``: method, path, query, headers, body) with the server's app;
        yields ``{"status", "headers"}`` first, then ``{"body": bytes}`` parts. ``route`` is the
        routing key the router read (unused here). Cancelling the stream is the client going away."""
        body: bytes = req.get("body", b"")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req["method"], "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(),
                 "query_string": req.get("query", "").encode(), "root_path": "",
                 "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in req.get("headers", [])],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> MutableMapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await out.put(message)

        app = asyncio.ensure_future(self.server.app(scope, receive, send))
        try:
            while True:
                get = asyncio.ensure_future(out.get())
                await asyncio.wait({get, app}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    app.result()   # (raises what the app raised; it ended without a whole response)
                    raise RuntimeError("the app ended without a whole response")
                msg = get.result()
                if msg["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    yield {"status": msg["status"], "headers": headers + [(REPLICA_HEADER, self.name)]}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield {"body": bytes(msg["body"])}
                    if not msg.get("more_body", False):
                        return
        finally:
            gone.set()
            if not app.done():
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(app, 30)


class CacheRequestRouter(RequestRouter):
    """Ray Serve's request router for :class:`EngineReplica`: ranks the candidates with a
    :class:`~pyllama_kv.replicas.routing.CacheRouter` fed by the replicas' reports (module docstring).
    ``request_router_kwargs``: ``block_size`` (the replicas'), ``max_imbalance``."""

    def initialize_state(self, block_size: int = 16, max_imbalance: int = 4, **kwargs) -> None:
        self.router = CacheRouter(block_size, max_imbalance)
        self._versions: dict = {}

    def _refresh(self, candidates: list[RunningReplica]) -> None:
        live = {r.replica_id for r in candidates}
        for rid in [r for r in self._versions if r not in live and r not in self.curr_replicas]:
            self._versions.pop(rid, None)
            self.router.forget(rid)
        for r in candidates:
            st = r.routing_stats or {}
            v = st.get("version")
            if v is not None and self._versions.get(r.replica_id) != v:
                self._versions[r.replica_id] = v
                self.router.replace(r.replica_id, st.get("blocks") or {})
            q = self.replica_queue_len_cache.get(r.replica_id)
            self.router.set_load(r.replica_id, q if q is not None else int(st.get("load", 0)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._refresh(candidate_replicas)
        by_id: dict = {r.replica_id: r for r in candidate_replicas}
        args = pending_request.args if pending_request is not None else None
        key = args[0] if args and isinstance(args[0], dict) else {}
        tokens, want = key.get("tokens"), key.get("replica")
        owner = [r for r in candidate_replicas if want is not None and r.replica_id.unique_id == want]
        if owner:   # a stored Responses conversation: the replica that stored it
            return [owner] + [[r] for r in candidate_replicas if r is not owner[0]]
        route = self.router.rank(tokens or [], list(by_id))
        if tokens:
            self.router.assume(route.order[0], tokens)
        return [[by_id[r]] for r in route.order]


class Ingress:
    """The HTTP side: every request's body read, its prompt tokenized for the router, and the engine
    replicas' answer relayed (see the module docstring)."""

    def __init__(self, engines, spec: ReplicaSpec):
        from ..core.model import Model
        from ..server import ServerConfig
        from .keys import RouteKeys

        self.engines = engines
        self.config = ServerConfig(**spec.server)
        self.vocab = Model(spec.model, lib=spec.lib, validate=spec.validate, trust_unverified=spec.trust_unverified,
                           vocab_only=True)
        #: Responses answers by id -> the replica that stored them (the last OWNERS_MAX): a request that
        #: continues one (previous_response_id), or reads or deletes it, goes there
        self.owners: OrderedDict[str, str] = OrderedDict()
        self.keys = RouteKeys(self.vocab, spec.template, int(spec.engine.get("parallel", 64)),
                              int(spec.engine.get("max_tokens", 1 << 30)))

    def _route(self, method: str, path: str, body: bytes) -> dict:
        """The routing key (on a worker thread: tokenizing takes a while): the prompt's tokens, or the
        replica that stored the Responses answer the request continues, reads or deletes."""
        stored = self.keys.stored_response(path, body)
        if stored:   # (its tokens are not in the body: see RouteKeys.tokens)
            return {"tokens": None, "replica": self.owners.get(stored)}
        return {"tokens": self.keys.tokens(path, body) if method == "POST" else None, "replica": None}

    def _owned(self, first: bytes, replica: str) -> None:
        """Remember which replica stored the Responses answer whose first bytes are ``first``."""
        m = _RESPONSE_ID.search(first[:4096])
        if m is not None:
            rid = m.group(1).decode()
            self.owners[rid] = replica
            self.owners.move_to_end(rid)
            while len(self.owners) > OWNERS_MAX:
                self.owners.popitem(last=False)

    def __del__(self) -> None:
        vocab = getattr(self, "vocab", None)
        if vocab is not None:
            vocab.close()

    async def __call__(self, request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        try:   # the server's own reading of a body: its bounds, its errors
            data = await read_body(request, self.config.max_body, self.config.body_timeout)
        except APIError as e:
            return error_response(e)
        except _Gone:
            return Response(status_code=499)   # nobody is there to read an answer
        body, path = bytes(data), request.url.path
        route = await run_in_threadpool(self._route, request.method, path, body)
        req = {"method": request.method, "path": path, "query": request.url.query,
               "headers": [(k, v) for k, v in request.headers.items()], "body": body}
        stream = self.engines.options(stream=True).handle.remote(route, req)
        try:
            start = await stream.__anext__()
        except Exception as exc:   # noqa: BLE001 - the replica died or could not be reached: retryable
            log.warning("a replica failed before answering %s: %s", request.url.path, exc)
            return error_response(_replica_failed("before answering"))
        headers = dict(start["headers"])
        owner = headers.get(REPLICA_HEADER) if path.startswith("/v1/responses") else None
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(stream, self._owned if owner else None, owner),
                                     status_code=start["status"], headers=headers)
        parts: list[bytes] = []
        try:
            async for part in stream:
                if owner and not parts:
                    self._owned(part["body"], owner)
                parts.append(part["body"])
        except Exception as exc:   # noqa: BLE001
            log.warning("a replica failed while answering %s: %s", request.url.path, exc)
            return error_response(_replica_failed("while answering"))
        headers.pop("content-length", None)
        return Response(b"".join(parts), status_code=start["status"], headers=headers)


def _replica_failed(when: str) -> APIError:
    """The retryable error of a request whose replica died ``when`` (before answering, ...)."""
    return APIError(503, f"the replica serving this request failed {when}; retry it", "server_error",
                    code="replica_failed", headers={"Retry-After": str(RETRY_AFTER)})


async def _relay(stream, owned=None, replica: str | None = None) -> AsyncIterator[bytes]:
    """A streamed answer's parts; a replica that dies mid-stream ends it with an ``error`` event.
    ``owned(first part, replica)``: told the first part (a Responses stream names its id there)."""
    try:
        async for part in stream:
            if owned is not None:
                owned(part["body"], replica)
                owned = None
            yield part["body"]
    except Exception as exc:   # noqa: BLE001
        log.warning("a replica failed mid-stream: %s", exc)
        yield f"event: error\ndata: {json.dumps(_replica_failed('mid-stream').body())}\n\n".encode()


def application(spec: ReplicaSpec, replicas: int = 2, router: str = "prefix", replica_cpus: float = 1.0,
                replica_gpus: float = 0.0, stats_period: float = 1.0, max_ongoing: int | None = None):
    """The Ray Serve application (``serve.run(application(spec))``): ``replicas`` EngineReplicas
    (each with ``replica_cpus`` CPUs and ``replica_gpus`` GPUs reserved, reporting every
    ``stats_period`` seconds) routed by ``router`` (:data:`ROUTERS`), behind one Ingress.
    ``max_ongoing``: requests Ray sends one replica at once (default: its parallel plus its queue,
    which the replica answers with 429 beyond)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    eng = spec.engine
    ongoing = max_ongoing or int(eng.get("parallel", 8)) + int(eng.get("max_queue", 64))
    rcfg: dict[str, Any] = {"request_routing_stats_period_s": stats_period,
                            "request_routing_stats_timeout_s": max(10.0, 4 * stats_period)}
    if ROUTERS[router] is not None:
        rcfg["request_router_class"] = ROUTERS[router]
    if router == "prefix":
        rcfg["request_router_kwargs"] = {"block_size": spec.block_size, "max_imbalance": spec.max_imbalance}
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(  # type: ignore[attr-defined]
        num_replicas=replicas, max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        request_router_config=RequestRouterConfig(**rcfg),
        health_check_period_s=2.0, health_check_timeout_s=10.0,
        graceful_shutdown_timeout_s=float(spec.server.get("shutdown_grace", 5.0)) + 5)
    ingress = serve.deployment(Ingress, name="Ingress").options(  # type: ignore[attr-defined]
        num_replicas=1, max_ongoing_requests=max(1000, ongoing * replicas), ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines.bind(spec), spec)


def start(spec: ReplicaSpec, *, replicas: int, router: str = "prefix", address: str | None = None,
          host: str = "127.0.0.1", port: int = 8080, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
          stats_period: float = 1.0) -> str:
    """Join the Ray cluster at ``address`` (None: ``$RAY_ADDRESS``, else a local Ray started here,
    its services on 127.0.0.1), start Ray Serve's HTTP proxy on ``host:port`` and run the
    application (:func:`application`); returns its URL once every replica is up. Stop with
    :func:`stop`."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized():
        if address is None:   # a local Ray sized for the replicas (Ray counts CPUs as slots, not cores)
            need = int(replicas * replica_cpus + 0.999) + 1
            ray.init(num_cpus=max(os.cpu_count() or 1, need), num_gpus=None if replica_gpus else 0,
                     include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(spec, replicas, router, replica_cpus, replica_gpus, stats_period), name=APP_NAME,
              route_prefix="/")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def stop(started_ray: bool) -> None:
    """Delete the application; shut Serve and Ray down when this process started them (a local Ray)."""
    import ray

    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)
    if started_ray:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
