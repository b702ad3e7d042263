#!/usr/bin/env bash
# Installs what TrainSan needs and is missing; a second run finds everything and returns fast.
# Debian packages: cmake, ninja, GoogleTest, Google Benchmark, ccache (optional), python3-dev
# (for Debian's python3 without its headers).
# PyPI: torch==2.11.0 (LibTorch comes from this wheel), numpy, pytest, scikit-build-core,
# scikit-learn (the demo's bundled digits data set); test-only, best effort: transformers,
# accelerate, lightning and tensorboard (the tests that need them skip without them).
set -euo pipefail
PY=${PYTHON:-python3}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v ccache >/dev/null || need_apt+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
[ -f /usr/include/benchmark/benchmark.h ] || need_apt+=(libbenchmark-dev)
command -v readelf >/dev/null || need_apt+=(binutils)
# Python's headers, for the _trainsan_hot module (Note [Hot path], bindings/csrc/handle.h); from
# Debian's python3-dev only when $PY is Debian's python3 (without them the package still builds
# and uses the torch.classes methods).
if ! "$PY" -c "import os, sys, sysconfig; sys.exit(0 if os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)" 2>/dev/null; then
  case "$(command -v "$PY" 2>/dev/null)" in /usr/bin/*) need_apt+=(python3-dev) ;; esac
fi
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

# Test-only, best effort: tests/python/test_integration_hf.py and test_integration_lightning.py
# (trainsan.integrations) skip without them, so a failure here is reported and the run goes on.
# Pinned to versions whose requirements accept the installed torch 2.11.0 (transformers 5.24.0:
# torch>=2.6 in its extras, accelerate 1.15.0: torch>=2.0.0, lightning and pytorch-lightning
# 2.6.6: torch>=2.1.0,<4.0, torchmetrics 1.9.0: torch>=2.0.0), so pip leaves torch as it is;
# torch==2.11.0 on the same command line makes pip fail rather than change it. About 30 s when
# missing (some 35 wheels, none large), a fraction of a second when present.
# TRAINSAN_SKIP_TEST_DEPS=1 skips them.
if [ "${TRAINSAN_SKIP_TEST_DEPS:-0}" != 1 ]; then
  need_test=()
  has() {  # installed (found, not imported: importing lightning takes seconds)
    "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 1)" 2>/dev/null
  }
  has transformers || need_test+=("transformers==5.24.0")
  has accelerate || need_test+=("accelerate==1.15.0")
  # pytorch-lightning and torchmetrics too: lightning requires them unpinned, and they require
  # torch, so a later release of theirs could ask for another torch.
  has lightning || need_test+=("lightning==2.6.6" "pytorch-lightning==2.6.6" "torchmetrics==1.9.0")
  # tests/python/test_tensorboard.py (python -m trainsan tensorboard); no torch requirement.
  has tensorboard || need_test+=("tensorboard==2.20.0")
  # `report --png` (tests/python/test_bounded_trace.py's plot of a bounded trace); no torch
  # requirement.
  has matplotlib || need_test+=("matplotlib==3.10.8")
  # tests/python/test_fastai.py (fastai's own Optimizer, its Learner and callbacks under the
  # launcher and attach: Note [Optimizer-like objects]). fastai 2.8.12 accepts torch<2.12 and
  # brings torchvision 0.26.0, built for torch 2.11.0 (so the pinned torch stays), and spacy
  # through fastprogress; about 40 s when missing.
  has fastai || need_test+=("fastai==2.8.12")
  # tests/python/test_keras.py (Keras 3 on the torch backend: a keras.Model is a torch Module,
  # trained by Keras's own optimizer in manual mode: Note [Manual mode's model]). keras 3.15.1
  # requires no torch (absl-py, h5py, ml-dtypes, namex, numpy, optree, packaging, rich), so the
  # pinned torch stays; the tests set KERAS_BACKEND=torch.
  has keras || need_test+=("keras==3.15.1")
  if [ ${#need_test[@]} -gt 0 ]; then
    echo "install_deps: pip install ${need_test[*]} (test-only, best effort)"
    if ! "$PY" -m pip install --quiet --disable-pip-version-check \
      "${need_test[@]}" "torch==2.11.0"; then
      echo "install_deps: WARNING: could not install ${need_test[*]}; the integration tests" \
        "(tests/python/test_integration_*.py) will be skipped" >&2
    fi
  fi
fi

# Test-only, best effort: tests/python/test_html_report.py opens the `report --html` page in a
# real headless browser: Debian's chromium driven by Playwright over CDP (launched with
# executable_path=/usr/bin/chromium; `playwright install`, which downloads its own browser, is
# never run). The test skips without either. Playwright 1.55.0 is a single wheel (~8 s); chromium
# and its libraries take a minute or two from apt; both are a fraction of a second when present.
# TRAINSAN_SKIP_TEST_DEPS=1 skips them.
if [ "${TRAINSAN_SKIP_TEST_DEPS:-0}" != 1 ]; then
  if ! command -v chromium >/dev/null; then
    echo "install_deps: apt-get install chromium (test-only, best effort)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    if ! { $SUDO apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; }; then
      echo "install_deps: WARNING: could not install chromium; the browser test" \
        "(tests/python/test_html_report.py) will be skipped" >&2
    fi
  fi
  if ! "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('playwright') else 1)" \
    2>/dev/null; then
    echo "install_deps: pip install playwright==1.55.0 (test-only, best effort)"
    if ! "$PY" -m pip install --quiet --disable-pip-version-check "playwright==1.55.0"; then
      echo "install_deps: WARNING: could not install playwright; the browser test" \
        "(tests/python/test_html_report.py) will be skipped" >&2
    fi
  fi
fi
echo "install_deps: ok ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
