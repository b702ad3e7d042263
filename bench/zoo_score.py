"""Score TrainSan on the bug zoo (tests/python/zoo.py).

    python bench/zoo_score.py [-v] [-k SUBSTRING ...] [--json out.json]

Prints one row per case (detected / missed / wrong kind / too early / too late / false error /
crashed), a per-kind summary and the totals, e.g. "bugs detected 33/34, clean loops with errors
0/17". A buggy case counts as detected when a finding of its kind has
onset <= step <= onset + 3; a clean case fails on any error-severity finding (warnings are
listed but do not count). Exit status: 0 when every case passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

import zoo  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case's findings")
    ap.add_argument("-k", nargs="*", default=[], help="only cases whose name contains one of these")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)

    cases = [c for c in zoo.CASES if not args.k or any(k in c.name for k in args.k)]
    t0 = time.perf_counter()
    results = zoo.run_all(cases)
    total_s = time.perf_counter() - t0

    w = max(len(c.name) for c in cases) + 2
    print(f"{'case':<{w}}{'expected':<24}{'onset':>5}  {'result':<12}{'time':>6}  "
          "detail / other findings")
    print("-" * (w + 24 + 5 + 2 + 12 + 6 + 30))
    for r in results:
        c = r.case
        exp = c.kind or "(clean)"
        onset = "" if c.onset is None else str(c.onset)
        others = sorted({f"{f.kind}@{f.step}" for f in r.findings if f.kind != c.kind})
        detail = r.detail
        if others and r.status not in ("wrong_kind", "false_error"):
            detail = (detail + "; " if detail else "") + "also " + ", ".join(others)
        mark = "ok " if r.ok else "XX "
        print(f"{c.name:<{w}}{exp:<24}{onset:>5}  {mark + r.status:<12}"
              f"{r.seconds:>5.2f}s  {detail}")
        if args.verbose or not r.ok:
            for f in r.findings:
                print(" " * 6 + str(f)[:300])

    print()
    print("per kind:")
    by_kind = collections.OrderedDict()
    for r in results:
        if r.case.clean:
            continue
        k = by_kind.setdefault(r.case.kind, [0, 0])
        k[0] += r.status == "detected"
        k[1] += 1
    for kind, (ok, n) in by_kind.items():
        print(f"  {kind:<24}{ok}/{n}" + ("" if ok == n else "   <-- " + ", ".join(
            r.case.name for r in results if r.case.kind == kind and not r.ok)))

    buggy = [r for r in results if not r.case.clean]
    clean = [r for r in results if r.case.clean]
    detected = sum(r.status == "detected" for r in buggy)
    false_err = sum(r.status in ("false_error", "crashed") for r in clean)
    warned = sum(bool(r.findings) and not r.errors() for r in clean)
    print()
    print(f"bugs detected {detected}/{len(buggy)}, clean loops with errors {false_err}/{len(clean)}"
          f" (clean loops with warnings only: {warned}); {len(results)} cases in {total_s:.1f}s")

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                [
                    {
                        "case": r.case.name,
                        "kind": r.case.kind,
                        "onset": r.case.onset,
                        "model": r.case.model,
                        "optimizer": r.case.optimizer,
                        "status": r.status,
                        "detail": r.detail,
                        "seconds": r.seconds,
                        "exception": r.exception,
                        "findings": [
                            {"sanitizer": f.sanitizer, "kind": f.kind, "step": f.step,
                             "severity": f.severity, "tensor": f.tensor, "count": f.count,
                             "message": f.message}
                            for f in r.findings
                        ],
                    }
                    for r in results
                ],
                fh,
                indent=1,
            )
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
