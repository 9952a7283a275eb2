#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA GPU. Stages (GPU_CHECK_STAGES, a
# comma-separated list; default: all four):
#   tests     pytest -m gpu tests/kernels tests/executor (compiled kernels vs the references,
#             bf16, > 2**31 offsets, the quantized GEMMs of every format; the executor on CUDA vs
#             the reference, AWQ/GPTQ/FP8 and GGUF weights kept as stored, the sampler on the
#             device with no host synchronization)
#   quant     benchmarks/bench_quant_kernels.py (the dequantize-in-the-GEMM kernels vs cuBLAS on
#             the dequantized bf16 weight; QUANT_ARGS go here, e.g. "--sweep")
#   attention benchmarks/bench_kernels.py (prefill/decode vs SDPA; extra args go here, e.g.
#             --sweep or --peak-gbs 4800)
#   executor  benchmarks/bench_executor.py --gpu-only (the 1B-class configuration end to end:
#             tok/s per batch, kernel share, decode bandwidth and its share of PEAK_GBS, default
#             4800 for an H200)
# Everything is printed; the exit status is non-zero if any stage failed.
# PYTHON selects the interpreter (default: python3 with torch and triton installed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGES=",${GPU_CHECK_STAGES:-tests,quant,attention,executor},"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())"

status=0
if [[ $STAGES == *,tests,* ]]; then
  echo "== pytest -m gpu tests/kernels tests/executor"
  pytest_args=(-m gpu tests/kernels tests/executor -q -p no:cacheprovider -rs
    --continue-on-collection-errors)
  if ! "$PY" -c "import pytest_asyncio" 2>/dev/null; then
    # pyproject's pytest settings name pytest-asyncio options (--strict-config rejects them
    # without the plugin); the GPU tests need none of them.
    pytest_args=(-c /dev/null --rootdir . "${pytest_args[@]}")
  fi
  "$PY" -m pytest "${pytest_args[@]}" || status=1
fi
if [[ $STAGES == *,quant,* ]]; then
  echo "== benchmarks/bench_quant_kernels.py ${QUANT_ARGS:-}"
  # shellcheck disable=SC2086  # QUANT_ARGS is a list of words
  "$PY" benchmarks/bench_quant_kernels.py ${QUANT_ARGS:-} || status=1
fi
if [[ $STAGES == *,attention,* ]]; then
  echo "== benchmarks/bench_kernels.py $*"
  "$PY" benchmarks/bench_kernels.py "$@" || status=1
fi
if [[ $STAGES == *,executor,* ]]; then
  echo "== benchmarks/bench_executor.py --gpu-only"
  "$PY" benchmarks/bench_executor.py --gpu-only --steps 8 --warmup 2 \
    --peak-gbs "${PEAK_GBS:-4800}" || status=1
fi
exit "$status"
