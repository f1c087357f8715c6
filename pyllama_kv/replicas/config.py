"""The options of ``serve --replicas`` (Ray Serve, :mod:`pyllama_kv.replicas.ray_serve`): importable
without Ray."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import _Config, _num, int_param
from ..errors import InvalidInputError

#: --router's choices (ray_serve.ROUTERS has their classes)
ROUTER_NAMES = ("prefix", "round-robin", "pow2")


@dataclass(frozen=True)
class ReplicasConfig(_Config):
    """How many engine replicas, routed how, on which Ray cluster, with what each one reserves."""

    replicas: int = 0              # engine replicas on Ray Serve (0: one server in this process, no Ray)
    router: str = "prefix"         # prefix (by what each replica caches), round-robin, pow2 (Ray's default)
    ray_address: str | None = None  # a Ray cluster to join (None: $RAY_ADDRESS, else a local Ray on 127.0.0.1)
    replica_cpus: float = 1.0      # CPUs Ray reserves for each replica
    replica_gpus: float = 0.0      # GPUs Ray reserves for each replica
    routing_period: float = 1.0    # seconds between a replica's reports of its cache and load to the router

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", int_param("replicas", self.replicas, 0, 1024))
        if self.router not in ROUTER_NAMES:
            raise InvalidInputError(f"router must be one of {', '.join(ROUTER_NAMES)}, got {self.router!r}")
        a = self.ray_address
        if a is not None and not (isinstance(a, str) and a and a.isprintable()):
            raise InvalidInputError(f"ray_address must be an address (HOST:PORT, ray://HOST:PORT, auto), got {a!r}")
        object.__setattr__(self, "replica_cpus", _num("replica_cpus", self.replica_cpus, 0.0, 4096.0))
        object.__setattr__(self, "replica_gpus", _num("replica_gpus", self.replica_gpus, 0.0, 64.0))
        object.__setattr__(self, "routing_period", _num("routing_period", self.routing_period, 0.05, 600.0))
