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
(
    cd "$SRC"
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
    cmake --build build --target llama-server -j"$JOBS"
)
"$SRC/build/bin/llama-server" --version

# Into place: the source with its build tree becomes <cache>/llama.cpp, then the link.
rm -rf "$CACHE/llama.cpp"
mv "$SRC" "$CACHE/llama.cpp"
mkdir -p "$CACHE/bin"
ln -sfn "../llama.cpp/build/bin/llama-server" "$BIN.tmp"
mv -T "$BIN.tmp" "$BIN"
END=$(date +%s)
echo "built $BIN in $(( (END - START) / 60 )) min $(( (END - START) % 60 )) s"
