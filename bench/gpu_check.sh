#!/usr/bin/env bash
# One prepared run on a GPU machine (written for one H200): build the CUDA extension, run the
# GPU tests, the kernel benchmarks and the main job, and write every result into one folder.
#
#   bash bench/gpu_check.sh OUT_DIR          # under 8 minutes: the stage limits sum to 470 s
#
# It expects torch (with CUDA), triton and nvcc already installed and no network: the package
# is installed without dependencies. Each stage has its own time limit and a failed stage does
# not stop the others; OUT_DIR/summary.md says what ran, how long it took and how it ended.
# At most eight files are written (logs are merged), none more than two folders down.
set -u
OUT=${1:-${OUT:-gpu_results}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the script moves to the repository root
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # the interpreter that has torch (CUDA), triton and pytest
SUMMARY="$OUT/summary.md"
LOG="$OUT/log.txt"
: >"$LOG"
echo "# smelt GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$SUMMARY"
echo >>"$SUMMARY"
echo "| stage | seconds | exit |" >>"$SUMMARY"
echo "|---|---|---|" >>"$SUMMARY"

stage() {  # stage NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "===== $name: $* =====" >>"$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "| $name | $((SECONDS - t0)) | $rc |" >>"$SUMMARY"
  echo "===== $name: exit $rc after $((SECONDS - t0)) s =====" >>"$LOG"
  return 0
}

stage environment 20 bash -c 'nvidia-smi; $0 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"; nvcc --version' "$PY"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
stage build 150 env SMELT_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e .
stage extension 20 "$PY" -c "from smelt_kernels import backends; print(backends.report('cuda')); assert backends.extension('_cuda') is not None, backends.extension_error('_cuda')"
# GPU tests: the kernels on CUDA against the references, capture, and the rest of the suite's
# CUDA-marked cases (everything else ran on the CPU in CI).
stage gpu_tests 120 "$PY" -m pytest tests -q -rfE -k "cuda or gpu or capture or triton" -p no:cacheprovider
stage bench_moe_gemm 50 "$PY" bench/bench_moe_gemm.py --device cuda --dtypes bfloat16 --out "$OUT"
stage bench_attention 50 "$PY" bench/bench_attention.py --device cuda --out "$OUT"
stage looped_vs_baseline 60 "$PY" bench/looped_vs_baseline.py --preset 200M-S95 --device cuda \
  --tokens 32768 --quiet --json "$OUT/looped_vs_baseline_cuda.json"
echo >>"$SUMMARY"
echo "Full output: log.txt. Tables: *.md; every number: *.json." >>"$SUMMARY"
ls -la "$OUT" >>"$LOG"
