#!/usr/bin/env bash
# The GPU path, checked and timed on a CUDA machine: parity (step == forward, chunked == whole, bf16 vs
# float32) and bf16 training / serving throughput for every detector. Needs torch and pytorch-lightning
# (scikit-learn, numpy), nothing else, so it runs from a bare copy of the repository. See pipeline/gpu_check.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
exec "$PYTHON" -m pipeline.gpu_check "$@"
