"""Note [Patches] (bindings/trainsan/_registry.py): `import trainsan` replaces nothing in torch,
every attribute TrainSan replaces is a row of one table, an attach installs the rows it holds and
its close puts everything back; trainsan.watch_loads() holds the load journal until closed; and
an explicit attach after loads nobody journaled judges what it can see (Note [Loads before
attach], resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import trainsan
from trainsan import _registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every attribute of torch's modules and of their classes (and multiprocessing's), by identity:
# what the interpreter sees before `import trainsan`, after it, while a sanitizer is attached and
# after its close.
_SNAPSHOT = textwrap.dedent("""
    import json, multiprocessing.process, sys, types
    import torch, torch.utils.checkpoint, torch.utils.data, torch.optim.lr_scheduler

    def snapshot():
        out = {}
        for name, mod in list(sys.modules.items()):
            if not (name == "torch" or name.startswith(("torch.", "multiprocessing"))):
                continue
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for k, v in list(d.items()):
                out[f"{name}:{k}"] = id(v)
                if isinstance(v, type) and getattr(v, "__module__", "") == name:
                    for a, w in list(vars(v).items()):
                        out[f"{name}:{k}.{a}"] = id(w)
        return out

    # torch's own bookkeeping, moved by any step (a counter, caches filled at first use)
    MOVING = ("torch.utils.hooks:RemovableHandle.next_id",
              "torch._weights_only_unpickler:_marked_safe_globals_set",
              "torch._higher_order_ops.invoke_leaf_function:_leaf_function_module_retriever")

    def changed(a, b):
        return sorted(k for k in a if k in b and a[k] != b[k] and k not in MOVING)
""")


def _run(body: str) -> dict:
    code = _SNAPSHOT + textwrap.dedent(body)
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # the last line: what it printed


def test_import_replaces_nothing_and_close_puts_back_what_attach_replaced():
    out = _run("""
        def step():
            opt.zero_grad()
            model(torch.randn(4, 3)).square().mean().backward()
            opt.step()

        # torch sets some attributes lazily at a first use (an optimizer class's step wrapper,
        # dynamo's disabled manual_seed): one step first, so that what changes is ours.
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters())
        step()
        before = snapshot()
        import trainsan
        from trainsan import _registry
        after_import = snapshot()
        san = trainsan.attach(model, opt, policy="record")
        step()
        attached = snapshot()
        installed = _registry.installed()
        san.close()
        step()
        closed = snapshot()
        print(json.dumps({"import": changed(before, after_import),
                          "attach": changed(after_import, attached),
                          "close": changed(after_import, closed),
                          "installed": installed,
                          "left": _registry.installed()}))
    """)
    assert out["import"] == [], f"import trainsan replaced: {out['import']}"
    assert out["close"] == [], f"close left replaced: {out['close']}"
    assert out["left"] == []
    # What attach replaced is exactly what the table's attach rows name.
    for key in ("torch:load", "torch:save", "torch.autograd:backward",
                "torch.nn.modules.module:Module.load_state_dict",
                "torch.nn.modules.module:Module.zero_grad",
                "torch.optim.optimizer:Optimizer.zero_grad",
                "torch.utils.checkpoint:checkpoint",
                "torch.utils.data.dataloader:DataLoader.__iter__"):
        assert key in out["attach"], (key, out["attach"])
    assert {"load_journal", "backward", "checkpoint", "save"} <= set(out["installed"])
    assert "optimizer_init" not in out["installed"]  # the launcher's alone


def test_watch_loads_holds_the_journal_until_closed():
    out = _run("""
        import trainsan
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = snapshot()
        w = trainsan.watch_loads()
        watched = snapshot()
        san = trainsan.attach(model, opt, policy="record")
        san.close()
        still = snapshot()
        w.close()
        w.close()  # twice: nothing more to give back
        done = snapshot()
        print(json.dumps({"watched": changed(before, watched), "still": changed(before, still),
                          "done": changed(before, done)}))
    """)
    assert "torch:load" in out["watched"]
    assert "torch.optim.optimizer:Optimizer.load_state_dict" in out["watched"]
    assert "torch:save" not in out["watched"]  # the journal only
    assert sorted(out["still"]) == sorted(out["watched"])  # the sanitizer's close left it held
    assert out["done"] == []


def test_the_table_has_one_row_per_attribute_and_valid_lifetimes():
    from trainsan import _children, _compile, _hooks, _pairing, autograd_checks  # noqa: F401
    from trainsan import recompute, resume  # noqa: F401

    rows = _registry.PATCHES
    assert {"load_journal", "loader_iteration", "backward", "checkpoint", "save", "zero_grad",
            "scaler_step", "getstate", "function_apply", "compile", "compiled_call",
            "optimizer_init", "process_start"} <= set(rows)
    seen: dict = {}
    for name, p in rows.items():
        assert p.lifetimes and set(p.lifetimes) <= set(_registry.LIFETIMES), name
        for t in p.targets:
            assert t not in seen, f"{t} in {seen.get(t)} and {name}"
            seen[t] = name
    with pytest.raises(ValueError, match="one wrapper per attribute"):
        _registry.Patch("again", ("attach",), ["torch.save"], lambda: [])
    with pytest.raises(ValueError, match="not held for"):
        rows["optimizer_init"].acquire("attach")


def _resumed(tmp_path, restore_optimizer: bool, watch: bool):
    """A checkpoint of a trained run (model, Adam, StepLR at epoch 3), restored before an explicit
    attach: the model and scheduler always, the optimizer when asked."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        sched.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": 3}, path)
    watcher = trainsan.watch_loads() if watch else None
    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 2)
    ckpt = torch.load(path)
    model2.load_state_dict(ckpt["model"])
    sched2.load_state_dict(ckpt["scheduler"])
    if restore_optimizer:
        opt2.load_state_dict(ckpt["optimizer"])
    san = trainsan.attach(model2, opt2, policy="record")
    for _ in range(2):
        opt2.zero_grad()
        model2(torch.randn(8, 4)).square().mean().backward()
        opt2.step()
        sched2.step()
    san.close()
    if watcher is not None:
        watcher.close()
    return [f for f in san.findings if f.kind == "optimizer_reset"]


