#!/usr/bin/env bash
# Check that the patched CUDA build compiles and links here, from nothing: a clean download cache and
# a clean build directory (both in a work directory, removed afterwards unless --keep), cuBLAS
# fetched from PyPI (`pyllama-kv build --backend cuda --fetch-cublas`), then:
#   1. libggml-cuda.so was built, links cuBLAS, and not the driver's libcuda.so (GGML_CUDA_NO_VMM);
#   2. libllama.so exports our stats symbol (llama_kv_self_stats, patch 0004);
#   3. a second build works from the cache alone: the toolkit overlay is removed and made again from
#      the cached wheel with pip's network turned off, and the build is found up to date.
# It needs nvcc (CUDA 12 or 13), cmake and about 2 GB of disk; no GPU. It takes 20 to 55 minutes on
# 2 cores for one architecture (53 min measured while other compiles ran), so it is not part of `make test`: run it after changing the build
# harness, the CUDA flags or the patch series, or when moving the pin.
#
# Usage: scripts/check_cuda_build.sh [--cuda-arch ARCHS] [-j N] [--workdir DIR] [--keep]
#   --cuda-arch ARCHS  CMAKE_CUDA_ARCHITECTURES (default 90: one architecture is enough to check)
#   -j N               parallel compile jobs (default: all cores)
#   --workdir DIR      where the cache and the build go: a new or empty directory (default: a new
#                      temporary directory)
#   --keep             keep the work directory (default: removed when done)
# Exit status: 0 all checks passed, 1 a check failed, 2 usage error, 3 the build itself failed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PK="$ROOT/.venv/bin/pyllama-kv"
ARCH=90
JOBS=$(nproc 2>/dev/null || echo 2)
WORK=""
KEEP=0
while [ $# -gt 0 ]; do
    case "$1" in
        --cuda-arch) ARCH=${2:?--cuda-arch needs a value}; shift 2 ;;
        -j|--jobs) JOBS=${2:?-j needs a value}; shift 2 ;;
        --workdir) WORK=${2:?--workdir needs a value}; shift 2 ;;
        --keep) KEEP=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$PK" ] || { echo "$PK not found: run \`make setup\` first" >&2; exit 2; }
[ -f "$ROOT/vendor/llama.cpp/include/llama.h" ] || { echo "no vendor/llama.cpp: run \`make vendor\`" >&2; exit 2; }

if [ -z "$WORK" ]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyllama-kv-cuda-check.XXXXXX")
elif [ -e "$WORK" ] && [ -n "$(ls -A "$WORK" 2>/dev/null)" ]; then
    echo "--workdir $WORK is not empty: give a new or empty directory (it is removed afterwards unless --keep)" >&2
    exit 2
else
    mkdir -p "$WORK"
fi
WORK=$(cd "$WORK" && pwd)
[ "$KEEP" = 1 ] || trap 'rm -rf "$WORK"' EXIT
# a project root of our own: the checkout's vendor tree and patches, a fresh build/ and cache
mkdir -p "$WORK/build" "$WORK/cache"
ln -sfn "$ROOT/vendor" "$WORK/vendor"
ln -sfn "$ROOT/patches" "$WORK/patches"
export PYLLAMA_KV_ROOT="$WORK" PYLLAMA_KV_CACHE="$WORK/cache"

echo "== check_cuda_build: nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p'), arch $ARCH, -j $JOBS, work dir $WORK"
fails=0
ok() { echo "PASS: $*"; }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

t0=$(date +%s)
if ! "$PK" build --backend cuda --fetch-cublas --cuda-arch "$ARCH" -j "$JOBS" --json > "$WORK/manifest.json"; then
    echo "FAIL: the CUDA build failed; its log: $WORK/build/patched-cuda/build.log (kept)" >&2
    trap - EXIT
    exit 3
fi
t1=$(date +%s)
echo "== built in $((t1 - t0)) s"

field() { "$ROOT/.venv/bin/python" -c "import json,sys; print(json.load(open(sys.argv[1]))$1)" "$WORK/manifest.json"; }
LIB=$(field "['lib']")
BIN=$(field "['bin_dir']")
echo "   library: $LIB"
echo "   cuBLAS:  $(field "['cuda'].get('cublas_wheel', {}).get('filename', 'the toolkit own')")"
echo "   flags:   $(field "['cmake_flags']" | tr -d "[]'," | tr ' ' '\n' | grep -E 'CUDA' | tr '\n' ' ')"

CUDA_SO="$BIN/libggml-cuda.so"
if [ -f "$CUDA_SO" ]; then
    ok "libggml-cuda.so exists ($(du -h "$CUDA_SO" | cut -f1))"
    needed=$(readelf -d "$CUDA_SO" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')
    echo "   NEEDED: $needed"
    case " $needed" in *" libcublas.so"*) ok "libggml-cuda.so links cuBLAS" ;; *) bad "libggml-cuda.so does not link cuBLAS" ;; esac
    case " $needed" in *" libcuda.so"*) bad "libggml-cuda.so links the driver (libcuda.so): NO_VMM not in effect" ;;
                       *) ok "libggml-cuda.so does not need the driver library (GGML_CUDA_NO_VMM)" ;; esac
    if command -v cuobjdump >/dev/null; then echo "   SASS: $(cuobjdump --list-elf "$CUDA_SO" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ')"; fi
else
    bad "libggml-cuda.so is not in $BIN"
fi
if nm -D --defined-only "$LIB" | grep -w llama_kv_self_stats >/dev/null; then
    ok "libllama.so exports llama_kv_self_stats"
else
    bad "libllama.so does not export llama_kv_self_stats (not our patched tree?)"
fi

# the cache alone: no overlay, pip unable to reach any index
rm -rf "$WORK"/cache/cuda/toolkit-*
if out=$(PIP_NO_INDEX=1 PIP_FIND_LINKS="" PIP_INDEX_URL="http://127.0.0.1:9/" \
         "$PK" build --backend cuda --fetch-cublas --cuda-arch "$ARCH" -j "$JOBS" 2>&1) \
   && grep -q "up to date" <<<"$out" && ! grep -q "downloading" <<<"$out"; then
    ok "a second build works from the cache alone (overlay made again from the cached wheel, build up to date)"
else
    bad "a second build from the cache alone:"; echo "$out" | tail -15
fi

echo "== check_cuda_build: $fails failure(s), $(( $(date +%s) - t0 )) s in all"
[ "$KEEP" = 1 ] && echo "   kept $WORK"
[ "$fails" -eq 0 ] || exit 1
exit 0
