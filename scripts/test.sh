#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.tools:$PATH"
exec .venv/bin/python -m pytest "$@"
