#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA GPU:
#   1. pytest -m gpu tests/kernels   (compiled kernels vs the references, bf16, > 2**31 offsets)
#   2. pytest -m gpu tests/executor (the executor on CUDA vs the reference; the sampler on
#                                     the device with no host synchronization)
#   3. benchmarks/bench_kernels.py   (prefill/decode vs SDPA and flash-attn; extra args go here,
#                                     e.g. --sweep or --peak-gbs 4800)
#   4. benchmarks/bench_executor.py --gpu-only (the 1B-class configuration end to end: tok/s per
#                                     batch, kernel share, decode bandwidth and its share of
#                                     PEAK_GBS, default 4800 for an H200)
# Everything is printed; the exit status is non-zero if either step failed.
# PYTHON selects the interpreter (default: python3 with torch and triton installed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())"

status=0
echo "== pytest -m gpu tests/kernels tests/executor"
pytest_args=(-m gpu tests/kernels tests/executor -q -p no:cacheprovider -rs)
if ! "$PY" -c "import pytest_asyncio" 2>/dev/null; then
  # pyproject's pytest settings name pytest-asyncio options (--strict-config rejects them
  # without the plugin); the kernel tests need none of them.
  pytest_args=(-c /dev/null --rootdir . "${pytest_args[@]}")
fi
"$PY" -m pytest "${pytest_args[@]}" || status=1
echo "== benchmarks/bench_kernels.py $*"
"$PY" benchmarks/bench_kernels.py "$@" || status=1
echo "== benchmarks/bench_executor.py --gpu-only"
"$PY" benchmarks/bench_executor.py --gpu-only --steps 8 --warmup 2 --peak-gbs "${PEAK_GBS:-4800}" \
  || status=1
exit "$status"
