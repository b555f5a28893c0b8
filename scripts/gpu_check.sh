#!/usr/bin/env bash
# The whole GPU check: GPU tests, then the benchmarks; logs, JUnit XML and JSON under $OUT.
#   usage (device machine, repo root):  bash scripts/gpu_check.sh MODE [pytest args]
#   tests-1 .. tests-8: one slice of the GPU tests (tests/gpu_slices.py says which tests and
#     its estimate), each sized for one 10-minute device call on a fresh H100; on a warm
#     machine a slice reuses the compile caches of the ones before (Triton, FlashInfer JIT,
#     autotuning under /tmp); tests-all or tests: every slice in one run (no time limit);
#   quick / full: tests-all, then the kernel benchmarks (quick: fewer shapes); in one
#   10-minute call: TESTS=none (benchmarks only) after the slices, or TESTS=tests-N;
#   models: the model-level benchmarks only (DeepSeek-V3 layer stack through each Hopper
#   backend with graphs, linear-layer decode vs raw fla, decode metadata host time and the
#   FlashInfer plan's breakdown, decode steps eager vs graphs at batch 1-8);
#   fi: the flashinfer_mla slice of all that (its tests, tests-4; metadata and plan host time,
#   decode table vs raw fa3, graph steps), for checking a change to that backend in one short
#   run;
#   triton: the triton slice (its bf16 / fp16 tests, tests-2; the Gluon probe; decode table of
#   triton and flashmla vs raw FlashMLA; MHA prefill table).
#   sglang-entry / sglang-kit / sglang-compare / sglang-bench / sglang-tests: the SGLang
#     plug-in through the installed entry point (needs the .sgl bundle,
#     ../shared/sglang/make-bundle.sh .sgl): registration and start-up refusals; SGLang's own
#     MLA kit on one backend (KIT_BACKEND, default mlab_triton) at every page size it takes;
#     the same kit cases through that backend and its SGLang counterpart; decode B64 / kv 4096
#     against SGLang's counterparts; our adapter under real CUDA graphs (scripts/sglang_kit.py).
#   sglang-dsa: SGLang's V3.2 sparse attention call before and after our hook, against fp64
#     and timed (scripts/sglang_dsa_gpu.py; deep_gemm, missing here, stubbed for the import).
#   dcp: decode context parallelism on 2 GPUs: the NCCL equality test, then 128k / B16 / H128
#     DCP 2 against one GPU (scripts/bench_dcp.py), for each of DCP_BACKENDS (default triton;
#     one backend a call on a fresh machine: compiles and FlashInfer's JIT build take minutes).
#   hopper: our triton decode against raw FlashMLA and fa3, eager and graph replay, the tables
#     of the Hopper-kernel targets (PARTS: small, h128, heads, fp8; mla_backends/bench/hopper.py).
#   dsa: DeepSeek-V3.2 sparse decode, 16k-128k, B 1 / 16 / 64, H 128 and 16
#     (scripts/bench_sparse.py); run TESTS=tests-5 first for its GPU tests (tests-1 holds the
#     Gluon sparse kernels' own, tests-4 the top-k kernel's).
#   suite: the whole GPU suite at once, SHARDS (default 12) pytest processes on one GPU, the
#     compiles spread over the host's cores (scripts/pytest_shards.py); SUITE_TREE=DIR runs
#     another checkout's suite instead (the tree before a refactor, with SUITE_SELECT, default
#     "-k gpu tests/"); SUITE_IDS=FILE: those node ids; SUITE_ARGS: pytest_shards.py's options
#     (default: the no-wait tests alone first, fla's tests in two groups); SUITE_LABEL names the
#     outputs, $OUT/suite-LABEL.json (counts, failures) and .tgz (logs, JUnit).
#   ALT_TRITON=FILE (any mode): run under another Triton release than the image's, packed by
#     scripts/make_triton_bundle.sh (the device image has 3.6, torch 2.11's pin).
#   compare: the same rows on another checkout (COMPARE_TREE, e.g. the tree before a refactor,
#     with its own benchmark module) and on this one, one process each, back to back: the
#     metadata host time (`bench --suite metadata`), then the anchors decode table
#     (COMPARE_SHAPES) and an 8192-token MHA prefill for triton, flashinfer_mla and flashmla
#     against raw FlashMLA and fa3.
# Each test run writes $OUT/pytest-SLICE.log and $OUT/pytest-SLICE.xml (JUnit).
# Expects the kernel bundle at .gpu (../shared/gpu/make-bundle.sh .gpu), or packages installed.
set -uo pipefail
mode=${1:-full}
shift $(($# > 0 ? 1 : 0))
out=${OUT:-/tmp/mla-gpu-check}
mkdir -p "$out"
[ -f .gpu/activate.sh ] && source .gpu/activate.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# Compile caches outside the checkout, kept between calls on a warm machine.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/mla-triton-cache}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/mla-flashinfer}
# ALT_TRITON=FILE: any mode under another Triton release than the image's (the tarball of
# scripts/make_triton_bundle.sh, carried in an ignored folder), unpacked once per machine
# ahead of the image's, with a compile cache of its own
if [ -n "${ALT_TRITON:-}" ]; then
  alt=/tmp/alt-triton/$(basename "$ALT_TRITON" .tar.xz)
  if [ ! -d "$alt/triton" ]; then
    mkdir -p "$alt" && tar -xJf "$ALT_TRITON" -C "$alt" ||
      { echo "ALT_TRITON: cannot unpack $ALT_TRITON" >&2; exit 2; }
  fi
  # Hazard: backends found through entry points would include the image Triton's own
  # (its AMD one, not packed): take only the packed tree's
  export PYTHONPATH=$alt:$PYTHONPATH TRITON_CACHE_DIR=$alt-cache TRITON_BACKENDS_IN_TREE=1
  export ALT_TRITON_DIR=$alt  # its ptxas: $ALT_TRITON_DIR/triton/backends/nvidia/bin/
fi
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  python3 -c "import sgl_kernel; print('sgl_kernel', getattr(sgl_kernel, '__version__', '?'))" 2>&1 | tail -1
} | tee "$out/env.txt"

rc=0
run_tests() {  # slice (tests-1 .. tests-N, tests-all), extra pytest args
  local slice=$1 limit=${TEST_TIMEOUT:-560}
  shift
  [ "$slice" = tests-all ] && limit=${TEST_TIMEOUT:-7200}
  # Autotuning results cached too (fla's autotuning alone can fill a device call).
  TRITON_CACHE_AUTOTUNING=1 timeout "$limit" python3 -m pytest -q -rfEsx --durations=15 \
    -p no:cacheprovider --gpu-slice "$slice" --junitxml "$out/pytest-$slice.xml" "$@" tests/ \
    2>&1 | tee "$out/pytest-$slice.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}
tests=${TESTS:-}  # the slice a benchmark mode runs first; "none": benchmarks only
case $mode in
  tests-[0-9]*|tests-all) tests=$mode ;;
  tests|quick|full) tests=${tests:-tests-all} ;;
  fi) tests=${tests:-tests-4} ;;
  triton) tests=${tests:-tests-2} ;;
