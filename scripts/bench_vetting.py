#!/usr/bin/env python3
"""What validation costs a model load: a plain load (validate="off") vs the first load with the
default validation (static checks, and for a non-llama architecture a vetting run in a child
process) vs a later load (the verdict from the cache), measured side by side in one run.

Each load is ``pk.Model(path)`` then ``close()``, in this process; every measurement is the median of
``--repeat`` runs, the first load each time against an empty vetting cache of its own (so every
"first" is a real vetting run; the file's sha256 is remembered across them, as it would be after
``pyllama-kv pull``, which hashes it anyway). For a dense llama model (the catalogue's SmolLM2) the
default does no vetting: its row also times ``vetting.vet`` forced on it, for comparison.

    .venv/bin/python scripts/bench_vetting.py --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyllama_kv as pk  # noqa: E402
from pyllama_kv.modelfile import catalogue, vetting  # noqa: E402


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _load(path, validate):
    pk.Model(path, validate=validate).close()


def measure(name: str, repeat: int) -> dict:
    path = catalogue.resolve(name)
    _load(path, "off")                     # page cache warm, library loaded
    plain, first, later, forced = [], [], [], []
    for _ in range(repeat):
        plain.append(_time(lambda: _load(path, "off")))
        with tempfile.TemporaryDirectory() as d:
            vet_dir = Path(d) / "vetted"
            old = vetting._vet_dir
            vetting._vet_dir = lambda vet_dir=vet_dir: vet_dir   # an empty verdict cache
            try:
                first.append(_time(lambda: _load(path, "full")))
                later.append(_time(lambda: _load(path, "full")))
                lib = pk.Model(path, validate="off")._lib.path
                forced.append(_time(lambda lib=lib: vetting._run_child(path, lib, 0, True, vetting.VET_TIMEOUT)))
            finally:
                vetting._vet_dir = old
    med = statistics.median
    return {"model": name, "path": str(path), "bytes": os.path.getsize(path),
            "plain_s": round(med(plain), 3), "first_s": round(med(first), 3), "later_s": round(med(later), 3),
            "vetting_run_s": round(med(forced), 3),
            "first_over_plain": round(med(first) / med(plain), 2),
            "later_over_plain": round(med(later) / med(plain), 2),
            "vetting_run_over_plain": round(med(forced) / med(plain), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows = [measure(n, a.repeat) for n in a.models.split(",")]
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['model']:<24} plain {r['plain_s']:.3f}s  first {r['first_s']:.3f}s "
                  f"({r['first_over_plain']}x)  later {r['later_s']:.3f}s ({r['later_over_plain']}x)  "
                  f"a vetting run {r['vetting_run_s']:.3f}s ({r['vetting_run_over_plain']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
