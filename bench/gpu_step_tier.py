"""The CUDA every-step tier of TrainSan (issue 23 item 2), measured on a GPU.

Phase `tier`, for a 4-layer MLP (about 26M parameters) and a small transformer (about 21M),
bf16 autocast (--dtype fp32 for float32) and AdamW:
  step time      the plain step and the step with ``trainsan.attach(model, opt)`` at the
                 defaults (policy "record" so that nothing raises), alternated in rounds on the
                 same model, timed with CUDA events; the ratio of the medians
  launches       one steady step of each under torch.profiler: kernels per step, the trainsan
                 kernels among them (target: 1, the single-launch statistics pass) and copies
  syncs          blocking calls per steady step: torch's sync debug mode
                 (torch.cuda.set_sync_debug_mode("warn"): synchronising torch calls) and the
                 profiler's synchronising runtime/driver API calls (cudaStreamSynchronize,
                 cudaEventSynchronize, cudaDeviceSynchronize, synchronous cudaMemcpy, ...;
                 trainsan's own calls too, where CUPTI sees its static CUDA runtime); target: 0
  pass time      torch.ops.trainsan.gradient_stats over the model's gradients (the every-step
                 pass: Note [Lean rows]) and tensor_stats (every field) against
                 torch._foreach_norm over the same gradients, CUDA events, median

Phase `stop`: a child process trains with ``device_stop=True`` and plants a NaN in a gradient
at step --nan-step; it must exit non-zero with the "trainsan: device_stop:" message, after steps
that were applied with finite parameters. (After the stop the CUDA context is gone, so the child
cannot read the parameters back; that the optimizer step after the stop never ran is the
kernel's contract, tested in tests/cpp/test_stats_gpu.cpp.) Skipped, with a message, while
trainsan.attach has no device_stop option.

    TRAINSAN_LIBRARY=build/gpu/bindings/libtrainsan_ops.so PYTHONPATH=bindings \\
        python3 bench/gpu_step_tier.py [--phase all|tier|stop] [--rounds 5] [--steps 10]
    python3 bench/gpu_step_tier.py --dry-run     # print the phases; run nothing
    python3 bench/gpu_step_tier.py --device cpu --tiny --phase tier   # smoke test of the script

No CUDA device: prints "skipped: no CUDA device" and exits 0. Exit status: 0 when every phase
that ran met its check (the stop phase: the child stopped as it must), 1 otherwise; the timings
are reported, not judged.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

# Synchronising CUDA runtime / driver API calls, as the profiler names them.
_SYNC_CALLS = (
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cudaMemset", "cuCtxSynchronize", "cuStreamSynchronize",
    "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemcpyHtoD", "cuMemcpyHtoD_v2",
    "cuMemcpy", "cuMemsetD8", "cuMemsetD8_v2", "cuMemsetD32", "cuMemsetD32_v2",
)
_STOP_MESSAGE = "trainsan: device_stop:"


class MLP(torch.nn.Module):
    def __init__(self, width=2560, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x


def Transformer(vocab=8192, d=512, layers=4, heads=8, seq=256):  # noqa: N802 (a model factory)
    """bench_gpt2_gpu.py's GPT without dropout and with an untied head."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_gpt2_gpu import GPT

    return GPT(vocab, d, layers, heads, seq, dropout=0.0, tied=False)


