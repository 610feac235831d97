#!/usr/bin/env bash
# The checks for a session lent a GPU machine (docs/benchmarks.md, "On a GPU"), in one call:
# the CUDA tests, then the benchmarks whose figures the docs record. Writes under $OUT
# (default results/device): env.txt, tests.log, bench_engine.json, run_*.txt.
#   bash benchmarks/device_check.sh     # about 7.5 minutes on one H200 (tests 3.3, bench 2.5)
set -uo pipefail
OUT=${OUT:-results/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; nproc
  python3 -c "import sys, torch, numba, numpy; print(sys.version.split()[0], torch.__version__, numba.__version__, numpy.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# numba-cuda still names np.row_stack, which numpy 2.5 removed: give it back for these runs
mkdir -p /tmp/shim
printf 'import numpy as np\nif not hasattr(np, "row_stack"):\n    np.row_stack = np.vstack\n' \
    > /tmp/shim/sitecustomize.py
export PYTHONPATH=/tmp/shim:$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 \
    || echo "pip install -e . failed (see pip.txt); running from the tree" | tee -a "$OUT/env.txt"
loradyn() { python3 -c 'import sys; from sims.cli import main; sys.argv[0] = "loradyn"; main()' "$@"; }

# 1. the CUDA tests: every test parametrised on the device (cuda rows), the kernel tests that
#    LORADYN_TEST_CUDA enables, and every learner's law on CUDA against the CPU
echo "== tests"
# (pytest-benchmark, in that image, warns under xdist, and the warning filter makes it an error)
LORADYN_TEST_CUDA=1 timeout 280 python3 -m pytest -rfEs -n 8 -p no:cacheprovider -p no:benchmark -m "" \
    tests/test_device_law.py tests/test_engine_invariants.py tests/test_learner_moment.py \
    tests/test_reduced_cuda_sim.py tests/test_network_chain.py tests/test_chain_segments.py \
    -k "cuda or law" 2>&1 | tail -40 | tee "$OUT/tests.log"

# 2. the engine benchmark on CUDA (full engine, every learner, reduced chain with 32768 runs)
echo "== bench engine"
timeout 180 bash -c "$(declare -f loradyn); loradyn bench engine --device cuda --dtype float32 \
    --reduced-runs 32768 --repeats 3" 2>&1 | tee "$OUT/bench_engine.txt"

# 3. a CUDA run against the CPU run of the same spec (same streams on the reduced engine)
echo "== runs"
for dev in cuda cpu; do
  ( time loradyn run examples/quickstart.toml --engine reduced --device $dev --runs 4096 \
        --out "$OUT/quick_$dev.h5" ) > "$OUT/run_$dev.txt" 2>&1
  tail -4 "$OUT/run_$dev.txt"
done
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/run_cuda.txt"
import sys, h5py, numpy as np
a, b = (h5py.File(f"{sys.argv[1]}/quick_{d}.h5", "r") for d in ("cuda", "cpu"))
x, y = a["overlap"][()], b["overlap"][()]
print("reduced cuda vs cpu, largest |overlap difference|:", float(np.nanmax(np.abs(x - y))))
PY
rm -f "$OUT"/quick_*.h5
