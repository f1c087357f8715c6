"""GGUF helpers (tiny models, inspect, validation), the seeded server-like workload, and the
benchmark scripts' shared helpers."""
