#!/usr/bin/env python3
"""Write a timing model: a GGUF with a real model's shapes and random Q4_0 (or F16) weights, in seconds.

Speed depends on shapes, not values, so the GPU benchmarks time this file instead of downloading
an 8B model (pyllama_kv.tools.gguf.make_timing_model). Its text is noise: never use it for output.

  python scripts/make_timing_model.py OUT.gguf [--shape llama3-8b|llama3-3b|llama3-1b] [--layers N]
                                    [--dtype q4_0|f16]
"""
from __future__ import annotations

import argparse
import sys
import time

from pyllama_kv.tools.gguf import TIMING_DTYPES, TIMING_SHAPES, make_timing_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--shape", choices=sorted(TIMING_SHAPES), default="llama3-8b", help="(default llama3-8b)")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--dtype", choices=TIMING_DTYPES, default="q4_0",
                    help="the weights' type (default q4_0; f16 makes a CPU's decode memory-bound)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    path = make_timing_model(args.out, args.shape, n_layer=args.layers, dtype=args.dtype)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
