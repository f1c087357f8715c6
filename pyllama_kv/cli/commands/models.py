"""`pyllama-kv models`: the model catalogue, and which models are cached."""
from __future__ import annotations

from ..render import human_bytes, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("models", description="List the model catalogue: each name can be given wherever "
                                                    "a MODEL path is taken (pulled on first use) or to "
                                                    "`pyllama-kv pull`. Cached models are marked.")
    s.add_argument("--json", action="store_true", help="print as JSON")


def run(args) -> int:
    from ...modelfile import catalogue

    rows = catalogue.listing()
    if args.json:
        print_json(rows)
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    for r in rows:
        mark = "[cached]" if r["cached"] else "        "
        print(f"{r['name']:<{width}}  {mark}  {human_bytes(r['size']):>10}  {r['license']:<12}  {r['description']}")
        if r["cached"]:
            print(f"{'':<{width}}  {r['path']}")
    if not rows:
        print("the catalogue is empty")
    return 0
