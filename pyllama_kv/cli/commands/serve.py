"""`pyllama-kv serve`: an OpenAI-compatible HTTP server over the generation engine (pyllama_kv.server).

This command only maps its flags onto EngineConfig and ServerConfig, opens the model, binds the
socket, prints one startup line, and runs the server until SIGINT/SIGTERM (then exits 0).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .. import options
from ..common import (
    MODEL_HELP,
    CLIError,
    UsageError,
    add_lib_flag,
    chat_template,
    context_size,
    open_draft_model,
    open_model,
    positive,
    read_template,
    set_phase,
    setup_logging,
)
from ..render import log

API_KEY_ENV = "PYLLAMA_KV_API_KEY"


def _flags() -> None:
    """The server's own options (ServerConfig), defined on its dataclass fields here so that
    cli/options.py does not import the server package."""
    from ...replicas.config import ROUTER_NAMES, ReplicasConfig
    from ...server import ServerConfig

    Flag = options.Flag
    for f in (
        Flag(ServerConfig, "host", ("--host",), "address to listen on (default {default}: this machine only)", str),
        Flag(ServerConfig, "port", ("--port",), "port to listen on, 0 for any free one (default {default})"),
        Flag(ServerConfig, "api_key", ("--api-key",), "require 'Authorization: Bearer KEY' on every endpoint but "
             f"/health (default: ${API_KEY_ENV} if set, else no key)", str, metavar="KEY"),
        Flag(ServerConfig, "max_body", ("--max-body",), "largest request body in bytes; larger ones get HTTP 413 "
             "(default {default})", metavar="BYTES"),
        Flag(ServerConfig, "body_timeout", ("--body-timeout",), "seconds a client may take to send a request body; "
             "slower ones get HTTP 408 (default {default})", float, metavar="SECONDS"),
        Flag(ServerConfig, "shutdown_grace", ("--shutdown-grace",), "seconds running requests get to finish on "
             "SIGINT/SIGTERM before they are cancelled (default {default})", float, metavar="SECONDS"),
        Flag(ServerConfig, "kv_events", ("--kv-events",), "publish the prefix cache's changes on this ZeroMQ "
             "endpoint (tcp://HOST:PORT) in vLLM's KV-event format, for routers that read them (llm-d, Dynamo, "
             "Ray); needs the events extra (default: off)", str, metavar="ENDPOINT"),
        Flag(ServerConfig, "kv_events_block_size", ("--kv-events-block-size",), "tokens a KV-event block "
             "holds (default {default}, as vLLM); with --replicas, also the routing's block", metavar="N"),
        Flag(ReplicasConfig, "replicas", ("--replicas",), "run N engine replicas on Ray Serve behind one HTTP "
             "ingress, each request routed by --router (needs the replicas extra; default: one server in this "
             "process, no Ray)", metavar="N"),
        Flag(ReplicasConfig, "router", ("--router",), "with --replicas: prefix (the replica that caches the "
             "longest run of the prompt's leading blocks, unless its queue is long), round-robin, or pow2 "
             "(Ray's power of two choices) (default {default})", str, choices=ROUTER_NAMES),
        Flag(ReplicasConfig, "ray_address", ("--ray-address",), "with --replicas: the Ray cluster to join "
             "(default: $RAY_ADDRESS, else a local Ray started here)", str, metavar="ADDRESS"),
        Flag(ReplicasConfig, "replica_cpus", ("--replica-cpus",), "with --replicas: CPUs Ray reserves for each "
             "replica (default {default})", float, metavar="N"),
        Flag(ReplicasConfig, "replica_gpus", ("--replica-gpus",), "with --replicas: GPUs Ray reserves for each "
             "replica (default {default})", float, metavar="N"),
    ):
        options.FLAGS.setdefault(f.field, f)


def register(subparsers) -> None:
    _flags()
    s = subparsers.add_parser(
        "serve",
        description="Serve MODEL over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, "
                    "/v1/embeddings), llama-server's /v1/rerank (a reranker GGUF), /tokenize, /detokenize and "
                    "/apply-template, Ollama's /api/embed, plus /health and Prometheus /metrics. "
                    "Requests are batched together over one KV cache: "
                    "prompts are evaluated in chunks between generation steps, shared prefixes (system prompts, "
                    "conversations) are forked instead of evaluated again, and requests that do not fit wait "
                    "in a bounded queue (HTTP 429 when it is full). Listens on 127.0.0.1 unless --host says "
                    "otherwise. Stops on SIGINT/SIGTERM: running requests get --shutdown-grace seconds.")
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("--template", metavar="FILE",
                   help="a jinja2 chat template to render every chat with instead of the model's (in the same "
                        "sandbox); needed for chats when the model has none; checked at start")
    options.add(s, "host", "port", "api_key", "n_ctx", "parallel", "max_queue", "max_tokens", "prefix_cache",
                "cache_ram", "cache_dir", "cache_dir_mib",
                "n_batch", "type_k", "type_v", "flash_attn", "n_threads", "max_body", "body_timeout", "shutdown_grace",
                "kv_events", "kv_events_block_size", "n_gpu_layers", "rpc", "validate", "pooling",
                "trust_unverified", "spec", "spec_max", "draft_model", "backend_sampling", "pipeline",
                "replicas", "router", "ray_address", "replica_cpus", "replica_gpus",
                defaults={"n_ctx": None},
                helps={"n_ctx": "KV cache cells, shared by every request " + options.CTX_DEFAULT_HELP,
                       "max_queue": "requests waiting for admission; more get HTTP 429 (default {default})"})
    add_lib_flag(s)


def _open_engine(model, ecfg, args):
    """(the engine over ``model``, --draft-model's model or None: the caller closes it after the engine)."""
    from ...engine import Engine
    from ...errors import InvalidInputError

    set_phase("loading the draft model")
    draft = open_draft_model(model, args.draft_model, args.trust_unverified, args.validate)
    set_phase("creating the context")
    try:
        return Engine(model, ecfg, draft_model=draft), draft
    except InvalidInputError as exc:   # a draft model of another vocabulary; sampling in the graph refused
        if draft is not None:
            draft.close()
        flag = "--backend-sampling" if "backend_sampling" in str(exc) else "--draft-model"
        raise CLIError(f"{flag}: {exc}") from None


def _model_names(spec: str, path: Path) -> list[str]:
    """The names a request's ``model`` may use: the id /v1/models lists first (the catalogue name, or
    the file's stem), then the MODEL argument as given and the file's name."""
    model_id = path.stem if Path(spec).exists() else spec   # a catalogue name, or the file's stem
    return list(dict.fromkeys([model_id, spec, path.name, path.stem]))


def _check_reranker(model) -> None:
    """CLIError unless ``model`` can rank (``--pooling rank``)."""
    from ...core.embedding import check_reranker
    from ...errors import InvalidInputError

    try:
        check_reranker(model)
    except InvalidInputError as exc:
        raise CLIError(f"--pooling rank: {exc}") from None


def run(args) -> int:
    from ...config import EngineConfig
    from ...server import ServerConfig

    setup_logging(args.debug)
    if not args.debug:   # the server's own errors (their tracebacks never reach a client) go to stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pyllama-kv serve: %(levelname)s: %(message)s"))
        logging.getLogger("pyllama_kv.server").addHandler(handler)
    positive("--ctx", args.n_ctx)
    positive("-t", args.n_threads)
    if args.api_key is None and os.environ.get(API_KEY_ENV):
        args.api_key = os.environ[API_KEY_ENV]
    scfg = options.from_args(ServerConfig, args)
    source = read_template(args.template)
    try:   # the server needs the [server] extra
        from ...server import app as server_app
    except ImportError as exc:
        raise CLIError(f"serve needs the server extra ({exc.name} is missing): pip install 'pyllama-kv[server]'") \
            from None
    if args.replicas:
        return _serve_replicas(args, scfg, source)
    set_phase("loading the model")
    path = Path(options.model_path(args.model, args.trust_unverified))
    model = open_model(str(path), args.lib, args.rpc, args.validate, args.n_gpu_layers)
    draft = None
    try:
        template_name = None
        if source is not None:   # a broken or refused template stops the start, with one line saying why
            template_name = chat_template(model, source, args.template).name
        n_ctx = context_size(model, args.n_ctx)
        ecfg = options.from_args(EngineConfig, args, n_ctx=n_ctx)
        if ecfg.pooling == "rank":   # a clear refusal now, not a 400 on every /v1/rerank
            _check_reranker(model)
        engine, draft = _open_engine(model, ecfg, args)
        try:
            server = server_app.Server(model, engine, scfg, _model_names(args.model, path),
                                       library=model.library.get("variant"), template=source,
                                       template_name=template_name)
            try:
                sock = server_app.bind(scfg.host, scfg.port)
            except OSError as exc:
                raise CLIError(f"cannot listen on {scfg.host}:{scfg.port}: {exc.strerror or exc}") from None
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log(f"pyllama-kv serve: http://{shown}:{port}/v1  model {server.model_id} "
                f"(library {server.library or '?'}), ctx {ecfg.n_ctx}, parallel {ecfg.parallel}"
                + (", API key required" if scfg.api_key else "")
                + (f", KV events on {server.kv_events.endpoint}" if server.kv_events is not None else ""))
            set_phase(None)
            if not server_app.run(server, sock, debug=args.debug):
                raise CLIError("the server did not start (see the messages above)")
        finally:
            engine.close()
    finally:
        if draft is not None:
            draft.close()
        model.close()
    log("pyllama-kv serve: stopped")
    return 0


def _serve_replicas(args, scfg, source: str | None) -> int:
    """``serve --replicas N``: the same server in N Ray Serve replicas behind one ingress
    (pyllama_kv.replicas.ray_serve), until SIGINT/SIGTERM."""
    import signal
    import threading
    from dataclasses import asdict

    from ...config import EngineConfig
    from ...replicas.config import ReplicasConfig

    rcfg = options.from_args(ReplicasConfig, args)
    if args.draft_model is not None or args.rpc is not None:
        raise UsageError(f"--replicas does not take {'--draft-model' if args.draft_model else '--rpc'} yet: run "
                         "one server for it")
    try:
        from ...replicas import ray_serve
    except ImportError as exc:
        raise CLIError(f"--replicas needs the replicas extra ({exc.name} is missing): "
                       "pip install 'pyllama-kv[replicas]'") from None
    path = Path(options.model_path(args.model, args.trust_unverified))
    engine = options.values(EngineConfig, args)   # (n_ctx None: each replica takes the model's default)
    options.build(EngineConfig, **{**engine, "n_ctx": engine.get("n_ctx") or 4096})   # the flags' errors, now
    if engine.get("pooling") == "rank":
        raise UsageError("--replicas serves generating models: run one server for a reranker")
    scfg_d = asdict(scfg)
    spec = ray_serve.ReplicaSpec(model=str(path), names=tuple(_model_names(args.model, path)), lib=args.lib,
                                 engine=engine, server=scfg_d, template=source, template_name=args.template,
                                 validate=args.validate or "full", trust_unverified=args.trust_unverified,
                                 n_gpu_layers=args.n_gpu_layers, block_size=scfg.kv_events_block_size)
    port = scfg.port or _free_port(scfg.host)
    import ray

    if not args.debug:   # Ray's and Serve's own INFO lines (one per request in Serve's) are for --debug
        for name in ("ray", "ray.serve"):
            logging.getLogger(name).setLevel(logging.WARNING)
    started_ray = not ray.is_initialized() and not (rcfg.ray_address or os.environ.get("RAY_ADDRESS"))
    set_phase(f"starting {rcfg.replicas} replicas on Ray Serve")
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            url = ray_serve.start(spec, replicas=rcfg.replicas, router=rcfg.router, address=rcfg.ray_address,
                                  host=scfg.host, port=port, replica_cpus=rcfg.replica_cpus,
                                  replica_gpus=rcfg.replica_gpus, stats_period=rcfg.routing_period)
        except Exception as exc:   # noqa: BLE001 - Ray's own errors (a replica that cannot start says why)
            raise CLIError(f"the replicas did not start: {str(exc).strip().splitlines()[-1] if str(exc) else exc}") \
                from None
        log(f"pyllama-kv serve: {url}/v1  model {spec.names[0]}, {rcfg.replicas} replicas on Ray Serve "
            f"(router {rcfg.router}, Ray {rcfg.ray_address or os.environ.get('RAY_ADDRESS') or 'local'})"
            + (", API key required" if scfg.api_key else ""))
        set_phase(None)
        while not stop.wait(0.5):
            pass
    finally:
        ray_serve.stop(started_ray)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    log("pyllama-kv serve: stopped")
    return 0


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