def _resumed_fresh(tmp_path, restore_optimizer: bool) -> list:
    """_resumed without the journal, in a fresh interpreter (here a framework callback of an
    earlier test may still hold it): the messages of its optimizer_reset findings."""
    out = _run(f"""
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import pathlib
        from test_patches import _resumed
        found = _resumed(pathlib.Path({str(tmp_path)!r}), {restore_optimizer!r}, False)
        print(json.dumps([[f.message, f.step] for f in found]))
    """)
    return out


def test_attach_without_the_journal_sees_a_restored_schedule_over_a_fresh_optimizer(tmp_path):
    found = _resumed_fresh(tmp_path, restore_optimizer=False)
    assert len(found) == 1, found
    message, step = found[0]
    assert "was at epoch 3 when TrainSan attached" in message
    assert "watch_loads" in message
    assert step == 0  # the first step (numbered from 0)


def test_attach_without_the_journal_is_silent_on_a_full_restore(tmp_path):
    assert _resumed_fresh(tmp_path, restore_optimizer=True) == []


def test_watch_loads_judges_the_loads_in_full(tmp_path):
    found = _resumed(tmp_path, restore_optimizer=False, watch=True)
    assert len(found) == 1, found
    assert "resumed from a checkpoint that holds an optimizer state" in found[0].message
    assert _resumed(tmp_path, restore_optimizer=True, watch=True) == []


@pytest.mark.parametrize("case", ["fresh", "trained_in_process", "sgd_plain", "restored_later"])
def test_attach_without_the_journal_stays_silent_where_nothing_was_lost(case):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if case == "sgd_plain"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    saved = None
    if case != "fresh":
        for _ in range(3):  # a first phase trained in this process (or the state to restore)
            opt.zero_grad()
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            sched.step()
        saved = opt.state_dict()
    if case == "restored_later":  # a fresh optimizer, its state restored after attach
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched2 = torch.optim.lr_scheduler.StepLR(opt, 2)
        sched2.last_epoch = 3
    if case == "sgd_plain":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # keeps no state: nothing to lose
        sched2 = torch.optim.lr_scheduler.StepLR(opt, 2)
        sched2.last_epoch = 3
    san = trainsan.attach(model, opt, policy="record")
    if case == "restored_later":
        opt.load_state_dict(saved)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
    san.close()
    assert [f for f in san.findings if f.kind == "optimizer_reset"] == []
