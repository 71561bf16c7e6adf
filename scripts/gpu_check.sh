#!/usr/bin/env bash
# The GPU path, checked and timed on a CUDA machine: parity (step == forward, chunked == whole, bf16 vs
# float32) and bf16 training / serving throughput for every detector, then the detector contract suite
# (tests/models) run on the GPU. Needs torch, pytorch-lightning, scikit-learn and pytest (kafka-python for
# the test suite's plugin), nothing else, so it runs from a bare copy of the repository.
# See pipeline/bench/gpu_check.py. `--device cpu --quick` is a smoke run of the first part only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
"$PYTHON" -m pipeline.bench.gpu_check "$@"
if [[ " $* " != *" --quick "* ]]; then
  echo "contract suite (tests/models) on ${TXSENTINEL_TEST_DEVICE:=cuda}:"
  TXSENTINEL_TEST_DEVICE="$TXSENTINEL_TEST_DEVICE" "$PYTHON" -m pytest tests/models -q -p no:cacheprovider
fi
