"""The docs: the generated tables match kinds.def and options.def, and nothing tracked refers to a
path outside the repository. Needs neither torch nor the built package."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "scripts" / "gen_docs.py"


def _gen(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GEN), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


def test_generated_tables_are_up_to_date():
    r = _gen("--check")
    assert r.returncode == 0, (
        f"{r.stderr.strip()}\n(python3 scripts/gen_docs.py rewrites the tables from "
        "host/include/trainsan/kinds.def and options.def)")


def _copy_tree(tmp_path: Path) -> Path:
    for rel in ("README.md", "docs/kinds.md", "docs/options.md",
                "host/include/trainsan/kinds.def", "host/include/trainsan/options.def"):
        dst = tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dst)
    return tmp_path


def test_a_new_row_makes_the_docs_stale_until_regenerated(tmp_path):
    root = _copy_tree(tmp_path)
    kinds = root / "host/include/trainsan/kinds.def"
    kinds.write_text(kinds.read_text(encoding="utf-8") + (
        'TRAINSAN_KIND(example_kind,           kWarning, false, loss,            loss, '
        '"san.watch_loss(loss), or a | pipe",\n              "an example rule, (with) commas")\n'),
        encoding="utf-8")
    options = root / "host/include/trainsan/options.def"
    options.write_text(options.read_text(encoding="utf-8").replace(
        "TRAINSAN_OPTION_BOOL(sync,",
        'TRAINSAN_OPTION_INT(example_option, 7, "[2, inf)", "an example option")\n'
        "TRAINSAN_OPTION_BOOL(sync,"), encoding="utf-8")
    r = _gen("--check", root=root)
    assert r.returncode == 1
    for rel in ("README.md", "docs/kinds.md", "docs/options.md"):
        assert rel in r.stderr
    before = (root / "docs/kinds.md").read_text(encoding="utf-8")
    assert _gen(root=root).returncode == 0
    assert _gen("--check", root=root).returncode == 0
    kinds_md = (root / "docs/kinds.md").read_text(encoding="utf-8")
    assert ("| `example_kind` | warning | opt-in | loss | san.watch_loss(loss), or a \\| pipe | "
            "an example rule, (with) commas |") in kinds_md
    # Hand-written text outside the markers survives.
    assert kinds_md.split("<!-- kinds:end -->")[1] == before.split("<!-- kinds:end -->")[1]
    assert "`example_kind`" in (root / "README.md").read_text(encoding="utf-8")
    options_md = (root / "docs/options.md").read_text(encoding="utf-8")
    assert "| `example_option` | int | `7` | `[2, inf)` | an example option |" in options_md
    assert options_md.index("`example_option`") < options_md.index("| `sync`")


def test_a_malformed_row_is_an_error(tmp_path):
    root = _copy_tree(tmp_path)
    kinds = root / "host/include/trainsan/kinds.def"
    kinds.write_text(kinds.read_text(encoding="utf-8") + (
        'TRAINSAN_KIND(bad_kind, kError, true, loss, somewhere, "x", "y")\n'), encoding="utf-8")
    r = _gen("--check", root=root)
    assert r.returncode == 2 and "bad_kind" in r.stderr and "needs" in r.stderr


def test_a_missing_marker_names_the_file(tmp_path):
    root = _copy_tree(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8").replace("<!-- kinds:end -->", ""),
                      encoding="utf-8")
    r = _gen("--check", root=root)
    assert r.returncode == 2 and "README.md" in r.stderr


# Paths outside the repository: the shared design notes next to the checkout.
_OUTSIDE = re.compile(rb"\.\./shared\b|\bshared/[A-Za-z0-9_.-]+\.md\b")


def test_no_tracked_file_refers_outside_the_repository():
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot list the tracked files")
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout (git ls-files: {r.stderr.decode().strip()})")
    hits = []
    for rel in r.stdout.decode().split("\0"):
        path = ROOT / rel
        if not rel or not path.is_file():
            continue
        for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
            if _OUTSIDE.search(line):
                hits.append(f"{rel}:{n}: {line.decode(errors='replace').strip()}")
    assert not hits, ("these lines refer to files outside the repository; point them at docs/ "
                      "(docs/architecture.md, docs/kinds.md, ...):\n" + "\n".join(hits))


def test_bench_readme_lists_every_script():
    """bench/README.md's table names every program of bench/ (a new one is listed with it)."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "bench/README.md").read_text(encoding="utf-8")
    scripts = [p.name for p in (root / "bench").iterdir()
               if p.suffix in (".py", ".cpp", ".sh") and not p.name.startswith("__")]
    missing = [n for n in scripts if f"`{n}`" not in text]
    assert not missing, f"bench/README.md does not list {missing}"
