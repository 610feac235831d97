#!/usr/bin/env bash
# Issue 40's chain audits at the paper's full sizes, on a machine with many cores (the GPU
# machine's 16; docs/theory/audit.md, "On a GPU machine"). ≥ 1024 runs of a regime are split
# into SHARDS processes of RUNS/SHARDS runs (other seeds), one thread each, all at once; each
# stops its chain after its share of LIMIT (--chain-seconds: what it reached is audited, so
# a time limit still leaves a record) and leaves time for the theory lines from its every
# start; then `chain_audit.py --pool` audits each regime's shards as one run of them all.
# One more job measures the chain on the GPU (numba-cuda, one thread a run) at 10× the quick d.
# Everything is packed into $OUT/audit.tgz at the end.
#   bash benchmarks/device_audit.sh                       # on the GPU machine (≈ 8.5 min)
#   GPU=cpu RUNS=16 SHARDS=2 LIMIT=100 SIZE=--quick REGIMES="fig5 fig2-frozen" \
#       bash benchmarks/device_audit.sh                   # plumbing check
#
# The default regimes: the full-size ones not yet measured (fig1-relu and fig3-finetune ran on
# the 2-core machine), at the one-thread costs measured there (`chain_audit.py --estimate`):
# fig2-frozen 2600 s and fig2-joint 3000 s fit 15 cores × LIMIT, fig4-relu-xi1 (5800 s) gets
# the rest and is audited as far as its chains reach.
# LINES_S: the seconds a shard keeps for its theory lines (205 starts, the costly lines' budget).
set -uo pipefail
OUT=${OUT:-results/device_audit}
GPU=${GPU:-cuda}
RUNS=${RUNS:-1025}
SHARDS=${SHARDS:-5}
LIMIT=${LIMIT:-480}
SIZE=${SIZE:-}
REGIMES=${REGIMES:-fig2-frozen fig2-joint fig4-relu-xi1}
LINE_BUDGET=${LINE_BUDGET:-20}
declare -A LINES_S=([fig1-relu]=250 [fig6-he3]=200 [fig4-relu-xi1]=220 [fig5]=90
                    [fig2-frozen]=120 [fig2-joint]=120 [fig3-finetune]=150 [fig4-he3-xi1]=400)
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 LORADYN_PROGRESS_INTERVAL=60
export PYTHONPATH=$PWD
if [ "$GPU" = cuda ]; then
  # numba-cuda still names np.row_stack, which numpy 2.5 removed (benchmarks/device_check.sh)
  mkdir -p /tmp/shim
  printf 'import numpy as np\nif not hasattr(np, "row_stack"):\n    np.row_stack = np.vstack\n' \
      > /tmp/shim/sitecustomize.py
  export PYTHONPATH=/tmp/shim:$PWD
  { nvidia-smi -L; nproc; } > "$WORK/env.txt" 2>&1
fi
python3 -c "import sys, torch, numba, numpy; print(sys.version.split()[0], torch.__version__, numba.__version__, numpy.__version__)" >> "$WORK/env.txt" 2>&1
audit() { NUMBA_NUM_THREADS=1 timeout "$LIMIT" python3 benchmarks/chain_audit.py "$@"; }

per=$((RUNS / SHARDS))
for regime in $REGIMES; do
  chain=$((LIMIT - ${LINES_S[$regime]} - 10))
  [ "$chain" -ge 10 ] || chain=10
  for ((s = 0; s < SHARDS; s++)); do
    audit --regimes "$regime" $SIZE --runs "$per" --seed "$s" --shared-instance \
        --line-budget "$LINE_BUDGET" --chain-seconds "$chain" --arrays "$WORK/arrays" \
        --json "$WORK/$regime-seed$s.json" > "$WORK/$regime-seed$s.log" 2>&1 &
  done
done
# the GPU: the per-run speed of the chain on numba-cuda (issue 40's 10× d) and its audit
if [ "$GPU" = cuda ]; then
  audit --regimes fig2-frozen --quick --d-mult 10 --runs "$RUNS" --shared-instance \
      --device cuda --chain-seconds $((LIMIT - 120)) --json "$WORK/gpu-fig2-frozen-x10.json" \
      --markdown "$WORK/gpu-fig2-frozen-x10.md" > "$WORK/gpu-fig2-frozen-x10.log" 2>&1 &
fi
wait
for regime in $REGIMES; do
  shards=$(ls "$WORK"/arrays/"$regime"-seed*.npz 2>/dev/null)
  if [ -n "$shards" ]; then
    # shellcheck disable=SC2086
    python3 benchmarks/chain_audit.py --pool $shards --json "$WORK/pooled-$regime.json" \
        --markdown "$WORK/pooled-$regime.md" > "$WORK/pooled-$regime.log" 2>&1
  else
    echo "$regime: no shard finished" > "$WORK/pooled-$regime.log"
  fi
done
rm -rf "$WORK/arrays"
tar czf "$OUT/audit.tgz" -C "$WORK" .
grep -h "chain [0-9]* s to step" "$WORK"/*.log
for regime in $REGIMES; do
  if [ -s "$WORK/pooled-$regime.md" ]; then cat "$WORK/pooled-$regime.md"; echo
  else tail -n 2 "$WORK/pooled-$regime.log"; fi
done