esac
[ -n "$tests" ] && [ "$tests" != none ] && run_tests "$tests" "$@"

# Benchmark steps: `python3 -m mla_backends bench ...`, `scripts/tune_triton.py`, and for the
# integrations `scripts/sglang_kit.py` and `scripts/bench_sparse.py`.
bench_step() {  # name, timeout, command...: one benchmark step, its log at $out/<name>.log
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" 2>&1 | grep -v Warning | tee "$out/$name.log" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}
if [ "$mode" = fi ]; then
  bench_step metadata 60 python3 -m mla_backends bench --suite metadata --out "$out/metadata"
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
  bench_step metadata 60 python3 -m mla_backends bench --suite metadata --out "$out/metadata"
  bench_step plan 60 python3 -m mla_backends bench --suite fi-plan --batch 256 --out "$out/plan"
  bench_step linear 120 python3 -m mla_backends bench --suite linear --out "$out/linear"
  bench_step stack ${STACK_TIMEOUT:-240} python3 -m mla_backends bench --suite stack \
    --backends triton,flashinfer_mla,flashmla --out "$out/stack"
  bench_step graphs 150 python3 -m mla_backends bench --config deepseek_v3_h100 \
    --backends flashinfer_mla,flashmla,triton --batch 1,2,4,8 --kv-len 4096 --heads 16,128 \
    --graphs --layers 8 --out "$out/bench-graphs"
elif [ "$mode" = sglang-dsa ]; then
  [ -f .sgl/activate.sh ] && source .sgl/activate.sh
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || rc=1
  bench_step sglang-dsa 570 python3 scripts/sglang_dsa_gpu.py "$out/sglang" --budget 540
elif [[ $mode == sglang-* ]]; then
  case $mode in
    sglang-kit) args=(kit "$out/sglang" --backend "${KIT_BACKEND:-mlab_triton}") ;;
    sglang-compare) args=(compare "$out/sglang" --backend "${KIT_BACKEND:-mlab_triton}") ;;
    sglang-entry|sglang-bench|sglang-tests) args=("${mode#sglang-}" "$out/sglang") ;;
    *) echo "unknown mode $mode (sglang-entry, sglang-kit, sglang-compare, sglang-bench, sglang-tests)" >&2; exit 2 ;;
  esac
  # SGLang finds the backends only through the installed entry point
  [ -f .sgl/activate.sh ] && source .sgl/activate.sh
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || rc=1
  bench_step "$mode" 570 python3 scripts/sglang_kit.py "${args[@]}" --budget 540
