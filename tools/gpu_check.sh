#!/usr/bin/env bash
# THE one command that proves the CUDA path on the GPU machine (docs/benchmarks.md,
# "Proving the CUDA path"). Prepare first, here: tools/gpu_prepare.sh. Then, there:
#
#   bash tools/gpu_check.sh                  # on the GPU machine (python3, CUDA)
#   bash tools/gpu_check.sh --cpu-dry-run    # here: the same plumbing on the CPU
#   bash tools/gpu_check.sh --print-run-call # the device `run` call to make
#
# Phases, each under `timeout` and all within GPU_CHECK_BUDGET_S (default 450 s):
#   install  the carried wheels into /tmp/site (the device notes' command)
#   info     nvidia-smi, torch / CUDA versions, the carried packages' versions
#   model    a random model of the bundled GGUF's shape (tools/random_gguf.py)
#   tests    tests/test_graphs.py (its CUDA test reads LIFECYCLE_TEST_MODEL) and
#            tests/test_gpu_kit.py
#   tests    (also tests/test_triton_ops.py: the Triton kernels compiled, against torch)
#   step     bench/gpu_step.py: decode at batch 1 and 64, CUDA graphs against eager,
#            against the copy-bandwidth floor; prefill of 512 tokens; a mixed step
#            (64 decodes and a 192-token chunk) eager and piecewise; all of it with the
#            torch ops and again with the Triton kernels (--kernels torch triton)
#   serve    tools/gpu_serving.py: lifecycle serve under load at concurrency 1, 32, 256
#            (64 tokens in, 64 forced out), with the frontend's CPU per output token
#   profile  bench/engine_profile.py: the engine's decode step at batch 256, wall time
#            and where the host's share goes (cProfile); then again without overlap
# Output: $OUT/log.txt (everything), env.txt, pytest.txt, gpu_step.json, serving.json,
# server.log, engine_profile.json, engine_profile_no_overlap.json. $OUT is the device tool's
# folder there, /tmp/gpu_check_out elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_TIMEOUT_S=540 # the device call's timeout_s: the budget plus the machine's slack
RUN_COMMAND="bash tools/gpu_check.sh"

print_run_call() {
    cat <<EOF
run(command="$RUN_COMMAND", carry=[".whl", ".gpu"], timeout_s=$RUN_TIMEOUT_S)
EOF
}

DRY=${GPU_CHECK_DRY_RUN:-0}
case "${1:-}" in
--cpu-dry-run) DRY=1 ;;
--print-run-call)
    print_run_call
    exit 0
    ;;
"") ;;
*)
    echo "usage: $0 [--cpu-dry-run | --print-run-call]" >&2
    exit 2
    ;;
esac

OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-450}
MODEL=/tmp/lifecycle-random-smollm2.gguf
SERVER_PID_FILE=/tmp/gpu_check_server.pid
if ((DRY)); then
    PY=${PY:-.venv/bin/python}
    DEVICE=cpu
    MODEL=/tmp/lifecycle-random-smollm2-2layers.gguf
    MODEL_ARGS=(--layers 2)
    STEP_ARGS=(--device cpu --runs 3)
    SERVE_ARGS=(--device cpu --levels 1 4 --num-requests 4 --max-running 8
        --kv-cache-tokens 8192)
    PROFILE_ARGS=(--device cpu --batch 16 --steps 5)
    # The CPU tests of test_graphs.py are the suite's; here only the CUDA one (skipped).
    TESTS=(tests/test_graphs.py::test_cuda_graphs_equal_eager_cuda_and_agree_with_the_cpu
        tests/test_gpu_kit.py)
else
    PY=${PY:-python3}
    DEVICE=cuda
    MODEL_ARGS=()
    STEP_ARGS=(--device cuda --kernels torch triton)
    SERVE_ARGS=(--device cuda --levels 1 32 256)
    PROFILE_ARGS=(--device cuda --batch 256 --steps 20)
    TESTS=(tests/test_graphs.py tests/test_gpu_kit.py tests/test_triton_ops.py)
fi

START=$SECONDS
RESULTS=()
FAILED=0

# phase NAME CAP_S LOG CMD...: run CMD under `timeout`, at most CAP_S and what is left
# of the budget, its output also into LOG (- for none); a failure is recorded and the
# next phase still runs. Shell functions run as `bash -c NAME` (exported below).
phase() {
    local name=$1 cap=$2 log=$3 left rc=0 t0
    shift 3
    left=$((BUDGET - (SECONDS - START) - 15))
    if ((left < cap)); then cap=$left; fi
    if ((cap < 10)); then
        echo "== $name: SKIPPED, the time budget is spent"
        RESULTS+=("$name: skipped (budget)")
        FAILED=1
        return 0
    fi
    echo
    echo "== $name (at most ${cap}s) $(date -u +%H:%M:%S)"
    t0=$SECONDS
    if [[ $log == - ]]; then
        timeout -k 10 "$cap" "$@" || rc=$?
    else
        timeout -k 10 "$cap" "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
    fi
    RESULTS+=("$name: rc=$rc in $((SECONDS - t0))s")
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
    if ((rc != 0)); then FAILED=1; fi
    return 0
}

skip() {
    echo
    echo "== $1: SKIPPED, $2"
    RESULTS+=("$1: skipped ($2)")
}

