"""Keras 3 on the torch backend (issue 37): a keras.Model is a torch.nn.Module whose variables
are torch Parameters in a ParameterDict of the model's own (its layers are not its submodules),
and Keras's optimizer is no torch optimizer (it updates the variables under no_grad in
train_step): manual mode. Keras builds a model by calling each layer once at top level (a
keras.Input), which used to make the launcher attach the first Dense layer alone; the backwards
now say what is trained (Note [Manual mode's model] in _pairing.py), so the whole model is
watched, through `python -m trainsan run` and through attach(). A subclassed model keeps meta
placeholders of its variables in its layers (Note [Placeholder parameters] in _facts.py).
The loops are written as Keras's docs write them: Sequential (or a subclassed Model), compile,
fit on numpy arrays with validation_split. Clean runs are silent; a NaN in the inputs is found
(nonfinite_loss), and a learning rate of 0 (update_ratio).

Needs keras (scripts/install_deps.sh installs the tested version, best effort); skipped without
it. Every program runs in a subprocess with KERAS_BACKEND=torch (keras reads it at import)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

SKIP_REASON = ("keras is not installed: the test-only dependency of scripts/install_deps.sh "
               "(pip install keras==3.15.1)")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason=SKIP_REASON)

ENV = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
SAMPLES, BATCH, EPOCHS = 160, 16, 2
TRAIN_BATCHES = (SAMPLES * 4 // 5) // BATCH * EPOCHS  # validation_split=0.2: 8 a epoch

PROGRAM = textwrap.dedent(f'''
    import json, os, sys
    import numpy as np
    import keras
    from keras import layers

    case = sys.argv[1]
    keras.utils.set_random_seed(0)
    x = np.random.rand({SAMPLES}, 20).astype("float32")
    y = np.random.randint(0, 3, size=({SAMPLES},))
    if case == "nan":
        x[37, 4] = np.nan  # BUG: a NaN in the inputs
    if case == "subclass":
        class Classifier(keras.Model):
            def __init__(self):
                super().__init__()
                self.hidden = layers.Dense(32, activation="relu")
                self.middle = layers.Dense(16, activation="relu")
                self.out = layers.Dense(3, activation="softmax")

            def call(self, inputs):
                return self.out(self.middle(self.hidden(inputs)))

        model = Classifier()
    else:
        model = keras.Sequential([
            keras.Input(shape=(20,)),
            layers.Dense(32, activation="relu"),
            layers.Dense(16, activation="relu"),
            layers.Dense(3, activation="softmax"),
        ])
    lr = 0.0 if case == "lr0" else 1e-3  # lr0: BUG, nothing trains
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=lr),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    san = None
    if "attach" in sys.argv:
        import trainsan
        model(x[:2])  # (a subclassed model builds its layers at its first call)
        san = trainsan.attach(model, policy="record")
    model.fit(x, y, batch_size={BATCH}, epochs={EPOCHS}, validation_split=0.2, verbose=0)
    if san is not None:
        san.close()
        print("RESULT", json.dumps({{
            "kinds": sorted({{f.kind for f in san.findings}}),
            "steps": san.coverage()["steps_checked"],
            "watched": len(san._ctx.param_ids),
            "trainable": len(model.trainable_weights)}}))
''')


def _run(tmp_path, case: str, launcher: bool) -> subprocess.CompletedProcess:
    path = tmp_path / "train_keras.py"
    path.write_text(PROGRAM)
    trace = tmp_path / f"{case}.jsonl"
    if launcher:
        cmd = [sys.executable, "-m", "trainsan", "run", "--policy", "record", "--trace",
               str(trace), str(path), case]
    else:
        cmd = [sys.executable, str(path), case, "attach"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _trace(tmp_path, case: str) -> tuple:
    """(findings' kinds, the summary record, the header's num_params) of the launcher's trace."""
    kinds, summary, watched = set(), None, None
    with open(tmp_path / f"{case}.jsonl", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("type") == "finding":
                kinds.add(rec["kind"])
            elif rec.get("type") == "summary":
                summary = rec
            elif rec.get("type") == "header":
                watched = rec["num_params"]
    return kinds, summary, watched


def _attached(proc) -> dict:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", ["clean", "subclass"])
def test_attach_watches_the_whole_model_and_a_clean_fit_is_silent(tmp_path, case):
    out = _attached(_run(tmp_path, case, launcher=False))
    # every trainable variable (3 kernels, 3 biases), not the subclass's meta placeholders
    assert out["watched"] == out["trainable"] == 6, out
    assert out["kinds"] == [], out
    assert out["steps"] == TRAIN_BATCHES - 1, out  # manual mode: the last step has no boundary


@pytest.mark.parametrize("case, kind", [("nan", "nonfinite_loss"), ("lr0", "update_ratio")])
def test_attach_finds_the_planted_bug(tmp_path, case, kind):
    out = _attached(_run(tmp_path, case, launcher=False))
    assert kind in out["kinds"], out


@pytest.mark.parametrize("case", ["clean", "subclass"])
def test_launcher_watches_the_whole_model(tmp_path, case):
    proc = _run(tmp_path, case, launcher=True)
    err = proc.stderr
    model = "Sequential" if case == "clean" else "Classifier"
    assert f"trainsan run: {model} with no optimizer (manual mode)" in err, err
    assert "in no attached model" not in err and "no findings" in err, err
    kinds, summary, watched = _trace(tmp_path, case)
    assert not kinds, err
    assert watched == 6, watched  # the three kernels and biases
    assert summary["steps"] >= TRAIN_BATCHES - 1, summary


@pytest.mark.parametrize("case, kind", [("nan", "nonfinite_loss"), ("lr0", "update_ratio")])
def test_launcher_finds_the_planted_bug(tmp_path, case, kind):
    proc = _run(tmp_path, case, launcher=True)
    kinds, _, watched = _trace(tmp_path, case)
    assert kind in kinds, proc.stderr
    assert watched == 6, watched
