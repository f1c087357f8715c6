"""GGUF helpers (tiny models, inspect, validation) and the seeded server-like workload."""
