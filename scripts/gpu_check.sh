#!/usr/bin/env bash
# The whole GPU check in one command: GPU tests, then the benchmarks, logs and JSON under $OUT.
#   usage (device machine, repo root):  bash scripts/gpu_check.sh [quick|full] [pytest -k expr]
# Expects the kernel bundle at .gpu (../shared/gpu/make-bundle.sh .gpu), or packages installed.
set -uo pipefail
mode=${1:-full}
kexpr=${2:-gpu}
out=${OUT:-/tmp/mla-gpu-check}
mkdir -p "$out"
[ -f .gpu/activate.sh ] && source .gpu/activate.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  python3 -c "import sgl_kernel; print('sgl_kernel', getattr(sgl_kernel, '__version__', '?'))" 2>&1 | tail -1
} | tee "$out/env.txt"

rc=0
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -k "$kexpr" tests/ -p no:cacheprovider \
  2>&1 | tee "$out/pytest.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

if [ "$mode" != "tests" ]; then
  quick=$([ "$mode" = quick ] && echo True || echo False)
  timeout ${BENCH_TIMEOUT:-300} python3 -c "
from mla_backends.benchmark import main
main('$out', ['triton', 'flashinfer_mla', 'flashmla'], ['raw_flashmla', 'raw_flashinfer_fa3'], quick=$quick, prefill=${PREFILL:-True})
" 2>&1 | grep -v Warning | tee "$out/bench.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
exit $rc
