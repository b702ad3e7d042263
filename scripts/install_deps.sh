#!/usr/bin/env bash
# Installs what TrainSan needs and is missing; a second run finds everything and returns fast.
# Debian packages: cmake, ninja, GoogleTest, Google Benchmark, ccache (optional).
# PyPI: torch==2.11.0 (LibTorch comes from this wheel), numpy, pytest, scikit-build-core,
# scikit-learn (the demo's bundled digits data set).
set -euo pipefail
PY=${PYTHON:-python3}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v ccache >/dev/null || need_apt+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
[ -f /usr/include/benchmark/benchmark.h ] || need_apt+=(libbenchmark-dev)
command -v readelf >/dev/null || need_apt+=(binutils)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install_deps: apt-get install ${need_apt[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

need_pip=()
"$PY" - <<'PYEOF' || need_pip+=("torch==2.11.0")
import torch, sys
sys.exit(0 if torch.__version__.split("+")[0] == "2.11.0" else 1)
PYEOF
for mod_pkg in numpy:numpy pytest:pytest scikit_build_core:scikit-build-core sklearn:scikit-learn; do
  mod=${mod_pkg%%:*}; pkg=${mod_pkg#*:}
  "$PY" -c "import $mod" 2>/dev/null || need_pip+=("$pkg")
done
if [ ${#need_pip[@]} -gt 0 ]; then
  echo "install_deps: pip install ${need_pip[*]}"
  "$PY" -m pip install --quiet --disable-pip-version-check "${need_pip[@]}"
fi
echo "install_deps: ok ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