elif [ "$mode" = dcp ]; then
  # two GPUs (nvidia-h200-x2); NVLink multicast stays off (launch.py sets it for the ranks too)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for be in ${DCP_BACKENDS:-triton}; do
    bench_step "dcp-test-$be" ${DCP_TEST_TIMEOUT:-300} python3 -m pytest -v -s \
      -p no:cacheprovider -m multigpu tests/test_dcp.py -k "$be"
    bench_step "dcp-bench-$be" ${DCP_BENCH_TIMEOUT:-240} python3 scripts/bench_dcp.py \
      --backends "$be" --iters 50 --out "$out/dcp-$be.json"
  done
elif [ "$mode" = suite ]; then
  tree=${SUITE_TREE:-.}
  if [ "$tree" = . ]; then
    label=${SUITE_LABEL:-after}
    read -ra select <<< "${SUITE_SELECT:---gpu-slice tests-all tests/}"
    if [ -f .sgl/activate.sh ]; then  # the SGLang plug-in's GPU tests (tests-3)
      source .sgl/activate.sh
      python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || rc=1
    fi
  else
    label=${SUITE_LABEL:-before}
    read -ra select <<< "${SUITE_SELECT:--k gpu tests/}"
    export PYTHONPATH=$(cd "$tree" && pwd):$PYTHONPATH
  fi
  # the no-wait tests run alone first; fla's autotuning (linear and Kimi tests) once a group
  TRITON_CACHE_AUTOTUNING=1 timeout ${SUITE_TIMEOUT:-570} python3 scripts/pytest_shards.py \
    --shards "${SHARDS:-12}" --timeout $((${SUITE_TIMEOUT:-570} - 15)) --cwd "$tree" \
    ${SUITE_ARGS:---serial does_not_wait --group linear_hybrid --group kimi_linear --group test_large_pool_gpu} \
    ${SUITE_IDS:+--ids-from "$SUITE_IDS"} --out "$out/suite-$label" -- "${select[@]}" \
    2>&1 | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  cp "$out/suite-$label/summary.json" "$out/suite-$label.json" 2>/dev/null
  tar czf "$out/suite-$label.tgz" -C "$out" "suite-$label" && rm -rf "${out:?}/suite-$label"
