"""Command line: ``python -m trainsan {demo,run,info,report,precision,check,diff,tensorboard}``."""

from __future__ import annotations

import argparse
import sys

import torch

import trainsan

from . import _native, checkpoint, demo, launcher
from .html_report import write_html
from .report import TraceError, diff_runs, precision, rank_traces, report_many
from .tensorboard import export_many


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "demo":
        return demo.main(argv[1:])
    if argv and argv[0] == "run":
        return launcher.main(argv[1:])
    if argv and argv[0] == "check":
        return checkpoint.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m trainsan", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions and build configuration")
    rep = sub.add_parser("report", help="summarise a trace")
    rep.add_argument("trace", nargs="+", help="trace file(s); run.jsonl also finds the per-rank "
                     "traces run.rankN.jsonl of a distributed run")
    rep.add_argument("--png", help="also plot the global norms to this PNG (needs matplotlib)")
    rep.add_argument("--html", help="also write a self-contained HTML report (findings, the "
                     "loss with the findings marked, norms, per-layer heat maps, coverage, "
                     "provenance) to this file")
    pre = sub.add_parser("precision", help="precision headroom: which tensors of a trace fit "
                         "float16, bfloat16, FP8 E4M3/E5M2")
    pre.add_argument("trace")
    pre.add_argument("--what", choices=("weight", "grad", "output"),
                     help="only weights, gradients or module outputs")
    dif = sub.add_parser("diff", help="first step and tensor where two runs diverge")
    dif.add_argument("a")
    dif.add_argument("b")
    tb = sub.add_parser("tensorboard", help="write a trace (or one per rank) as TensorBoard events")
    tb.add_argument("traces", nargs="+", metavar="trace")
    tb.add_argument("--logdir", required=True, help="TensorBoard log directory to write")
    sub.add_parser("check", help="check a checkpoint file (check CKPT [--model module:factory]; "
                   "check --help)")
    sub.add_parser("demo", help="train a small model with TrainSan on (--bug NAME, --list-bugs)")
    sub.add_parser("run", help="run an unmodified training script with TrainSan attached "
                   "(run [options] script.py [args] | -m module [args]; run --help)")
    args = parser.parse_args(argv)
    if args.cmd == "info":
        print(f"trainsan {trainsan.__version__}, torch {torch.__version__}, "
              f"CUDA kernels compiled: {trainsan.cuda_compiled()}, "
              f"CUDA device visible: {torch.cuda.is_available()}")
        print(f"CMake prefix path (find_package(trainsan)): {trainsan.cmake_prefix_path}")
        hot = _native.hot_module()
        print("per-step events: " + (f"_trainsan_hot ({hot.__file__})" if hot is not None else
                                     f"torch.classes methods ({_native.hot_problem})"))
        # Note [One orchestration] (bindings/csrc/hot.cpp): the checks whose driver runs Python.
        print("C++ drivers (bad_custom_grad, rank_desync, nondeterminism's re-runs): " + (
            "_trainsan_hot" if _native.drivers() is not None else
            f"missing, those checks are off ({_native.drivers_problem()})"))
        return 0
    try:
        if args.cmd == "report":
            paths = [p for t in args.trace for p in rank_traces(t)]
            print(report_many(paths, args.png))
            if args.html:
                print(write_html(paths, args.html))
        elif args.cmd == "precision":
            print(precision(args.trace, args.what))
        elif args.cmd == "tensorboard":
            print(export_many(args.traces, args.logdir))
        else:
            print(diff_runs(args.a, args.b))
    except TraceError as exc:
        print(f"trainsan: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
