#!/usr/bin/env bash
# Fresh machine -> every test: installs what is missing, builds trainsan with its test suites
# (one CMake build, reused by the next run), installs the package, runs CTest (GoogleTest suites
# and pytest). GPU tests are reported as skipped where no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${TRAINSAN_BUILD_DIR:-build/test}
bash scripts/install_deps.sh
"$PY" -m pip install --disable-pip-version-check --no-build-isolation . \
  --config-settings=build-dir="$BUILD_DIR" \
  --config-settings=cmake.define.TRAINSAN_BUILD_TESTS=ON
ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 "$@"