elif [ "$mode" = compare ]; then
  tree=${COMPARE_TREE:?COMPARE_TREE=DIR: the other checkout}
  shapes=${COMPARE_SHAPES:-16:1:64:4096,16:1:128:8192,16:1:256:1024,16:2:128:8192,128:1:64:4096,128:1:128:8192,128:1:256:1024,128:2:64:4096,128:2:128:8192}
  bes=triton,flashinfer_mla,flashmla peers=raw_flashmla,raw_flashinfer_fa3
  # host times alternate (before, after, before, ...): the first on a fresh machine is slow
  for round in $(seq "${COMPARE_ROUNDS:-2}"); do
    for side in before after; do
      dir=$tree && [ $side = after ] && dir=.
      if [ -f "$dir/mla_backends/bench/metadata.py" ]; then  # the benchmark, else the old test
        (cd "$dir" && PYTHONPATH=$(pwd):$PYTHONPATH timeout 120 python3 -m mla_backends bench \
          --suite metadata --out "$out/metadata-$side-$round" 2>&1 | grep " us (host)" |
          tee -a "$out/host-time-$side.log")
      else
        (cd "$dir" && PYTHONPATH=$(pwd):$PYTHONPATH timeout 120 python3 -m pytest -q -s \
          -p no:cacheprovider tests/test_kernel_backends.py -k host_time 2>&1 |
          grep -E "host time median|passed|failed" | tee -a "$out/host-time-$side.log")
      fi
    done
  done
  if [ -d "$tree/mla_backends/bench" ]; then  # a tree with the bench CLI: the same command
    (cd "$tree" && PYTHONPATH=$(pwd):$PYTHONPATH bench_step bench-before 240 python3 -m \
      mla_backends bench --suite anchors --shapes "$shapes" --backends $bes --peers $peers \
      --prefill-tokens 8192 --out "$out/bench-before")
  else (cd "$tree" && PYTHONPATH=$(pwd):$PYTHONPATH bench_step bench-before 240 python3 -c "
import json
from mla_backends import benchmark as b
shapes = [tuple(int(x) for x in s.split(':')) for s in '$shapes'.split(',')]
r = {'decode': b.decode_table('$bes'.split(','), '$peers'.split(','), shapes)}
r['prefill'] = b.prefill_table(['triton', 'flashinfer_mla'], 8192)
json.dump(r, open('$out/bench-before.json', 'w'), indent=1)
print(b.format_result({**r, 'device': '', 'ceilings': b.ceilings(__import__('torch').device('cuda'))}, '$bes'.split(','), '$peers'.split(',')))")
  fi
  bench_step bench-after 240 python3 -m mla_backends bench --suite anchors --shapes "$shapes" \
    --backends $bes --peers $peers --prefill-tokens 8192 --out "$out/bench-after"
elif [ "$mode" = dsa ]; then
  bench_step dsa 570 python3 scripts/bench_sparse.py --out "$out/dsa"
elif [ "$mode" = hopper ]; then
  for part in ${PARTS:-small h128 heads fp8}; do
    bench_step "hopper-$part" ${HOPPER_TIMEOUT:-280} python3 -m mla_backends bench \
      --suite hopper --part "$part" --out "$out/hopper"
  done
elif [ "$mode" = quick ] || [ "$mode" = full ]; then
  opts=()  # quick: the first 3 shapes, a 2048-token prefill; PREFILL=False: no prefill
  [ "$mode" = quick ] && opts+=(--quick)
  [ "${PREFILL:-True}" = False ] && opts+=(--prefill-tokens 0)
  bench_step bench ${BENCH_TIMEOUT:-300} python3 -m mla_backends bench --suite anchors \
    --backends triton,flashinfer_mla,flashmla --peers raw_flashmla,raw_flashinfer_fa3 \
    ${opts[@]+"${opts[@]}"} --out "$out"
elif [ "$mode" != tests ] && [[ $mode != tests-* ]]; then
  echo "unknown mode $mode (tests-1 .. tests-8, tests-all, tests, quick, full, models, fi, triton," \
    "sglang-entry, sglang-kit, sglang-compare, sglang-bench, sglang-tests, sglang-dsa, dcp, dsa, hopper, suite," \
    "compare)" >&2
  exit 2
fi
exit $rc
