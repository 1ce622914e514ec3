#!/usr/bin/env bash
# Build llama.cpp's llama-server once, for bench/compare.py --peer llama-server
# (docs/benchmarks.md, "llama-server as the peer"). `make bench-peer` runs this.
#
# Only the package registries are reachable, so the source is the llama.cpp tree vendored
# in the llama-cpp-python sdist (0.3.36: ggml-org/llama.cpp@0c1e57098 by its CHANGELOG).
# The build (about 6 minutes on 2 cores) happens in a temporary folder inside the cache
# and is moved into place only when it succeeded; the binary then lies at
# <cache>/bin/llama-server, a symlink into the kept build tree so that its shared
# libraries (found through the build's RPATH) keep working. With the binary present the
# script only says where it is.
#
#   LIFECYCLE_PEER_CACHE   the cache folder (default ${XDG_CACHE_HOME:-$HOME/.cache}/lifecycle/llama-server)
#   PYTHON                 the python whose pip downloads the sdist (default .venv/bin/python)
#   JOBS                   parallel compile jobs (default 2)
#   LLAMA_CPU_FLAGS        ggml's CPU flags (default -DGGML_NATIVE=ON; see below)
#
# A native build can compile instructions the CPU lists but the VM does not run: on a
# Xeon guest listing AMX and AVX-512 (2026-12-04 and 2026-12-06) llama-server died at
# its warm-up decode (SIGILL with 1 thread, SIGSEGV with 2). So the build is tried once
# on the bundled model (start, /health 200, stop); if it fails on a CPU that lists
# AVX-512, it is rebuilt with AVX-512 and VNNI but without AMX (AVX512_FLAGS: the peer
# at its best where AMX is what fails), and failing that with AVX2, FMA and F16C
# (PORTABLE_FLAGS). The flags that served are kept beside the binary
# (build/lifecycle-cpu-flags.txt) and bench.compare prints them.
set -euo pipefail

VERSION=0.3.36
CACHE="${LIFECYCLE_PEER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lifecycle/llama-server}"
BIN="$CACHE/bin/llama-server"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$HERE/.venv/bin/python}"
JOBS="${JOBS:-2}"

if [ -x "$BIN" ]; then
    echo "llama-server is already built: $BIN"
    exit 0
fi

mkdir -p "$CACHE"
TMP="$(mktemp -d "$CACHE/.build.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
START=$(date +%s)

# The sdist is kept in the cache: a rebuild (after a failed compile) needs no download.
DL="$CACHE/dl"
SDIST="$(ls "$DL"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DL"
    SDIST="$DL/llama_cpp_python-$VERSION.tar.gz"
fi
tar -xzf "$SDIST" -C "$TMP"
SRC="$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp"
# The vendored tree's .git is a gitlink to a folder the sdist lacks; cmake would try to
# read it for the version. Without it the binary says "build 0, commit unknown".
rm -rf "$SRC/.git"

# LLAMA_USE_PREBUILT_UI=OFF: otherwise the build downloads the web UI (no network here).
# CMAKE_BUILD_RPATH_USE_ORIGIN: the binary finds libllama/libggml beside it ($ORIGIN), not
# at the temporary path, so the tree still works once moved into place.
PORTABLE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
AVX512_FLAGS="$PORTABLE_FLAGS -DGGML_AVX512=ON"
has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
if has avx512_vnni; then AVX512_FLAGS="$AVX512_FLAGS -DGGML_AVX512_VNNI=ON"; fi
if has avx512vbmi; then AVX512_FLAGS="$AVX512_FLAGS -DGGML_AVX512_VBMI=ON"; fi
if has avx512_bf16; then AVX512_FLAGS="$AVX512_FLAGS -DGGML_AVX512_BF16=ON"; fi
if has avx_vnni; then AVX512_FLAGS="$AVX512_FLAGS -DGGML_AVX_VNNI=ON"; fi
build() { # $1: ggml's CPU flags
    rm -rf "$SRC/build"
    (
        cd "$SRC"
        # shellcheck disable=SC2086 # the flags are several words
        cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF $1 \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
        cmake --build build --target llama-server -j"$JOBS"
    )
    "$SRC/build/bin/llama-server" --version
}
# Serve the bundled model once: 0 when /health answered 200, 1 when the server died.
smoke() {
    local model port=18383 pid ok=1
    model="$("$PYTHON" -c 'from modelfile.gguf_file import default_model_path; print(default_model_path())')"
    "$SRC/build/bin/llama-server" -m "$model" --threads 2 --ctx-size 2048 --host 127.0.0.1 \
        --port "$port" >"$TMP/smoke.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do
        if ! kill -0 "$pid" 2>/dev/null; then break; fi
        if curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1; then ok=0; break; fi
        sleep 0.5
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return "$ok"
}
# The flag sets to try in order: the asked-for one, else native, then the fallbacks.
if [ -n "${LLAMA_CPU_FLAGS:-}" ]; then
    TRIES=("$LLAMA_CPU_FLAGS")
else
    TRIES=("-DGGML_NATIVE=ON")
    if has avx512f; then TRIES+=("$AVX512_FLAGS"); fi
fi
if [ "${TRIES[-1]}" != "$PORTABLE_FLAGS" ]; then TRIES+=("$PORTABLE_FLAGS"); fi
FLAGS=""
for try in "${TRIES[@]}"; do
    build "$try"
    if smoke; then FLAGS="$try"; break; fi
    echo "llama-server built with '$try' did not serve the model here:" >&2
    tail -3 "$TMP/smoke.log" >&2
done
if [ -z "$FLAGS" ]; then echo "no build of llama-server serves here" >&2; exit 1; fi
echo "$FLAGS" >"$SRC/build/lifecycle-cpu-flags.txt"

# Into place: the source with its build tree becomes <cache>/llama.cpp, then the link.
rm -rf "$CACHE/llama.cpp"
mv "$SRC" "$CACHE/llama.cpp"
mkdir -p "$CACHE/bin"
ln -sfn "../llama.cpp/build/bin/llama-server" "$BIN.tmp"
mv -T "$BIN.tmp" "$BIN"
END=$(date +%s)
echo "built $BIN in $(( (END - START) / 60 )) min $(( (END - START) % 60 )) s"
