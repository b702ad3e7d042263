#!/usr/bin/env bash
# Fresh machine -> demo: installs what is missing, builds and installs trainsan, runs the demo.
# Extra arguments go to the demo (e.g. --bug stale_grad, --list-bugs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install_deps.sh
"$PY" -m pip install --quiet --disable-pip-version-check --no-build-isolation .
cd /tmp && exec "$PY" -m trainsan demo "$@"
