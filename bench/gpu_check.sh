#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run kvtier's CUDA tests, then bench/gpu_transfer.py,
# each under a timeout, and print the figures. Needs only torch (CUDA build), pytest,
# msgpack and xxhash: no vLLM, and no install (PYTHONPATH points at this checkout).
# Figures also land in $OUT/gpu_transfer.json ($OUT defaults to a temporary directory).
# PYTHON picks the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available())"

echo "== cuda tests (tests/cuda, marker cuda)"
timeout 240 $PY -m pytest -q -p no:cacheprovider -m cuda tests/cuda -rs
tests_rc=$?

echo "== CPU-side copy-path tests"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/kvtier/test_transfer.py \
    tests/kvtier/test_layout.py
cpu_rc=$?

echo "== bench/gpu_transfer.py"
timeout 300 $PY bench/gpu_transfer.py --json "$OUT/gpu_transfer.json"
bench_rc=$?

echo "== summary: cuda tests rc=$tests_rc, cpu tests rc=$cpu_rc, bench rc=$bench_rc," \
     "figures in $OUT/gpu_transfer.json"
[ "$tests_rc" -eq 0 ] && [ "$cpu_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
