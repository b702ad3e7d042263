"""The package's modules import each other in one direction: every module imports on its own, in
a fresh interpreter, the graph of the imports the modules run at import time (ast-parsed: the
module-level ``from . import x``, ``from .x import y``, ``import trainsan...``) has no cycle, and
no function imports a module of the package (a late import is how a cycle hides)."""

from __future__ import annotations

import ast
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import trainsan

PACKAGE = Path(trainsan.__file__).resolve().parent


def _modules() -> dict:
    """dotted module name (``trainsan._hooks``, ``trainsan.integrations.hf``) -> its file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_level(body: list):
    """The import statements a module runs at import time: its body's, and those inside its
    top-level if/try/with blocks (not those inside functions or classes)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _edges(name: str, path: Path, modules: dict) -> set:
    """The package's modules that `name` imports at import time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from . import x` needs the module x; `from .x import y` (y no module) needs x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        for t in targets:
            # `import trainsan.x.y` imports trainsan.x.y; whatever is named, its nearest module
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _cycle(graph: dict) -> list:
    """One cycle of the graph as [a, b, ..., a], or []."""
    state: dict = {}  # name -> 1 on the current path, 2 done
    path: list = []

    def visit(n: str) -> list:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_module_imports_have_no_cycle():
    modules = _modules()
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert "trainsan._hooks" in graph["trainsan.sanitizer"], graph["trainsan.sanitizer"]
    assert "trainsan.sanitizer" in graph["trainsan._attach"]
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_function_imports_the_package():
    late = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for scope in ast.walk(tree):
            if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(scope):
                if isinstance(node, ast.ImportFrom):
                    mods = [node.module or ""] if not node.level else ["." + (node.module or "")]
                elif isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                else:
                    continue
                if any(m.startswith((".", "trainsan")) for m in mods):
                    late.append(f"{name}:{node.lineno} ({scope.name})")
    assert not late, "import the package's modules at module level: " + ", ".join(sorted(set(late)))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def _import_alone(name: str) -> tuple:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "import trainsan; print(trainsan.__file__)")
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                         timeout=300, env=env)
    return name, out


def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = sorted(_modules())
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(_import_alone, names))
    failed = {n: out.stderr.strip().splitlines()[-1:] for n, out in results if out.returncode}
    assert not failed, failed
    for n, out in results:  # the same package as this process's
        assert Path(out.stdout.strip()).resolve() == PACKAGE / "__init__.py", (n, out.stdout)
