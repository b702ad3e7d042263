"""Record every bug-zoo case's findings, and compare two recordings.

    python3 bench/zoo_findings.py --out before.json [-k SUBSTRING ...]
    python3 bench/zoo_findings.py --compare before.json after.json

The first form runs every case of tests/python/zoo.py (``zoo.CASES``, which includes the audit
cases of zoo_audit.py: zoo.py imports that module) with ``zoo.run_case`` and writes a JSON
object mapping each case name to ``{"exception": str or null, "findings": [...]}``, the
findings in the order the sanitizers reported them, each with ``sanitizer`` (the label the case
attached it under), ``kind``, ``step``, ``severity``, ``tensor``, ``message``, ``value``,
``count`` and ``last_step``. Non-finite values are written as the strings "nan", "inf", "-inf".
Which trainsan is measured is whichever ``import trainsan`` finds (PYTHONPATH); the file also
records its path and version under the key ``"__meta__"``.

The second form prints every difference between two recordings: cases only in one, changed
exceptions, findings missing from or extra in the second, findings whose message, value, step,
count, last_step or severity changed, and, separately, cases whose findings are the same but in
another order ("order only"). Exit status 1 on any difference other than order, else 0.

Use it to check that a refactor changes no finding:

    cd /tmp && PYTHONPATH=/tmp/old:/work/main/tests/python \\
        python3 /work/main/bench/zoo_findings.py --out /tmp/zoo_before.json
    PYTHONPATH=<new build>:/work/main/tests/python \\
        python3 /work/main/bench/zoo_findings.py --out /tmp/zoo_after.json
    python3 /work/main/bench/zoo_findings.py --compare /tmp/zoo_before.json /tmp/zoo_after.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = ("sanitizer", "kind", "step", "severity", "tensor", "message", "value", "count",
          "last_step")
# A finding's identity for matching across recordings; the other fields may "change".
KEY = ("sanitizer", "kind", "tensor", "step")


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if hasattr(v, "item"):  # a numpy/torch scalar
        return _plain(v.item())
    return v


def record(ks) -> dict:
    tests_py = os.path.join(HERE, "..", "tests", "python")
    if tests_py not in sys.path:
        sys.path.append(tests_py)  # after PYTHONPATH, so a given zoo.py wins
    import trainsan
    import zoo

    out = {"__meta__": {"trainsan": os.path.dirname(os.path.abspath(trainsan.__file__)),
                        "version": getattr(trainsan, "__version__", None),
                        "zoo": os.path.abspath(zoo.__file__)}}
    cases = [c for c in zoo.CASES if not ks or any(k in c.name for k in ks)]
    t0 = time.perf_counter()
    for c in cases:
        r = zoo.run_case(c)
        findings = []
        for f in r.findings:
            d = {}
            for name in FIELDS:
                d[name] = _plain(f.sanitizer if name == "sanitizer" else getattr(f, name, None))
            findings.append(d)
        out[c.name] = {"exception": r.exception, "findings": findings}
        print(f"{c.name}: {len(findings)} finding(s)"
              + (f", exception {r.exception}" if r.exception else ""), file=sys.stderr)
    out["__meta__"]["cases"] = len(cases)
    out["__meta__"]["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _key(f):
    return tuple(json.dumps(f.get(k), sort_keys=True) for k in KEY)


def _full(f):
    return json.dumps({k: f.get(k) for k in FIELDS}, sort_keys=True)


def _short(f):
    rep = f" x{f.get('count')} last {f.get('last_step')}" if (f.get("count") or 1) != 1 else ""
    return (f"<{f.get('sanitizer')}> {f.get('kind')} step={f.get('step')} [{f.get('severity')}] "
            f"tensor={f.get('tensor')}{rep} value={f.get('value')}: {f.get('message')}")


def _change(k, a, b) -> str:
    s = f"    {k}: {a!r}\n    {' ' * len(k)}  -> {b!r}"
    if isinstance(a, str) and isinstance(b, str):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        s += (f"\n    {' ' * len(k)}  (first difference at character {i}: "
              f"{a[i:i + 30]!r} -> {b[i:i + 30]!r})")
    return s


def compare_case(name, a, b, lines) -> tuple:
    """Append a description of the differences to lines; return (real_diffs, order_only)."""
    real = 0
    if a.get("exception") != b.get("exception"):
        lines.append(f"{name}: exception changed\n    before: {a.get('exception')}\n"
                     f"    after:  {b.get('exception')}")
        real += 1
    fa, fb = a.get("findings", []), b.get("findings", [])
    if [_full(f) for f in fa] == [_full(f) for f in fb]:
        return real, False
    if sorted(_full(f) for f in fa) == sorted(_full(f) for f in fb):
        lines.append(f"{name}: order only")
        for i, f in enumerate(fa):
            lines.append(f"    before[{i}] {_short(f)}")
        for i, f in enumerate(fb):
            lines.append(f"    after[{i}]  {_short(f)}")
        return real, True
    # Pair findings by identity (sanitizer, kind, tensor, step), in order within a key.
    rest_b = collections.defaultdict(list)
    for f in fb:
        rest_b[_key(f)].append(f)
    unmatched_a = []
    for f in fa:
        if rest_b[_key(f)]:
            g = rest_b[_key(f)].pop(0)
            changed = [k for k in FIELDS if f.get(k) != g.get(k)]
            if changed:
                real += 1
                lines.append(f"{name}: changed {', '.join(changed)} of "
                             f"<{f.get('sanitizer')}> {f.get('kind')} step={f.get('step')} "
                             f"tensor={f.get('tensor')}")
                for k in changed:
                    lines.append(_change(k, f.get(k), g.get(k)))
        else:
            unmatched_a.append(f)
    unmatched_b = [g for lst in rest_b.values() for g in lst]
    # Then pair what is left by (sanitizer, kind, tensor): a finding that moved to another step.
    for f in list(unmatched_a):
        for g in unmatched_b:
            if all(f.get(k) == g.get(k) for k in ("sanitizer", "kind", "tensor")):
                real += 1
                changed = [k for k in FIELDS if f.get(k) != g.get(k)]
                lines.append(f"{name}: changed {', '.join(changed)} of "
                             f"<{f.get('sanitizer')}> {f.get('kind')} tensor={f.get('tensor')}")
                for k in changed:
                    lines.append(_change(k, f.get(k), g.get(k)))
                unmatched_a.remove(f)
                unmatched_b.remove(g)
                break
    for f in unmatched_a:
        real += 1
        lines.append(f"{name}: missing  {_short(f)}")
    for g in unmatched_b:
        real += 1
        lines.append(f"{name}: extra    {_short(g)}")
    if not real:  # same multiset after pairing, yet neither equal nor a permutation: impossible
        lines.append(f"{name}: findings differ (unclassified)")
        real = 1
    return real, False


def compare(path_a, path_b) -> int:
    with open(path_a) as fh:
        a = json.load(fh)
    with open(path_b) as fh:
        b = json.load(fh)
    ma, mb = a.pop("__meta__", {}), b.pop("__meta__", {})
    print(f"before: {path_a} ({ma.get('trainsan')}, version {ma.get('version')}, "
          f"{len(a)} cases)")
    print(f"after:  {path_b} ({mb.get('trainsan')}, version {mb.get('version')}, "
          f"{len(b)} cases)")
    lines = []
    real_cases, order_cases, diffs = [], [], 0
    for name in a:
        if name not in b:
            lines.append(f"{name}: case only in before")
            real_cases.append(name)
            diffs += 1
    for name in b:
        if name not in a:
            lines.append(f"{name}: case only in after")
            real_cases.append(name)
            diffs += 1
    for name in a:
        if name in b:
            n, order = compare_case(name, a[name], b[name], lines)
            diffs += n
            if n:
                real_cases.append(name)
            elif order:
                order_cases.append(name)
    for line in lines:
        print(line)
    n_f = sum(len(v.get("findings", [])) for v in a.values())
    print()
    print(f"{diffs} difference(s) in {len(real_cases)} case(s); {len(order_cases)} case(s) "
          f"differ in order only; {n_f} findings before, "
          f"{sum(len(v.get('findings', [])) for v in b.values())} after")
    return 1 if diffs else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="run the zoo and write its findings to this JSON file")
    g.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="compare two recordings")
    ap.add_argument("-k", nargs="*", default=[], help="only cases whose name contains one of these")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    out = record(args.k)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    m = out["__meta__"]
    n = sum(len(v["findings"]) for k, v in out.items() if k != "__meta__")
    print(f"{m['cases']} cases, {n} findings in {m['seconds']}s -> {args.out} "
          f"(trainsan {m['trainsan']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
