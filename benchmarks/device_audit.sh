#!/usr/bin/env bash
# Issue 40's chain audits at the sizes a 2-core machine cannot reach (docs/theory/audit.md,
# "At the full size and at 10× d"): benchmarks/chain_audit.py for every regime at the full
# size and the cheap regimes at 10× the quick d, 1024 runs each, in parallel jobs on one GPU
# machine (16 cores + 1 GPU): the GPU queues run the longest chains (numba-cuda, one thread a
# run), the CPU queues the rest (NUMBA_NUM_THREADS each). Each job has its own time limit and
# writes its own JSON and markdown as each regime ends; everything is packed into
# $OUT/audit.tgz at the end.
#   bash benchmarks/device_audit.sh                      # on the GPU machine (≈ 9 min)
#   GPU=cpu RUNS=16 HORIZON=0.02 LIMIT=120 bash benchmarks/device_audit.sh   # plumbing check
set -uo pipefail
OUT=${OUT:-results/device_audit}
GPU=${GPU:-cuda}
RUNS=${RUNS:-1024}
HORIZON=${HORIZON:-1.0}
LIMIT=${LIMIT:-510}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$GPU" = cuda ]; then
  # numba-cuda still names np.row_stack, which numpy 2.5 removed (benchmarks/device_check.sh)
  mkdir -p /tmp/shim
  printf 'import numpy as np\nif not hasattr(np, "row_stack"):\n    np.row_stack = np.vstack\n' \
      > /tmp/shim/sitecustomize.py
  export PYTHONPATH=/tmp/shim:$PWD
  { nvidia-smi -L; nproc; } > "$WORK/env.txt" 2>&1
else
  export PYTHONPATH=$PWD
fi
python3 -c "import sys, torch, numba, numpy; print(sys.version.split()[0], torch.__version__, numba.__version__, numpy.__version__)" >> "$WORK/env.txt" 2>&1

# job NAME DEVICE THREADS "ARGS" REGIME...: the regimes one after another, each its own file
job() {
  local name=$1 device=$2 threads=$3 args=$4; shift 4
  local start=$SECONDS
  for regime in "$@"; do
    local left=$((LIMIT - (SECONDS - start)))
    if [ "$left" -le 5 ]; then echo "$regime: not started (time)" >> "$WORK/$name.log"; continue; fi
    # shellcheck disable=SC2086
    NUMBA_NUM_THREADS=$threads OMP_NUM_THREADS=1 timeout "$left" python3 benchmarks/chain_audit.py \
        --regimes "$regime" --runs "$RUNS" --horizon "$HORIZON" --device "$device" $args \
        --json "$WORK/$name-$regime.json" --markdown "$WORK/$name-$regime.md" \
        >> "$WORK/$name.log" 2>&1
    echo "$regime: rc=$? after $((SECONDS - start)) s" >> "$WORK/$name.log"
  done
}

# the GPU (one thread a run; kernels of several processes share it in turn): the longest
# chains. He₃ at ξ = 1 at the full size (1.2·10¹⁰ run-steps), then the 10× d cells
job gpu1 "$GPU" 2 "--shared-instance" fig4-he3-xi1 &
job gpu2 "$GPU" 2 "--quick --d-mult 10 --shared-instance" fig2-frozen fig2-joint &
job gpu3 "$GPU" 2 "--quick --d-mult 10 --shared-instance" fig4-relu-xi1 &
# the CPU: every other regime at the full size, the rest at 10× d, the quick leftovers, and
# fig1-relu's corrected lines from ≥ 64 starts (a larger line budget)
job cpu1 cpu 4 "--shared-instance" fig6-he3 &
job cpu2 cpu 2 "--shared-instance" fig1-relu fig5 fig3-finetune &
job cpu3 cpu 3 "--shared-instance" fig2-frozen fig2-joint &
job cpu4 cpu 2 "--shared-instance" fig4-relu-xi1 &
job cpu5 cpu 2 "--quick --d-mult 10 --shared-instance" fig5 fig3-finetune &
job cpu6 cpu 1 "--quick --shared-instance --line-budget ${LINE_BUDGET:-330}" fig1-relu &
job cpu7 cpu 1 "--quick --shared-instance" fig4-he3-xi1 fig6-he3 &
wait
tar czf "$OUT/audit.tgz" -C "$WORK" .
ls -la "$WORK"
tail -n 3 "$WORK"/*.log
