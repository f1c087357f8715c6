"""The folders are the layers (docs/architecture.md): each imports only the folders it may, no import
cycle exists (lazy imports included, TYPE_CHECKING ones not), objects reach into each other's
private names only where architecture.md says why, and no function runs over 60 lines without a
``# long: `` comment above it saying why."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "pyllama_kv"
SHARED = {"errors", "config", "limits", "_paths", "_worker", "__init__"}
#: folder -> the folders it may import (besides itself and the shared modules)
MAY = {
    "_native": set(),
    "modelfile": {"_native"},
    "core": {"_native", "modelfile"},
    "prefixcache": {"core"},
    "sampling": {"core", "_native"},
    "chat": {"core", "sampling", "modelfile"},
    "speculation": {"core"},
    "engine": {"core", "prefixcache", "sampling", "chat", "speculation"},
    "server": {"engine", "chat", "sampling", "core"},
    "replicas": {"prefixcache", "core", "chat", "engine", "server"},
    "cli": {"_native", "modelfile", "core", "prefixcache", "sampling", "chat", "engine", "server", "harness",
            "tools", "speculation", "replicas"},
    "harness": {"_native", "modelfile"},
    "tools": {"_native", "modelfile", "core", "prefixcache", "sampling", "chat", "engine", "speculation"},
}
#: (importer, imported): the exceptions architecture.md lists, each with its reason there
ALLOWED = {
    ("pyllama_kv.core.model", "pyllama_kv.chat.templates"),        # Model.apply_chat_template forwards
    ("pyllama_kv._worker", "pyllama_kv.chat.sandbox"),             # the worker runs the sandbox's jobs
    ("pyllama_kv._worker", "pyllama_kv.sampling.grammar_check"),   # ... and the grammar checks
    ("pyllama_kv.limits", "pyllama_kv.modelfile.gguf"),            # ggml's block table, lazily
}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (p, init)
    return out


def _imports(mods) -> dict[str, set[str]]:
    """module -> the package modules it imports (at any level, lazily too; not under TYPE_CHECKING)."""
    edges = {}
    for mod, (path, init) in mods.items():
        tree = ast.parse(path.read_text())
        skip = {id(m) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                for m in ast.walk(n)}
        out = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = (mod if init else mod.rsplit(".", 1)[0]).split(".")
                    base = base[:len(base) - (n.level - 1)] if n.level > 1 else base
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                for a in n.names:
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in mods else target)
            elif isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
        edges[mod] = {o for o in out if o in mods and o != mod}
    return edges


def _layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()):
        return parts[1]
    return "__init__" if len(parts) == 1 else parts[1]


def test_each_folder_imports_only_what_it_may():
    mods = _modules()
    bad = []
    for mod, targets in _imports(mods).items():
        a = _layer(mod)
        for t in targets:
            b = _layer(t)
            if a == b or b in SHARED or (mod, t) in ALLOWED:
                continue
            if a in SHARED or b not in MAY.get(a, set()):
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports across layers that docs/architecture.md does not allow:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    edges = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


#: ``x._name`` where x is another object (not self, cls or an imported module): the ones
#: architecture.md names, by module and expression
PRIVATE_ALLOWED: dict[str, set[str]] = {}


def test_objects_do_not_reach_into_each_others_private_names():
    found = {}
    for mod, (path, _) in _modules().items():
        tree = ast.parse(path.read_text())
        modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                   if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            base = n.value
            if isinstance(base, ast.Name) and base.id in ({"self", "cls", "os", "sys"} | modules):
                continue
            if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
                continue
            expr = ast.unparse(n)
            if expr not in PRIVATE_ALLOWED.get(mod, set()):
                found.setdefault(mod, []).append(f"{path.relative_to(ROOT)}:{n.lineno}: {expr}")
    total = sum(len(v) for v in found.values())
    assert total <= 10, f"{total} cross-object private accesses (at most 10):\n" + "\n".join(
        line for v in found.values() for line in v)


#: issue 31: a function longer than this says why, in a ``# long: `` comment just above it
MAX_FUNCTION_LINES = 60


def _reason_above(lines: list[str], first: int) -> bool:
    """Whether the comment block ending on the line above line ``first`` (1-based: the def, or its
    first decorator) starts with ``# long: ``."""
    i = first - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        if lines[i].strip().startswith("# long: "):
            return True
        i -= 1
    return False


def test_no_function_over_60_lines_without_a_reason():
    missing = []
    for p in sorted(PKG.rglob("*.py")):
        lines = p.read_text().splitlines()
        for n in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = (n.end_lineno or n.lineno) - n.lineno
            first = min([n.lineno] + [d.lineno for d in n.decorator_list])
            if length > MAX_FUNCTION_LINES and not _reason_above(lines, first):
                missing.append(f"{p.relative_to(ROOT)}:{n.lineno}: {n.name} ({length} lines)")
    assert not missing, (f"functions over {MAX_FUNCTION_LINES} lines with no '# long: <why>' comment just above "
                         "their def (or decorators): split them, or say why\n" + "\n".join(missing))


#: issue 46: a module longer than this is split, each piece one concern (the Context's and the Engine's
#: layers, the server's base): a reader holds a module whole
MAX_MODULE_LINES = 800


def test_no_module_over_800_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them, one concern each):\n" + "\n".join(long)
