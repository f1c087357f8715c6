"""The `pyllama-kv` command line."""
from __future__ import annotations


def main(argv=None) -> int:
    from .main import main as _main

    return _main(argv)
