"""The LibTorch programs of examples/cpp (an MNIST classifier, a polynomial regression, a DCGAN),
written as the public C++ examples are and taking TrainSan in three lines, built against the
installed package with only trainsan.cmake_prefix_path (find_package(Torch) before or after
find_package(trainsan); plain and keyword target_link_libraries), run clean and with planted bugs.
"""

import json
import re
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import trainsan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "cpp"

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("c++") is None,
    reason="cmake and a C++ compiler are needed to build the LibTorch examples",
)


def _added_lines(source: Path) -> list:
    """Lines that mention TrainSan at all (its include, the sanitizer, its calls)."""
    return [l for l in source.read_text().splitlines()
            if not l.lstrip().startswith("//")
            and re.search(r"\btrainsan\b|\bsan\.|// trainsan$", l)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Configures and builds the three examples in one build tree each; {name: executable}."""
    out = {}
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    launcher = shutil.which("ccache")
    for name in ("mnist", "regression", "dcgan"):
        build = tmp_path_factory.mktemp(name)
        cmd = ["cmake", "-S", str(EXAMPLES / name), "-B", str(build), *gen,
               "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_PREFIX_PATH={trainsan.cmake_prefix_path}"]
        if launcher:
            cmd.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"configure {name}:\n{r.stdout}\n{r.stderr}"
        r = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, f"build {name}:\n{r.stdout}\n{r.stderr}"
        out[name] = build / name
    return out


def _run(exe: Path, tmp_path: Path, bug: str = "", policy: str = "record"):
    trace = tmp_path / f"{exe.name}-{bug or 'clean'}-{policy}.jsonl"
    env = dict(os.environ, TRAINSAN_OPTIONS=f"policy={policy},trace={trace}")
    args = [str(exe)] + (["--bug", bug] if bug else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env,
                       cwd=tmp_path)
    records = [json.loads(l) for l in trace.read_text().splitlines()] if trace.exists() else []
    return r, records


def _findings(records):
    return [r for r in records if r["type"] == "finding"]


@pytest.mark.parametrize("name", ["mnist", "regression", "dcgan"])
def test_three_added_lines(name):
    source = EXAMPLES / name / f"{name}.cpp"
    assert len(_added_lines(source)) <= 3, _added_lines(source)


@pytest.mark.parametrize("name", ["mnist", "regression", "dcgan"])
def test_clean_runs_are_silent(built, tmp_path, name):
    r, records = _run(built[name], tmp_path)
    assert r.returncode == 0, r.stderr
    assert _findings(records) == []
    summary = [x for x in records if x["type"] == "summary"]
    assert summary and summary[-1]["steps"] > 0
    cov = summary[-1]["coverage"]
    assert cov["training_forwards"] > 0 and cov["steps_checked"] > 0 and cov["losses_checked"] > 0
    header = records[0]
    assert header["type"] == "header" and header["torch"] and header["argv"][0].endswith(name)


BUGS = [
    ("mnist", "stale_grad", "stale_grad"),
    ("mnist", "eval_mode", "eval_mode"),
    ("mnist", "label_range", "label_range"),
    ("regression", "broadcast", "broadcast"),
    ("regression", "skipped_step", "skipped_step"),
    ("dcgan", "no_grad_generator", "no_grad_leak"),
    ("dcgan", "eval_mode", "eval_mode"),
]


@pytest.mark.parametrize("name,bug,kind", BUGS)
def test_planted_bugs_are_found(built, tmp_path, name, bug, kind):
    r, records = _run(built[name], tmp_path, bug)
    kinds = {f["kind"] for f in _findings(records)}
    assert kind in kinds, (kinds, r.stderr[-2000:])


def test_nan_loss_is_in_the_trace_before_the_programs_own_assert_aborts(built, tmp_path):
    # mnist asserts `!isnan(loss.item())` before loss.backward(), as pytorch/examples' MNIST
    # does; a NaN pixel in the second epoch's fourth batch (after a test pass) makes the loss
    # NaN there and the program aborts: the finding, of that step, is already in the trace, and
    # printed under policy raise.
    for policy in ("record", "raise"):
        r, records = _run(built["mnist"], tmp_path, "nan_loss", policy=policy)
        assert r.returncode != 0 and "isnan" in r.stderr, r.stderr[-2000:]
        nan = [f for f in _findings(records) if f["kind"] == "nonfinite_loss"]
        assert nan and nan[0]["step"] == 13, (_findings(records), r.stderr[-2000:])
        assert ("nonfinite_loss at step 13" in r.stderr) == (policy == "raise"), r.stderr[-2000:]


def test_op_audit_names_the_programs_frame(built, tmp_path):
    # No Python frame in a LibTorch program: the finding names the program's own frame.
    _, records = _run(built["regression"], tmp_path, "broadcast")
    msg = [f["message"] for f in _findings(records) if f["kind"] == "broadcast"][0]
    assert "regression" in msg and " in main" in msg, msg


def test_dcgan_names_the_generator(built, tmp_path):
    _, records = _run(built["dcgan"], tmp_path, "no_grad_generator")
    leak = [f for f in _findings(records) if f["kind"] == "no_grad_leak"]
    assert leak and "G." in leak[0]["message"], leak
    assert not any("D." in f["message"] for f in leak), leak


def test_policy_raise_stops_the_program_with_a_complete_trace(built, tmp_path):
    # Uncaught, TrainingBugError ends the program (std::terminate): the trace still has its
    # summary, written before the throw.
    r, records = _run(built["mnist"], tmp_path, "stale_grad", policy="raise")
    assert r.returncode != 0
    assert "stale_grad" in r.stderr or "gradient" in r.stderr
    assert any(x["type"] == "summary" for x in records)
    assert any(f["kind"] == "stale_grad" for f in _findings(records))