def make_job(kind: str, dev: torch.device, dtype: str, tiny: bool = False):
    """(model, optimizer, step(i)) of one model kind (--tiny: small sizes, for a smoke test)."""
    torch.manual_seed(0)
    width, batch = (64, 8) if tiny else (2560, 256)
    cfg = dict(vocab=512, d=32, layers=2, heads=4, seq=16) if tiny else dict(
        vocab=8192, d=512, layers=4, heads=8, seq=256)
    if kind == "mlp":
        model = MLP(width).to(dev)
        data = [(torch.randn(batch, width, device=dev), torch.randn(batch, width, device=dev))
                for _ in range(4)]

        def loss_of(i):
            x, y = data[i % len(data)]
            return F.mse_loss(model(x).float(), y)
    else:
        model = Transformer(**cfg).to(dev)
        vocab = cfg["vocab"]
        data = [torch.randint(0, vocab, (4 if tiny else 16, cfg["seq"] + 1), device=dev)
                for _ in range(4)]

        def loss_of(i):
            b = data[i % len(data)]
            logits = model(b[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, vocab), b[:, 1:].reshape(-1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step(i):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = loss_of(i)
        loss.backward()
        opt.step()

    return model, opt, step


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def elapsed_ms(dev: torch.device, fn) -> float:
    """Time of fn(): CUDA events on a GPU, the wall clock otherwise."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def timed(dev: torch.device, step, steps: int, i0: int) -> float:
    """ms per step over `steps` steps."""

    def run():
        for i in range(steps):
            step(i0 + i)

    return elapsed_ms(dev, run) / steps


def profile_steps(dev: torch.device, step, steps: int, i0: int) -> dict:
    """Per-step counts over `steps` steady steps: kernels, trainsan kernels, copies, memsets,
    synchronising API calls (profiler) and synchronising torch calls (sync debug mode)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    debug_mode = torch.cuda.set_sync_debug_mode if cuda else (lambda mode: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        debug_mode("warn")
        try:
            with profile(activities=activities) as prof:
                for i in range(steps):
                    step(i0 + i)
                # the end of the window: not a step's sync, so outside the debug mode's count
                debug_mode("default")
                _sync(dev)
        finally:
            debug_mode("default")
    sync_warnings = [w for w in caught if "synchroniz" in str(w.message)]
    kernels = trainsan_kernels = copies = memsets = sync_calls = 0
    sync_names: dict = {}
    for e in prof.events():
        name = e.name
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_device:
            if name.startswith("Memcpy"):
                copies += 1
            elif name.startswith("Memset"):
                memsets += 1
            else:
                kernels += 1
                if "trainsan" in name:
                    trainsan_kernels += 1
        elif name in _SYNC_CALLS:
            sync_calls += 1
            sync_names[name] = sync_names.get(name, 0) + 1
    # The final torch.cuda.synchronize() of the window is one cudaDeviceSynchronize: not a step's.
    if sync_names.get("cudaDeviceSynchronize"):
        sync_names["cudaDeviceSynchronize"] -= 1
        sync_calls -= 1
    n = float(steps)
    return {"kernels": kernels / n, "trainsan_kernels": trainsan_kernels / n,
            "copies": copies / n, "memsets": memsets / n, "sync_api_calls": sync_calls / n,
            "sync_api_names": {k: v for k, v in sync_names.items() if v},
            "sync_debug_warnings": len(sync_warnings) / n,
            "sync_debug_examples": sorted({str(w.message)[:120] for w in sync_warnings})[:3]}


def pass_vs_foreach_norm(dev: torch.device, model, step, iters: int) -> dict:
    """The statistics pass over the gradients (results left on the device) against
    torch._foreach_norm over the same gradients: CUDA events, median of `iters` runs each."""
    step(0)  # fresh gradients (no sanitizer attached)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out = {}
    for name, fn in (("trainsan pass", lambda: torch.ops.trainsan.gradient_stats(grads)),
                     ("full pass", lambda: torch.ops.trainsan.tensor_stats(grads)),
                     ("_foreach_norm", lambda: torch._foreach_norm(grads))):
        for _ in range(3):
            fn()
        out[name] = statistics.median(elapsed_ms(dev, fn) for _ in range(iters))
    out["grad_bytes"] = sum(g.numel() * g.element_size() for g in grads)
    out["grad_tensors"] = len(grads)
    return out


def tier_phase(args) -> tuple[list, bool]:
    import trainsan

    dev = torch.device(args.device)
    rows = []
    for kind in args.models.split(","):
        model, opt, step = make_job(kind, dev, args.dtype, args.tiny)
        nparams = sum(p.numel() for p in model.parameters())
        for i in range(3):  # warm-up: allocator, kernels, autotuning
            step(i)
        times = {"plain": [], "trainsan": []}
        for r in range(args.rounds):
            for name in ("plain", "trainsan"):
                san = trainsan.attach(model, opt, policy="record") if name == "trainsan" else None
                try:
                    if san is not None:
                        for i in range(11):  # snapshot, first checks, the default audit window
                            step(i)
                    times[name].append(timed(dev, step, args.steps, r * args.steps))
                finally:
                    if san is not None:
                        san.close()
        counts = {"plain": profile_steps(dev, step, args.profile_steps, 0)}
        san = trainsan.attach(model, opt, policy="record")
        try:
            for i in range(11):
                step(i)
            counts["trainsan"] = profile_steps(dev, step, args.profile_steps, 0)
        finally:
            san.close()
        floor = pass_vs_foreach_norm(dev, model, step, args.iters)
        plain, ts = statistics.median(times["plain"]), statistics.median(times["trainsan"])
        rows.append({"model": kind, "params_m": nparams / 1e6, "dtype": args.dtype,
                     "plain_ms": plain, "trainsan_ms": ts, "ratio": ts / plain,
                     "rounds": times, "counts": counts, "pass": floor})
        del model, opt, step
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    where = torch.cuda.get_device_name() if dev.type == "cuda" else str(dev)
    print(f"\nstep tier on {where} (torch {torch.__version__}), "
          f"{args.dtype}, AdamW, {args.rounds} rounds x {args.steps} steps")
    print(f"{'model':12s} {'params':>7s} {'plain ms':>9s} {'trainsan ms':>11s} {'ratio':>7s} "
          f"{'kern/step':>10s} {'ts kern':>8s} {'copies':>7s} {'memsets':>7s} "
          f"{'sync API':>8s} {'sync dbg':>8s}")
    for r in rows:
        for name in ("plain", "trainsan"):
            c = r["counts"][name]
            lead = (f"{r['model']:12s} {r['params_m']:6.1f}M {r['plain_ms']:9.3f} "
                    f"{r['trainsan_ms']:11.3f} {r['ratio']:6.3f}x" if name == "plain"
                    else f"{'  +trainsan':12s} {'':7s} {'':9s} {'':11s} {'':7s}")
            print(f"{lead} {c['kernels']:10.1f} {c['trainsan_kernels']:8.1f} {c['copies']:7.1f} "
                  f"{c['memsets']:7.1f} {c['sync_api_calls']:8.1f} "
                  f"{c['sync_debug_warnings']:8.1f}")
    print(f"\n{'model':12s} {'grads':>6s} {'MiB':>8s} {'trainsan pass ms':>16s} "
          f"{'_foreach_norm ms':>16s} {'x floor':>8s}")
    for r in rows:
        p = r["pass"]
        print(f"{r['model']:12s} {p['grad_tensors']:6d} {p['grad_bytes'] / 2**20:8.1f} "
              f"{p['trainsan pass']:16.4f} {p['_foreach_norm']:16.4f} "
              f"{p['trainsan pass'] / max(p['_foreach_norm'], 1e-9):7.2f}x")
    ok = True
    for r in rows:
        c = r["counts"]["trainsan"]
        extra_sync = c["sync_api_calls"] - r["counts"]["plain"]["sync_api_calls"]
        print(f"target {r['model']}: 1 trainsan kernel per step -> {c['trainsan_kernels']:.1f}; "
              f"0 blocking syncs added -> {extra_sync:+.1f} API, "
              f"{c['sync_debug_warnings'] - r['counts']['plain']['sync_debug_warnings']:+.1f} "
              f"torch calls" + (f" ({c['sync_api_names']})" if c["sync_api_names"] else ""))
        for ex in c["sync_debug_examples"]:
            print(f"  sync debug: {ex}")
    return rows, ok


def stop_child(args) -> int:
    """--child-stop: train with device_stop=True, NaN planted at step --nan-step."""
    import trainsan

    if "device_stop" not in trainsan.OPTIONS:
        print("child: skipped: trainsan.attach has no device_stop option", flush=True)
        return 0
    dev = torch.device("cuda")
    model, opt, _ = make_job("mlp", dev, "fp32")
    x, y = torch.randn(64, 2560, device=dev), torch.randn(64, 2560, device=dev)
    san = trainsan.attach(model, opt, policy="record", device_stop=True)
    params = list(model.parameters())
    for i in range(args.nan_step + 3):
        try:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            if i == args.nan_step:
                params[0].grad.view(-1)[0] = float("nan")
                print(f"child: step {i}: NaN planted in a gradient", flush=True)
            opt.step()
            finite = all(bool(torch.isfinite(p).all()) for p in params)  # a sync: fine here
        except Exception as e:  # noqa: BLE001 - torch.AcceleratorError / RuntimeError
            print(f"child: step {i}: CUDA error after the stop: {str(e).splitlines()[0]}",
                  flush=True)
            # The device printf is in the C stdout buffer (a pipe here): flush it, then leave
            # without clean-up that would touch the stopped CUDA context.
            ctypes.CDLL(None).fflush(None)
            os._exit(3)
        print(f"child: step {i} applied; parameters finite: {finite}", flush=True)
        if i >= args.nan_step:
            print("child: FAILED: the step with the NaN gradient was applied", flush=True)
            san.close()
            return 0
    return 0


def stop_phase(args) -> tuple[dict, bool]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-stop", "--nan-step",
           str(args.nan_step)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        print("\ndevice stop: FAILED: the child did not finish in 300 s")
        return {"status": "timeout"}, False
    out = p.stdout + p.stderr
    print("\ndevice stop: child output (last lines):")
    for line in out.strip().splitlines()[-12:]:
        print(f"  {line}")
    if "child: skipped:" in out:
        print("device stop: skipped: trainsan.attach has no device_stop option yet")
        return {"status": "skipped"}, True
    before_ok = all(f"child: step {i} applied; parameters finite: True" in out
                    for i in range(args.nan_step))
    checks = {
        "exit non-zero": p.returncode != 0,
        "message": _STOP_MESSAGE in out,
        f"steps 0..{args.nan_step - 1} applied, parameters finite": before_ok,
        "NaN step not applied (no later step ran)": "FAILED:" not in out
        and f"child: step {args.nan_step} applied" not in out,
    }
    print(f"device stop (child exit status {p.returncode}):")
    for k, v in checks.items():
        print(f"  {k:45s} {'ok' if v else 'FAILED'}")
    ok = all(checks.values())
    return {"status": "ok" if ok else "failed", "returncode": p.returncode, "checks": checks}, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("all", "tier", "stop"), default="all")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to smoke-test the tier phase")
    ap.add_argument("--tiny", action="store_true", help="small models (smoke test)")
    ap.add_argument("--models", default="mlp,transformer", help="comma list: mlp, transformer")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: autocast to bfloat16 (parameters fp32); fp32: no autocast")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per contender")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--profile-steps", type=int, default=5, help="profiled steady steps")
    ap.add_argument("--iters", type=int, default=20, help="runs of each pass-time contender")
    ap.add_argument("--nan-step", type=int, default=5, help="stop phase: step of the NaN")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true", help="print the phases; run nothing")
    ap.add_argument("--child-stop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    phases = ["tier", "stop"] if args.phase == "all" else [args.phase]
    if args.dry_run:
        for ph in phases:
            if ph == "tier":
                print(f"gpu_step_tier: tier: models {args.models}, {args.dtype}, AdamW; plain vs "
                      f"trainsan.attach defaults, {args.rounds} rounds x {args.steps} steps; "
                      f"{args.profile_steps} profiled steps (kernels, trainsan kernels, syncs); "
                      f"trainsan pass vs torch._foreach_norm, {args.iters} runs")
            else:
                print(f"gpu_step_tier: stop: child process, device_stop=True, NaN gradient at "
                      f"step {args.nan_step}: must exit non-zero with '{_STOP_MESSAGE}'")
        print("gpu_step_tier: dry run, nothing run")
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_step_tier: skipped: no CUDA device")
        return 0
    if not args.device.startswith("cuda") and "stop" in phases:
        print("gpu_step_tier: the stop phase needs CUDA; only the tier phase runs on the CPU")
        phases = [ph for ph in phases if ph != "stop"]
    if args.child_stop:
        return stop_child(args)
    import trainsan

    print(f"trainsan native library: {trainsan._native.load()}")
    results: dict = {}
    ok = True
    if "tier" in phases:
        results["tier"], tier_ok = tier_phase(args)
        ok &= tier_ok
    if "stop" in phases:
        results["stop"], stop_ok = stop_phase(args)
        ok &= stop_ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"\ngpu_step_tier: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
