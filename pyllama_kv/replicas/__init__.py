"""Many replicas of one model: routing requests by what each replica has cached (``routing``), the
ingress's tokens for it (``keys``), and ``serve --replicas`` on Ray Serve (``ray_serve``: imported
on its own, it needs the ``replicas`` extra)."""
from .config import ReplicasConfig
from .routing import CacheRouter, ReplicaView, Route

__all__ = ["CacheRouter", "ReplicaView", "ReplicasConfig", "Route"]
