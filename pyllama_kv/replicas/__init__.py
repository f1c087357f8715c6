"""Many replicas of one model: routing requests by what each replica has cached (``routing``)."""
from .routing import CacheRouter, ReplicaView, Route

__all__ = ["CacheRouter", "ReplicaView", "Route"]
