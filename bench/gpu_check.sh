#!/usr/bin/env bash
# One prepared run on a GPU machine (written for one H200): build the CUDA extension, run the
# self-test, the GPU tests, the kernel benchmarks, the peers (bench/bench_peers.py), the
# main job and a short run of SMELT tiny on torchtitan, and write every result into one folder.
#
#   bash bench/gpu_check.sh [OUT_DIR]        # under 8 minutes: the stage limits sum to 480 s
#                                            (the GPU tests get 40 s: the self-test checks the kernels)
#
# The self-test runs first, right after the build: `python -m smelt_tools.selftest --device
# cuda --quick` (a few cases per op in float32 and bfloat16; --quick because every case shape
# and dtype is a Triton compile on a fresh machine) under a 60 s limit. Its table goes to
# OUT_DIR/selftest_cuda.txt (and the log), every row to selftest_cuda.json; stopped by the
# limit, it still writes the rows that finished and says it was interrupted. The Triton
# kernels it compiles stay in Triton's cache for the GPU tests after it.
#
# It expects torch (with CUDA), triton and nvcc already installed and no network: the package
# is installed without dependencies. Peers that pip would fetch (sonic-moe, FlashAttention-3's
# `flash_attn_interface`) travel as wheels: on a machine with network, for the GPU image's
# Python and CUDA,
#   pip download --no-deps --only-binary=:all: --python-version 3.X --dest wheels <package>
# (or build the wheel there), put them in ./wheels at the repository root and carry that
# folder with the run; this script installs them offline (pip --no-index --find-links wheels).
# Without ./wheels those peers are listed as not importable. torchtitan (extra `titan`) travels
# the same way, with the dependencies it names that the image lacks; without it the torchtitan
# stage is skipped and summary.md says so. Each stage has its own time limit
# and a failed stage does not stop the others; OUT_DIR/summary.md says what ran, how long it
# took and how it ended. Without a visible CUDA device it refuses in one line before it
# writes anything (exit 2); when any stage fails it ends with one line naming the failed
# stages and exit status 1. Logs are merged into one file; nothing is written more than
# two folders down (summary, log, and each benchmark's JSON and Markdown).
set -u
PY=${PYTHON:-python3}  # the interpreter that has torch (CUDA), triton and pytest
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: error: no CUDA device is visible to $PY (torch.cuda.is_available() is False, or torch is missing): run it on a machine with a GPU" >&2
  exit 2
fi
OUT=${1:-${OUT:-$(dirname "$0")/../runs/gpu_check}}  # runs/ is git-ignored
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the script moves to the repository root
cd "$(dirname "$0")/.."
SUMMARY="$OUT/summary.md"
LOG="$OUT/log.txt"
: >"$LOG"
echo "# smelt GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$SUMMARY"
echo >>"$SUMMARY"
echo "| stage | seconds | exit |" >>"$SUMMARY"
echo "|---|---|---|" >>"$SUMMARY"

FAILED=()  # the stages that exited non-zero (a time limit exits 124)
STAGES=0
stage() {  # stage NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "===== $name: $* =====" >>"$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "| $name | $((SECONDS - t0)) | $rc |" >>"$SUMMARY"
  echo "===== $name: exit $rc after $((SECONDS - t0)) s =====" >>"$LOG"
  STAGES=$((STAGES + 1))
  [ "$rc" -eq 0 ] || FAILED+=("$name")
  return 0
}

stage environment 10 bash -c 'nvidia-smi; $0 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())" && nvcc --version' "$PY"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
if compgen -G "wheels/*.whl" >/dev/null; then
  stage wheels 20 "$PY" -m pip install --no-index --find-links wheels --no-deps wheels/*.whl
else
  echo "| wheels | 0 | skipped: no ./wheels/*.whl |" >>"$SUMMARY"
fi
stage build 120 env SMELT_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e .
stage selftest 60 bash -c 'exec "$0" -m smelt_tools.selftest --device cuda --quick \
  --json "$1/selftest_cuda.json" >"$1/selftest_cuda.txt"' "$PY" "$OUT"
cat "$OUT/selftest_cuda.txt" >>"$LOG" 2>/dev/null
stage extension 20 "$PY" -c "from smelt_kernels import backends; print(backends.report('cuda')); assert backends.extension('_cuda') is not None, backends.extension_error('_cuda')"
# GPU tests: the kernels on CUDA against the references, capture, and the rest of the suite's
# CUDA-marked cases (everything else ran on the CPU in CI).
stage gpu_tests 40 "$PY" -m pytest tests -q -rfE -k "cuda or gpu or capture or triton" -p no:cacheprovider \
  --ignore=tests/tools/test_audit.py  # the static audit needs no GPU: it ran here already
stage bench_moe_gemm 40 "$PY" bench/bench_moe_gemm.py --device cuda --dtypes bfloat16 --out "$OUT"
stage bench_attention 40 "$PY" bench/bench_attention.py --device cuda --out "$OUT"
# the peers a user would pick instead, timed on the same GPU in the same run
stage bench_peers 60 "$PY" bench/bench_peers.py --out "$OUT"
# the main job stops by itself before a round that would pass --max-time: inside the stage's
# limit it measures a round or two, which the verdicts report as unsettled (too few pairs)
stage looped_vs_baseline 40 "$PY" bench/looped_vs_baseline.py --preset 200M-S95 --device cuda \
  --tokens 32768 --max-time 30 --quiet --json "$OUT/looped_vs_baseline_cuda.json"
# SMELT tiny through torchtitan's trainer on one GPU: smelt's kernels inside its loop (a few
# steps; the loss and throughput lines are in the log), every layer but the last two
# recomputed for its backward (recompute all-but-2 on CUDA)
if "$PY" -c "import torchtitan" 2>/dev/null; then
  stage titan_smelt_tiny 30 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m smelt_model.titan --config tiny-smelt --training.steps 6 --training.seq_len 256 \
    --training.local_batch_size 4 --moe_comm.keep_activations 2 \
    --dump_folder "$(mktemp -d)" activation_checkpoint:full
else
  echo "| titan_smelt_tiny | 0 | skipped: torchtitan is not importable (carry it in ./wheels) |" >>"$SUMMARY"
fi
echo >>"$SUMMARY"
echo "Full output: log.txt. Tables: *.md; every number: *.json." >>"$SUMMARY"
ls -la "$OUT" >>"$LOG"
if [ "${#FAILED[@]}" -gt 0 ]; then
  line="${#FAILED[@]} of $STAGES stages failed: ${FAILED[*]} (see $OUT/summary.md and $OUT/log.txt)"
  echo "$line" >>"$SUMMARY"
  echo "gpu_check: $line" >&2
  exit 1
fi
echo "gpu_check: all $STAGES stages passed; results in $OUT"
