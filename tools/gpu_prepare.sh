#!/usr/bin/env bash
# Prepare what tools/gpu_check.sh needs on the GPU machine, which has no registry and no
# network, and to which at most 64 MiB travel (docs/benchmarks.md, "Proving the CUDA
# path"). Run HERE, in the repository, before the session that is lent the GPU:
#
#   tools/gpu_prepare.sh
#
# - .whl/: the wheels of what the project imports there and the device image lacks
#   (tools/gpu_deps.py checks the list), cp312 manylinux x86_64, at the versions this
#   venv runs, fetched as the device notes say (pip download --no-deps --only-binary);
# - .gpu/model_meta.json.gz: the bundled GGUF's metadata and tensor directory, no weights
#   (tools/model_meta.py); tools/random_gguf.py rebuilds a same-shape model from it there;
# - both ignored (.gitignore and .git/info/exclude), so they travel only as `carry`;
# - the size of what travels, checked against the limit.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
# What the device image lacks (KINDS.md's package list) and the project imports there,
# plus h11 pinned to the version tested here (the image's version is not recorded).
PACKAGES=(gguf cbor2 wsproto orjson transitions llguidance h11)
LIMIT_MIB=64

for path in /.whl/ /.gpu/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >>.git/info/exclude
    grep -qxF "$path" .gitignore || echo "warning: $path is not in .gitignore"
done

pins=()
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("$name==$version")
done
echo "== wheels for cp312 manylinux x86_64: ${pins[*]}"
platforms=()
for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${pins[@]}" 2>&1 |
    grep -v "^WARNING: Location" || true
count=$(ls .whl/*.whl | wc -l)
if [[ $count -ne ${#PACKAGES[@]} ]]; then
    echo "expected ${#PACKAGES[@]} wheels in .whl, found $count" >&2
    exit 1
fi
ls -l .whl
echo "== what they need besides themselves (each must be on the device image):"
for w in .whl/*.whl; do
    needs=$(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v extra |
        sed 's/Requires-Dist: //' | tr '\n' ' ' || true)
    echo "  $(basename "$w"): ${needs:-nothing}"
done

# A cp312 interpreter here, when there is one, proves the wheels install and import.
py312=$(ls ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)
if [[ -n $py312 ]]; then
    site=$(mktemp -d)
    PIP_ROOT_USER_ACTION=ignore "$py312" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    PYTHONPATH=$site "$py312" -c "import cbor2, orjson, llguidance, wsproto, h11
print('  installed and imported with', __import__('sys').version.split()[0],
      '(gguf and transitions need numpy and six, not here: not tried)')"
    rm -rf "$site"
else
    echo "  (no python3.12 here: the install is first tried on the device)"
fi

echo "== dependencies of the check against the device image"
"$PY" tools/gpu_deps.py --wheels .whl

echo "== the model's metadata"
"$PY" tools/model_meta.py --out .gpu/model_meta.json.gz

echo "== what travels"
tree_bytes=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl_bytes=$(du -cb .whl | tail -1 | cut -f1)
gpu_bytes=$(du -cb .gpu | tail -1 | cut -f1)
total=$((tree_bytes + whl_bytes + gpu_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "  working tree $(mib "$tree_bytes") + .whl $(mib "$whl_bytes") + .gpu $(mib "$gpu_bytes") = $(mib "$total") (limit $LIMIT_MIB MiB)"
if ((total > LIMIT_MIB * 1048576 / 2)); then
    echo "over half the limit: look for large untracked files before the run" >&2
    exit 1
fi
echo "ready: tools/gpu_check.sh --print-run-call prints the one call to make on the GPU"
