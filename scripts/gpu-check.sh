#!/usr/bin/env bash
# Real-GPU checks of the interposer (issue 3) in under 5 minutes: builds
# interposer/build/libgpuslice.so, runs the opt-in GPU tests (pytest tests/gpu --gpu: PyTorch,
# CuPy, JAX, nvidia-smi, driver-API benchmarks, and the node agent's NVML calls, XID event
# registration included: tests/gpu/test_agent.py, a second or two, rows agent_inventory and
# agent_xid) and prints one summary table, a row per check,
# PASS/FAIL against the target beside HAMi-core's figures from the issue, then a line per row
# of the issue's bar ("bar CHECK: STATUS figure; command: ...": the figure in full, for the
# issue note, and the command that measures that row alone).
#
#   bash scripts/gpu-check.sh        (from anywhere; PYTHON=... picks the interpreter)
#
# With $OUT set, also writes $OUT/gpu-check.json (rows, versions, raw measurements),
# $OUT/gpu-check.log and $OUT/results.jsonl (each measurement as it is made). Every workload
# runs in its own child process with a timeout bounded by one deadline, so a hang costs that
# check only. Exit status: 0 when no check failed or
# errored (on a machine without a GPU every check skips and the status is 0), else 1.
# The checks run the issue's bar first (tests/gpu/conftest.py ORDER), so a budget too short
# for all of them cuts the other rows; the summary then ends with the GPUCHECK_TESTS=...
# command that runs only what was not reached, for a second call. It also says where the time
# went (every test's seconds, set-up included, in the JSON; the slowest in the log).
#
# Knobs: GPUCHECK_TESTS (default tests/gpu: the test files or node ids to run, e.g.
# "tests/gpu/test_compute.py" to run only the SM-limit rows; rows not run then show ERROR),
# GPUCHECK_BUDGET_S (default 285: seconds for everything), GPUCHECK_PYTEST_ARGS
# (extra pytest words, e.g. "-k memory" to rerun a part; rows not run then show ERROR),
# GPUCHECK_LIB (check another build of the library), GPUCHECK_LOG_LEVEL (LIBCUDA_LOG_LEVEL of
# the capped children).
set -u
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
budget=${GPUCHECK_BUDGET_S:-285}   # seconds for the whole script, build included
start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpucheck.XXXXXX") || exit 1
outdir=${OUT:-$work}
mkdir -p "$outdir"
# the measurements go where $OUT collects them as they are made: a run cut off from outside
# (the device's time limit) still brings back every row measured so far
export GPUCHECK_WORK="$work" GPUCHECK_RESULTS="$outdir/results.jsonl"
export GPUCHECK_DEADLINE=$((start + budget - 15))   # children end by then; the rest: summary
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# a child that crashes, or is aborted past its time to say where it waits, writes no core file
# (gigabytes for a framework's process, on the machine's small disk); its report is on stderr
ulimit -c 0
export PATH="$PATH:/usr/local/nvidia/bin:/usr/local/cuda/bin"
unset LD_PRELOAD CUDA_DEVICE_MEMORY_LIMIT CUDA_DEVICE_SM_LIMIT CUDA_DEVICE_MEMORY_SHARED_CACHE \
  GPUCHECK_BUILD_FAILED

# The release library alone, with gcc, should a machine lack make (mirrors the Makefile's lib).
build_without_make() {
  (cd interposer && mkdir -p build &&
    gcc -E -P -Isrc -x c src/exports.map.in -o build/exports.map &&
    gcc -std=gnu11 -O2 -fPIC -pthread -fvisibility=hidden -ftls-model=initial-exec -Iinclude -Isrc -shared \
      -Wl,--version-script=build/exports.map -Wl,-z,lazy -Wl,-z,relro -Wl,-Bsymbolic-functions \
      -Wl,-soname,libgpuslice.so \
      src/*.c -ldl -o build/libgpuslice.so)
}

build() {
  if ! command -v make >/dev/null 2>&1; then
    echo "make not found: building the release library with gcc alone"
    build_without_make
    return
  fi
  # the GPU tests load only the release library: the sanitizer builds and fakes are CI's
  make -s -j"$(nproc 2>/dev/null || echo 2)" -C interposer lib && return 0
  echo "make lib FAILED; building the release library with gcc alone"
  build_without_make
}

main() {
  echo "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), work dir $work"
  echo "== build: make -s -j\$(nproc) -C interposer lib"
  if build; then
    ls -l interposer/build/libgpuslice.so
  else
    echo "build FAILED: the checks that need the library will show ERROR"
    # a library an earlier build left in interposer/build is not this code's: not checked
    export GPUCHECK_BUILD_FAILED=1
  fi
  echo "== GPU"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv
  else
    echo "nvidia-smi not found: its row (in-container nvidia-smi) will show ERROR; the other checks"
    echo "read NVML through pynvml (no NVIDIA GPU or driver there: every check skips)"
  fi
  echo "== tests: $PY -m pytest tests/gpu --gpu"
  # without these no row can run: said once here rather than by a collection error per row
  local missing
  missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("pytest", "pynvml") if u.find_spec(m) is None))' 2>/dev/null) ||
    missing="(it does not run)"
  if [ -n "$missing" ]; then
    echo "$PY lacks: $missing; every row will show ERROR (PYTHON=... names another interpreter)"
  fi
  local left=$((start + budget - 8 - $(date +%s)))
  if [ "$left" -gt 20 ]; then
    # shellcheck disable=SC2086  # GPUCHECK_PYTEST_ARGS is a list of words on purpose
    # shellcheck disable=SC2086  # GPUCHECK_TESTS is a list of paths on purpose
    # the repository root on the path: tests/gpu reads regions with webhook.node.region
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=5 "$left" "$PY" -m pytest ${GPUCHECK_TESTS:-tests/gpu} --gpu -p no:cacheprovider -q \
      --tb=short ${GPUCHECK_PYTEST_ARGS:-}
    echo "pytest exit status $? after $(( $(date +%s) - start )) s"
  else
    echo "no time left for the tests"
  fi
  echo "== summary ($(( $(date +%s) - start )) s)"
  "$PY" tests/gpu/summary.py "$GPUCHECK_RESULTS" --json "$outdir/gpu-check.json"
}

main 2>&1 | tee "$outdir/gpu-check.log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  rm -rf "$work"
else
  echo "results: $work/gpu-check.json, log: $work/gpu-check.log"
fi
exit "$status"
