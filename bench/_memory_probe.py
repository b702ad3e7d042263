"""One contender of bench_overhead.py's memory phase (issue 35), in a fresh process.

Builds one of bench_overhead.py's models from seed 0 (the batches from seed 1, as there), an
optimizer (Adam by default), attaches the contender, trains --steps steps with bench_overhead's
own step (its Contender class), and prints one line ``PROBE_JSON {...}`` with:

- the process's peak RSS: /proc/self/status VmHWM and getrusage ru_maxrss (KiB), once after the
  steps and once more after close() (the whole run's peak, the figure bench_overhead judges),
  and that peak less the file-backed pages resident at the end (RssFile + RssShmem: library code
  paged in), the anonymous memory at the peak;
- its RSS (VmRSS) after importing torch, after importing trainsan (contenders other than
  ``plain``), after building the model and optimizer, after attaching, after the steps;
- on CUDA, torch.cuda.max_memory_allocated() and max_memory_reserved() after the steps;
- for ``trainsan-trace``, the trace's size at the window's two steps and its bytes per step;
- for ``import-only``, what importing trainsan mapped and allocated: the growth of each mapped
  file's and of anonymous memory's RSS (/proc/self/smaps) and the modules it imported, by package.

Contenders: ``plain`` (trainsan never imported), ``import-only`` (imported, nothing attached),
``trainsan`` (attach at the defaults), ``trainsan-noupd`` (track_updates=False: no update
statistics), ``trainsan-trace`` (the defaults and a trace). gc.collect() runs before each reading.

    python3 bench/_memory_probe.py --model mlp67m --contender trainsan --steps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("plain", "import-only", "trainsan", "trainsan-noupd", "trainsan-trace")


def proc_status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile and RssShmem of this process in KiB (empty where /proc is
    unavailable)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:", "RssShmem:")):
                    key, val = line.split(":", 1)
                    out[key] = int(val.split()[0])
    except OSError:
        pass
    return out


def maxrss_kib() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    except (ImportError, OSError):
        return 0


def rss_kib() -> int:
    gc.collect()
    return proc_status().get("VmRSS", 0)


def smaps_rss() -> dict:
    """Resident KiB per mapped file ("[anon]" for anonymous memory, the heap included)."""
    out: dict = {}
    name = "[anon]"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping's header line
                    parts = line.split()
                    name = parts[5] if len(parts) > 5 and parts[5].startswith("/") else "[anon]"
                elif first == "Rss:":
                    out[name] = out.get(name, 0) + int(line.split()[1])
    except OSError:
        pass
    return out


def import_detail(before_maps: dict, before_mods: set, before_rss: int) -> dict:
    after_maps = smaps_rss()
    grown = []
    for name, kib in after_maps.items():
        d = kib - before_maps.get(name, 0)
        if d:
            grown.append((name, d, name not in before_maps))
    grown.sort(key=lambda t: -t[1])
    pkgs: dict = {}
    for m in set(sys.modules) - before_mods:
        top = m.split(".", 1)[0]
        pkgs[top] = pkgs.get(top, 0) + 1
    return {
        "rss_delta_kib": rss_kib() - before_rss,
        "maps_delta_kib": [[n, d, new] for n, d, new in grown[:15]],
        "maps_delta_total_kib": sum(d for _, d, _ in grown),
        "modules": dict(sorted(pkgs.items(), key=lambda kv: -kv[1])),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--contender", required=True, choices=CONTENDERS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    ap.add_argument("--malloc", default="mmap", choices=("steady", "default", "mmap"))
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    sys.path.insert(0, HERE)
    import bench_overhead as B  # torch and the models; not trainsan

    assert "trainsan" not in sys.modules, "bench_overhead imported trainsan"
    malloc = B.set_malloc(args.malloc)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
    res: dict = {"model": args.model, "contender": args.contender, "steps": args.steps,
                 "device": args.device, "optimizer": args.optimizer, "malloc": malloc,
                 "rss_kib": {}}
    stages = res["rss_kib"]
    stages["torch"] = rss_kib()
    if args.contender != "plain":
        maps0, mods0, rss0 = smaps_rss(), set(sys.modules), rss_kib()
        B._trainsan()
        stages["import"] = rss_kib()
        if args.contender == "import-only":
            res["import_detail"] = import_detail(maps0, mods0, rss0)
    if args.model not in B.MODELS:
        ap.error(f"--model: unknown {args.model} (choose from {', '.join(B.MODELS)})")
    torch.manual_seed(0)
    model = B.MODELS[args.model][1]().to(device)
    batches = B.make_batches(args.model, 8, device, torch.Generator().manual_seed(1))
    params = list(model.parameters())
    res["params"] = sum(p.numel() for p in params)
    res["tensors"] = len(params)
    res["weights_bytes"] = sum(p.numel() * p.element_size() for p in params)
    # import-only trains as plain does; the Contender attaches the trainsan ones.
    name = "plain" if args.contender == "import-only" else args.contender
    stages["model"] = rss_kib()  # before the optimizer, which Contender makes
    c = B.Contender(name, args.model, model, args.optimizer, batches, device)
    stages["attached"] = rss_kib()
    window = None
    if c.trace_path is not None:
        window = B.trace_window(args.steps)
        c.trace_marks = set(window)
    c.run(args.steps, record=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
        res["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        res["cuda_max_reserved"] = torch.cuda.max_memory_reserved()
        res["cuda_allocated_end"] = torch.cuda.memory_allocated()
    stages["steps"] = rss_kib()
    st = proc_status()
    res["peak_steps_kib"] = st.get("VmHWM", 0)
    c.close()
    gc.collect()
    st = proc_status()
    res["peak_kib"] = st.get("VmHWM", 0)
    res["ru_maxrss_kib"] = maxrss_kib()
    stages["closed"] = st.get("VmRSS", 0)
    # The peak less the file-backed pages resident at the end (code and data of the libraries
    # touched so far; they only grow over a run): a lower bound on the anonymous memory (heap,
    # tensors) resident at the peak, i.e. what the run allocated apart from code it paged in.
    res["file_kib"] = st.get("RssFile", 0) + st.get("RssShmem", 0)
    res["peak_anon_kib"] = res["peak_kib"] - res["file_kib"]
    if window is not None:
        res["trace"] = B.trace_growth(c.trace_sizes, window, getattr(c, "trace_final", None))
    res["findings"] = c.findings()
    print("PROBE_JSON " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
