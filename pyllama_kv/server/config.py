"""The server's own options (the engine's are :class:`~pyllama_kv.config.EngineConfig`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import _Config, _num, int_param
from ..errors import InvalidInputError
from ..limits import KV_EVENT_BLOCK_MAX


@dataclass(frozen=True)
class ServerConfig(_Config):
    """Where the server listens, who may use it, and how much one request may send."""

    host: str = "127.0.0.1"        # this machine only, unless told otherwise
    port: int = 8080               # 0: any free port (the startup line says which)
    api_key: str | None = None     # required as "Authorization: Bearer KEY" on everything but /health
    max_body: int = 1 << 20        # bytes of a request body; more get HTTP 413
    body_timeout: float = 30.0     # seconds a client may take to send its request body; then HTTP 408
    shutdown_grace: float = 5.0    # seconds running requests get to finish on SIGINT/SIGTERM, then cancelled
    kv_events: str | None = None   # a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH) to publish KV events on
    kv_events_block_size: int = 16   # tokens a KV-event block holds (vLLM's default)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise InvalidInputError("host must be a non-empty string")
        object.__setattr__(self, "port", int_param("port", self.port, 0, 65535))
        k = self.api_key
        if k is not None and not (isinstance(k, str) and k and k.isascii() and k.isprintable() and " " not in k):
            # what an HTTP header carries as the client sent it (other bytes would never match)
            raise InvalidInputError("api_key must be printable ASCII characters, without spaces")
        object.__setattr__(self, "max_body", int_param("max_body", self.max_body, 1024))
        object.__setattr__(self, "body_timeout", _num("body_timeout", self.body_timeout, 0.1, 3600.0))
        e = self.kv_events
        if e is not None and not (isinstance(e, str) and e.startswith(("tcp://", "ipc://")) and e.isprintable()):
            raise InvalidInputError(f"kv_events must be a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH), got {e!r}")
        object.__setattr__(self, "kv_events_block_size",
                           int_param("kv_events_block_size", self.kv_events_block_size, 1, KV_EVENT_BLOCK_MAX))
        object.__setattr__(self, "shutdown_grace", _num("shutdown_grace", self.shutdown_grace, 0.0, 3600.0))
