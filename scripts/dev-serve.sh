#!/usr/bin/env bash
# Set up (idempotent) and run the webhook + extender on https://127.0.0.1:8443 with the
# embedded default settings and development certificates generated under certs/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gpuslice serve --tls-mode dev --cert-dir certs "$@"
