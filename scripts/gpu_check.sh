#!/usr/bin/env bash
# The whole GPU check in one command: GPU tests, then the benchmarks, logs and JSON under $OUT.
#   usage (device machine, repo root):  bash scripts/gpu_check.sh [quick|full|tests|models] [pytest -k expr]
#   quick / full: GPU tests, then the kernel benchmarks (quick: fewer shapes);
#   tests: GPU tests only; models: the model-level benchmarks only (DeepSeek-V3 layer stack
#   through each Hopper backend with graphs, linear-layer decode vs raw fla, FlashInfer plan
#   host-time breakdown, decode steps eager vs graphs at batch 1-8);
#   fi: the flashinfer_mla slice of all that (its GPU tests, plan host time, decode table vs
#   raw fa3, graph steps), for checking a change to that backend in one short run.
#   triton: the triton slice (its GPU tests, Gluon kernel included; the Gluon probe; decode
#   table of triton and flashmla vs raw FlashMLA; MHA prefill table).
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
if [ "$mode" = fi ]; then
  kexpr="gpu and (fi_schedule or flashinfer or metadata or graph_replay)"
elif [ "$mode" = triton ]; then
  kexpr="(gpu and triton and not kimi and not linear and not fi_schedule) or gluon"
fi
if [ "$mode" != models ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfEx --durations=15 -k "$kexpr" tests/ \
    -p no:cacheprovider 2>&1 | tee "$out/pytest.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

# Benchmark steps: only `python3 -m mla_backends bench ...` and `python3 scripts/tune_triton.py`.
bench_step() {  # name, timeout, command...: one benchmark step, its log at $out/<name>.log
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" 2>&1 | grep -v Warning | tee "$out/$name.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}
if [ "$mode" = fi ]; then
  bench_step plan 60 python3 -m mla_backends bench --suite fi-plan --batch 256 --out "$out/plan"
  bench_step decode 200 python3 -m mla_backends bench --suite anchors \
    --backends flashinfer_mla --peers raw_flashinfer_fa3 --prefill-tokens 0 --out "$out/decode"
  bench_step graphs 150 python3 -m mla_backends bench --config deepseek_v3_h100 \
    --backends flashinfer_mla --batch 1,2,4,8 --kv-len 4096 --heads 16,128 \
    --graphs --layers 8 --out "$out/bench-graphs"
elif [ "$mode" = triton ]; then
  bench_step probe 150 python3 scripts/tune_triton.py probe "$out"
  bench_step decode 240 python3 -m mla_backends bench --suite anchors \
    --backends triton,flashmla --peers raw_flashmla --out "$out/decode"
elif [ "$mode" = models ]; then
  bench_step plan 60 python3 -m mla_backends bench --suite fi-plan --batch 256 --out "$out/plan"
  bench_step linear 120 python3 -m mla_backends bench --suite linear --out "$out/linear"
  bench_step stack ${STACK_TIMEOUT:-240} python3 -m mla_backends bench --suite stack \
    --backends triton,flashinfer_mla,flashmla --out "$out/stack"
  bench_step graphs 150 python3 -m mla_backends bench --config deepseek_v3_h100 \
    --backends flashinfer_mla,flashmla,triton --batch 1,2,4,8 --kv-len 4096 --heads 16,128 \
    --graphs --layers 8 --out "$out/bench-graphs"
elif [ "$mode" != "tests" ]; then
  opts=()  # quick: the first 3 shapes, a 2048-token prefill; PREFILL=False: no prefill
  [ "$mode" = quick ] && opts+=(--quick)
  [ "${PREFILL:-True}" = False ] && opts+=(--prefill-tokens 0)
  bench_step bench ${BENCH_TIMEOUT:-300} python3 -m mla_backends bench --suite anchors \
    --backends triton,flashinfer_mla,flashmla --peers raw_flashmla,raw_flashinfer_fa3 \
    ${opts[@]+"${opts[@]}"} --out "$out"
fi
exit $rc