install_wheels() {
    set -euo pipefail # run as `bash -c`: the script's options are not inherited
    if ((DRY)); then
        local py312 site
        py312=$(ls ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)
        if [[ -z $py312 ]]; then
            echo "no python3.12 here: the wheels are cp312, their install is tried on the device"
            return 0
        fi
        site=/tmp/gpu_check_dry_site # a cp312 check only: the venv's python does not use it
        rm -rf "$site"
        PIP_ROOT_USER_ACTION=ignore "$py312" -m pip install -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
        echo "installed with $py312 into $site (not on PYTHONPATH: the venv runs the dry run)"
        ls "$site"
        return 0
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    ls /tmp/site
}

info() {
    set -euo pipefail
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.memory \
            --format=csv || true
    else
        echo "nvidia-smi: not here (dry run)"
    fi
    "$PY" - <<'EOF'
import importlib.metadata as md, os, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm {p.major}.{p.minor}",
          p.multi_processor_count, "SMs")
print("cpus", os.cpu_count(), platform.machine())
for name in ("gguf", "cbor2", "wsproto", "orjson", "transitions", "llguidance", "h11", "anyio",
             "numpy", "tokenizers", "jinja2", "prometheus-client", "psutil", "pytest",
             "pytest-timeout", "hypothesis", "pyyaml", "tqdm"):
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = "MISSING"
    print(f"  {name} {version}")
for m in ("gguf", "cbor2", "wsproto", "orjson", "llguidance", "h11"):
    print(f"  import {m}: {__import__(m).__file__}")
EOF
}

stop_leftover_server() {
    # tools/gpu_serving.py stops its server; this is for one killed before it could.
    if [[ -f $SERVER_PID_FILE ]]; then
        local pid
        pid=$(cat "$SERVER_PID_FILE")
        rm -f "$SERVER_PID_FILE"
        if kill -0 "$pid" 2>/dev/null; then
            echo "stopping the leftover server (process group $pid)"
            kill -TERM -- "-$pid" 2>/dev/null || true
            sleep 3
            kill -KILL -- "-$pid" 2>/dev/null || true
        fi
    fi
}

main() {
    echo "tools/gpu_check.sh $( ((DRY)) && echo "--cpu-dry-run (device cpu)" || echo "(device cuda)") at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), budget ${BUDGET}s, output in $OUT"
    echo "the device call: $(print_run_call)"
    if [[ ! -d .whl || ! -f .gpu/model_meta.json.gz ]]; then
        echo ".whl/ or .gpu/model_meta.json.gz is missing: run tools/gpu_prepare.sh here first" >&2
        return 1
    fi
    export DRY PY
    export -f install_wheels info
    phase install 90 - bash -c install_wheels
    if ((DRY)); then
        export PYTHONPATH=$PWD
    else
        export PYTHONPATH=/tmp/site:$PWD
    fi
    export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
    phase info 60 "$OUT/env.txt" bash -c info
    phase model 150 - "$PY" tools/random_gguf.py --meta .gpu/model_meta.json.gz --out "$MODEL" \
        ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} # empty on the GPU: bash < 4.4 calls that unbound
    if ((DRY)); then
        echo "(dry run: the CUDA test below is collected and skips: no CUDA device)"
    fi
    phase tests 240 "$OUT/pytest.txt" env LIFECYCLE_TEST_MODEL="$MODEL" "$PY" -m pytest -q \
        -p no:cacheprovider -rsfEP "${TESTS[@]}"
    if [[ ${RESULTS[-1]} != "tests: rc=0"* ]] && ((!DRY)); then
        # Tell a failure from a warning turned error (pyproject: filterwarnings = error)
        # under this image's package versions: the CUDA test again, warnings shown only.
        phase tests-warnings-shown 150 "$OUT/pytest_warnings_shown.txt" \
            env LIFECYCLE_TEST_MODEL="$MODEL" "$PY" -m pytest -q -p no:cacheprovider -rsfEP \
            -W default "${TESTS[0]}" -k cuda
    fi
    phase step 180 - "$PY" bench/gpu_step.py --model "$MODEL" "${STEP_ARGS[@]}" \
        --json "$OUT/gpu_step.json"
    phase serve 240 - "$PY" tools/gpu_serving.py --model "$MODEL" "${SERVE_ARGS[@]}" \
        --json "$OUT/serving.json" --server-log "$OUT/server.log" --pid-file "$SERVER_PID_FILE"
    stop_leftover_server
    phase profile 90 - "$PY" bench/engine_profile.py --model "$MODEL" "${PROFILE_ARGS[@]}" \
        --json "$OUT/engine_profile.json"
    # The same steps without overlap (the serve phase and the run above overlap on CUDA):
    # what launching each step before reading the last one's tokens saves.
    phase profile-no-overlap 60 - "$PY" bench/engine_profile.py --model "$MODEL" \
        "${PROFILE_ARGS[@]}" --overlap off --top 0 --json "$OUT/engine_profile_no_overlap.json"
    if ((DRY)); then
        skip "CUDA graphs, CUDA events, nvidia-smi" "no GPU here: the step and serve phases ran on the CPU"
    fi
    echo
    echo "== summary ($((SECONDS - START))s of ${BUDGET}s)"
    printf '  %s\n' "${RESULTS[@]}"
    ls -l "$OUT"
    return "$FAILED"
}

set -o pipefail
rc=0
main 2>&1 | tee "$OUT/log.txt" || rc=$?
exit "$rc"
