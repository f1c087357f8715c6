"""Our cffi declarations (pyllama_kv/_native/decl/*.h) checked against the real vendored llama.h by the C compiler.

The generated C file includes llama.h and then
  * redeclares every function we declare: any difference in return or parameter types is a
    "conflicting types" error;
  * asserts, for every struct we declare, its size, each field's offset (as cffi computes them from
    our declaration) and each field's exact type (const included);
  * asserts the typedefs and the enum values we use.

A redeclaration also *declares*: a function that llama.h does not have would compile cleanly. So a
second file, without our declarations, takes the address of every function we declare, with only
llama.h in scope: a name llama.h does not declare is an error there.
"""
from __future__ import annotations

import shutil
import subprocess

import pycparser
import pytest
from pycparser import c_ast, c_generator

from pyllama_kv import _paths
from pyllama_kv._native import ffi as _ffi

PRELUDE = ("typedef int int32_t; typedef unsigned int uint32_t; typedef long int64_t; typedef unsigned long uint64_t;"
           "typedef signed char int8_t; typedef unsigned char uint8_t; typedef unsigned long size_t; "
           "typedef unsigned long uintptr_t; typedef _Bool bool;\n")
STD = {"int32_t", "uint32_t", "int64_t", "uint64_t", "int8_t", "uint8_t", "size_t", "uintptr_t", "bool"}


def _type_text(node) -> str:
    gen = c_generator.CGenerator()
    return gen._generate_type(node, emit_declname=False)


def generate_checks(types_cdef: str, funcs_cdef: str, ffi=None) -> str:
    """``ffi``: the FFI whose sizes, offsets and enum values are asserted (the mission one by default)."""
    ffi = _ffi.ffi if ffi is None else ffi
    ast = pycparser.CParser().parse(PRELUDE + types_cdef)
    lines = ["#include <stddef.h>", "#include <stdbool.h>", '#include "llama.h"', "", "/* functions */", funcs_cdef, ""]
    n = 0

    def check(cond: str, what: str) -> None:
        nonlocal n
        n += 1
        lines.append(f'_Static_assert({cond}, "{what}");')

    for ext in ast.ext:
        if isinstance(ext, c_ast.Typedef):
            if ext.name in STD:
                continue
            t = ext.type.type
            if isinstance(t, c_ast.Struct) and t.decls is not None:
                check(f"__builtin_types_compatible_p({ext.name}, struct {t.name})", f"typedef {ext.name}")
                struct = t
            else:
                check(f"__builtin_types_compatible_p({ext.name}, {_type_text(ext.type)})", f"typedef {ext.name}")
                continue
        elif isinstance(ext, c_ast.Decl) and isinstance(ext.type, c_ast.Struct) and ext.type.decls is not None:
            struct = ext.type
        elif isinstance(ext, c_ast.Decl) and isinstance(ext.type, c_ast.Enum) and ext.type.values is not None:
            values = ffi.typeof(f"enum {ext.type.name}").relements
            for e in ext.type.values.enumerators:
                check(f"{e.name} == {values[e.name]}", f"enum value {e.name}")
            continue
        else:
            continue
        tag = f"struct {struct.name}"
        check(f"sizeof({tag}) == {ffi.sizeof(tag)}", f"sizeof {tag}")
        for d in struct.decls:
            check(f"offsetof({tag}, {d.name}) == {ffi.offsetof(tag, d.name)}", f"offset of {tag}.{d.name}")
            check(f"__builtin_types_compatible_p(__typeof__((({tag} *)0)->{d.name}), {_type_text(d.type)})",
                  f"type of {tag}.{d.name}")
    lines.append(f"/* {n} static checks */")
    return "\n".join(lines) + "\n"


def declared_functions(types_cdef: str, funcs_cdef: str) -> list[str]:
    """The names of the functions ``funcs_cdef`` declares."""
    ast = pycparser.CParser().parse(PRELUDE + types_cdef + funcs_cdef)
    return [e.name for e in ast.ext if isinstance(e, c_ast.Decl) and isinstance(e.type, c_ast.FuncDecl)]


