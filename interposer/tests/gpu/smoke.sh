#!/usr/bin/env bash
# Developer smoke check of the interposer on a real NVIDIA GPU (not CI; scripts/gpu-check.sh is
# the project's GPU check). Builds, runs the fake-driver test suite on this machine too, then
# interposer/tests/gpu/smoke.py against the real driver. Prints KEY=VALUE lines.
set -u
cd "$(dirname "$0")/../../.."
echo "gcc=$(gcc --version | head -1)"
echo "cuda_h=$(grep -m1 '#define CUDA_VERSION' /usr/local/cuda/include/cuda.h 2>/dev/null)"
t0=$(date +%s)
make -s -C interposer clean
make -s -j8 -C interposer all 2>&1 | tail -20
echo "build.rc=${PIPESTATUS[0]} build.seconds=$(( $(date +%s) - t0 ))"
libdir=$(dirname "$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')")
gcc -O2 -Iinterposer/src -Iinterposer/include interposer/tests/gsprobe.c -o /tmp/gsprobe-real \
  -L"$libdir" -l:libcuda.so.1 -l:libnvidia-ml.so.1 -ldl && echo "probe.built=yes ($libdir)"
interposer/build/tests/abi_check | sed 's/^/abi_check=/'
LD_PRELOAD=$PWD/interposer/build/libgpuslice.so ls / >/dev/null && echo "ls_under_preload=ok"
timeout 300 python3 interposer/tests/gpu/smoke.py  # GS_SMOKE_SECTIONS=throttle,... to run a few
if [ "${GS_SMOKE_PYTEST:-1}" = 1 ]; then
  PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider tests/interposer 2>&1 | tail -4
fi
