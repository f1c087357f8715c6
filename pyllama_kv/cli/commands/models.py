"""`pyllama-kv models`: the model catalogue and which models are cached; `--local`: the GGUF files
already on this machine (Hugging Face cache, Ollama, LM Studio)."""
from __future__ import annotations

from ..render import human_bytes, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("models", description="List the model catalogue: each name can be given wherever "
                                                    "a MODEL path is taken (pulled on first use) or to "
                                                    "`pyllama-kv pull`. Cached models are marked. With --local, "
                                                    "list the GGUF models already on this machine instead: the "
                                                    "Hugging Face cache ($HF_HUB_CACHE, $HF_HOME/hub, "
                                                    "~/.cache/huggingface/hub), Ollama's store ($OLLAMA_MODELS, "
                                                    "~/.ollama/models) and LM Studio's folder (~/.lmstudio/models), "
                                                    "read only, each with its architecture, size, and the "
                                                    "libraries (--lib) that implement it; each NAME is a MODEL "
                                                    "argument.")
    s.add_argument("--local", action="store_true",
                   help="list the GGUF files in the Hugging Face cache, Ollama's store and LM Studio's folder")
    s.add_argument("--json", action="store_true", help="print as JSON")


def run(args) -> int:
    if args.local:
        return _local(args.json)
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


def _local(as_json: bool) -> int:
    from ...modelfile import local

    found = local.scan()
    if as_json:
        print_json({"stores": local.store_dirs(), "models": [m.as_dict() for m in found]})
        return 0
    width = max([len(m.name) for m in found] + [4])
    for m in found:
        if m.error:
            print(f"{m.name:<{width}}  unusable: {m.error}")
            continue
        libs = ", ".join(m.loads_with) or "no library here implements it"
        parts = f", {m.parts} parts" if m.parts > 1 else ""
        print(f"{m.name:<{width}}  {m.architecture or '?':<12}  {human_bytes(m.size):>10}{parts}  --lib {libs}")
    if not found:
        print("no GGUF models found in:")
        for store, dirs in local.store_dirs().items():
            print(f"  {store}: {', '.join(dirs)}")
    return 0