def generate_address_checks(names: list[str]) -> str:
    """C source that takes the address of each function with only llama.h in scope (no redeclaration):
    a name llama.h does not declare is an error."""
    lines = ["#include <stddef.h>", "#include <stdbool.h>", '#include "llama.h"', ""]
    lines += [f"__typeof__({n}) *const pyllama_kv_address_of_{n} = &{n};" for n in names]
    return "\n".join(lines) + "\n"


def _compile(tmp_path, source: str, name: str = "check_decls.c", vdir=None) -> subprocess.CompletedProcess:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.fail("no C compiler found (cc/gcc/clang); one is needed to build libllama anyway")
    vdir = _paths.vendor_dir() if vdir is None else vdir
    src = tmp_path / name
    src.write_text(source)
    return subprocess.run([cc, "-std=c11", "-fsyntax-only", "-Werror", f"-I{vdir / 'include'}",
                           f"-I{vdir / 'ggml' / 'include'}", str(src)], capture_output=True, text=True)


def _check(tmp_path, types_cdef: str, funcs_cdef: str, ffi=None, vdir=None) -> list[subprocess.CompletedProcess]:
    """Both compiles: the redeclarations and static checks, and the addresses without redeclarations
    (``ffi``/``vdir``: another API generation's FFI and its llama.cpp tree)."""
    names = declared_functions(types_cdef, funcs_cdef)
    return [_compile(tmp_path, generate_checks(types_cdef, funcs_cdef, ffi), vdir=vdir),
            _compile(tmp_path, generate_address_checks(names), "check_addresses.c", vdir=vdir)]


def test_declarations_match_the_vendored_header(tmp_path):
    src = generate_checks(_ffi.TYPES_CDEF, _ffi.FUNCS_CDEF + _ffi.PATCHED_FUNCS_CDEF)
    assert src.count("_Static_assert") > 100
    names = declared_functions(_ffi.TYPES_CDEF, _ffi.FUNCS_CDEF + _ffi.PATCHED_FUNCS_CDEF)
    patched = {"llama_kv_self_stats", "llama_state_seq_add_data", "llama_state_seq_get_size_range",
               "llama_state_seq_get_data_range"}
    assert set(_ffi.REQUIRED_FUNCS) | patched == set(names) and len(names) > 50
    for r in _check(tmp_path, _ffi.TYPES_CDEF, _ffi.FUNCS_CDEF + _ffi.PATCHED_FUNCS_CDEF):
        assert r.returncode == 0, r.stderr[-3000:]


def _current_tree():
    vdir = _paths.vendor_dir(pin="current")
    if not (vdir / "include" / "llama.h").is_file():
        pytest.fail(f"the current pin's tree is not at {vdir}: `make setup` puts it there "
                    "(pyllama-kv vendor --pin current)")
    return vdir


def test_current_declarations_match_the_current_header(tmp_path):
    """The second API generation (decl/current/*.h, the current pin's llama.h): its struct layouts
    (llama_model_params, llama_context_params: cffi's ABI mode trusts them), field types, enum values
    and every function signature, compiled against vendor/llama.cpp-current."""
    vdir = _current_tree()
    funcs = _ffi.CURRENT_FUNCS_CDEF + _ffi.CURRENT_PATCHED_FUNCS_CDEF
    src = generate_checks(_ffi.CURRENT_TYPES_CDEF, funcs, _ffi.current_ffi())
    assert src.count("_Static_assert") > 100
    names = declared_functions(_ffi.CURRENT_TYPES_CDEF, funcs)
    patched = {"llama_state_seq_add_data", "llama_memory_update",   # patches/current/0001, 0002
               "llama_state_seq_get_size_range", "llama_state_seq_get_data_range"}   # 0003
    assert set(names) == set(_ffi.CURRENT_REQUIRED_FUNCS) | patched and "llama_memory_seq_rm" in names
    assert not [n for n in names if n.startswith("llama_kv_")]
    for r in _check(tmp_path, _ffi.CURRENT_TYPES_CDEF, funcs, _ffi.current_ffi(), vdir):
        assert r.returncode == 0, r.stderr[-3000:]


