#!/usr/bin/env bash
# The Docker image's install steps, runnable outside Docker too (tests/test_packaging.py runs them
# into a fresh virtual environment):
#
#   deploy/docker/install.sh [STEP...]     STEP: torch, project, prepare (default: all three)
#
#   torch     pip install torch==$TORCH_VERSION, from $TORCH_INDEX_URL when set (PyTorch's
#             CPU-only wheel index makes a CPU image several GB smaller: docs/DEPLOY.md)
#   project   build the wheel of the checkout at $SRC (default: this script's checkout) and
#             install it, not editable: only `gptserve` lands in site-packages
#   prepare   gptserve fetch: the default model into $GPTSERVE_CACHE and the CPU kernels for
#             each -march target in $KERNEL_TARGETS into $TORCH_EXTENSIONS_DIR, so that a
#             container neither downloads nor compiles when it starts
#
# PYTHON names the interpreter (default python3); pip installs into its environment.
set -euo pipefail

python=${PYTHON:-python3}
src=${SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(torch project prepare)

for step in "${steps[@]}"; do
    case "$step" in
    torch)
        "$python" -m pip install "torch==${TORCH_VERSION:-2.13.0}" \
            ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
        ;;
    project)
        wheels=$(mktemp -d)
        "$python" -m pip wheel --no-deps -w "$wheels" "$src"
        "$python" -m pip install "$wheels"/gptserve-*.whl
        rm -rf "$wheels"
        ;;
    prepare)
        "$python" -m gptserve fetch --kernels "${KERNEL_TARGETS:-x86-64-v3,x86-64-v4}" \
            ${FETCH_MODELS:+$(printf -- '--model %s ' $FETCH_MODELS)}
        ;;
    *)
        echo "error: unknown step '$step' (torch, project, prepare)" >&2
        exit 2
        ;;
    esac
done