def test_the_mission_declarations_do_not_fit_the_current_header(tmp_path):
    """The check sees the generations apart: the mission declarations fail against the current llama.h."""
    vdir = _current_tree()
    decls, addresses = _check(tmp_path, _ffi.TYPES_CDEF, _ffi.FUNCS_CDEF, None, vdir)
    assert decls.returncode != 0 and addresses.returncode != 0


def test_a_function_llama_h_lacks_fails_the_check(tmp_path):
    """A declared function that llama.h does not have (a typo, a function of another revision):
    the redeclarations compile, since they declare it themselves; the address check must not."""
    funcs = (_ffi.FUNCS_CDEF + _ffi.PATCHED_FUNCS_CDEF
             + "int32_t llama_kv_self_seq_n_cells(struct llama_context * ctx);\n")
    decls, addresses = _check(tmp_path, _ffi.TYPES_CDEF, funcs)
    assert decls.returncode == 0, decls.stderr[-3000:]
    assert addresses.returncode != 0 and "llama_kv_self_seq_n_cells" in addresses.stderr, addresses.stderr[-3000:]


@pytest.mark.parametrize("mutate", [
    # a function return type drifts
    lambda t, f: (t, f.replace("uint32_t llama_n_ctx      (", "int32_t llama_n_ctx      (")),
    # a parameter type drifts
    lambda t, f: (t, f.replace("llama_pos p0, llama_pos p1);", "int64_t p0, llama_pos p1);", 1)),
    # a struct field is missing (layout shifts)
    lambda t, f: (t.replace("    int32_t main_gpu;\n", ""), f),
    # a field's constness drifts
    lambda t, f: (t.replace("const float * tensor_split;", "float * tensor_split;"), f),
    # an enum value drifts
    lambda t, f: (t.replace("GGML_TYPE_Q8_0   = 8,", "GGML_TYPE_Q8_0   = 9,"), f),
])
def test_the_check_catches_drift(tmp_path, mutate):
    """Each kind of drift a hand-kept binding suffers must fail the compile."""
    t, f = mutate(_ffi.TYPES_CDEF, _ffi.FUNCS_CDEF + _ffi.PATCHED_FUNCS_CDEF)
    assert (t, f) != (_ffi.TYPES_CDEF, _ffi.FUNCS_CDEF + _ffi.PATCHED_FUNCS_CDEF), "mutation did not apply"
    import cffi

    if t != _ffi.TYPES_CDEF:
        # sizes/offsets come from our (drifted) declaration, as they would in a drifted binding
        drifted = cffi.FFI()
        drifted.cdef(t)
        old = _ffi.ffi
        _ffi.ffi = drifted
        try:
            src = generate_checks(t, f)
        finally:
            _ffi.ffi = old
    else:
        src = generate_checks(t, f)
    r = _compile(tmp_path, src)
    assert r.returncode != 0, "a drifted declaration compiled cleanly"
    assert "error" in r.stderr


@pytest.mark.parametrize("api", ["mission", "current"])
def test_the_architecture_lists_are_the_vendored_trees(api):
    """_native/archs.py holds LLM_ARCH_NAMES of each pin's llama-arch.cpp (what a GGUF file's architecture
    is checked against before the library sees it): regenerate it when a pin moves."""
    import re

    from pyllama_kv._native import archs

    src = (_paths.vendor_dir(pin=api) / "src/llama-arch.cpp").read_text()
    table = src[src.index("LLM_ARCH_NAMES"):]
    table = table[:table.index("};")]
    names = set(re.findall(r'\{\s*LLM_ARCH_\w+\s*,\s*"([^"]+)"\s*\}', table)) - {"(unknown)"}
    assert archs.BY_API[api][0] == names


@pytest.mark.parametrize("api", ["mission", "current"])
def test_the_pre_tokenizer_lists_are_the_vendored_trees(api):
    """_native/archs.py holds the BPE pre-tokenizers each pin's llama-vocab.cpp knows (a model with
    another one does not load there; the library is chosen by them too): regenerate when a pin moves."""
    import re

    from pyllama_kv._native import archs

    src = (_paths.vendor_dir(pin=api) / "src/llama-vocab.cpp").read_text()
    assert "unknown pre-tokenizer type" in src
    assert archs.PRE_BY_API[api] == set(re.findall(r'tokenizer_pre\s*==\s*"([^"]+)"', src))
