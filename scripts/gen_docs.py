#!/usr/bin/env python3
"""Generate the kind and option tables of the docs from the C++ tables.

Reads host/include/trainsan/kinds.def and options.def (the one place kinds and options are
written) and rewrites, between marker comments, the tables of

  README.md         <!-- kinds:begin --> ... <!-- kinds:end -->      one line per kind, LibTorch
  docs/kinds.md     <!-- kinds:begin --> ... <!-- kinds:end -->      the full kind table
  docs/options.md   <!-- options:begin --> ... <!-- options:end -->  the option table

Text outside the markers is hand-written and kept as it is.

  python3 scripts/gen_docs.py           rewrite the tables
  python3 scripts/gen_docs.py --check   exit 1, naming each file that is out of date

Python 3 standard library only; it does not import torch or trainsan.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

KINDS_DEF = Path("host/include/trainsan/kinds.def")
OPTIONS_DEF = Path("host/include/trainsan/options.def")
NEEDS = ("step", "forward", "loss", "audit", "event", "python")
SEVERITIES = {"kError": "error", "kWarning": "warning"}


class DefError(Exception):
    """A .def row or a marker this script cannot read: exit status 2."""


@dataclass
class Kind:
    name: str
    severity: str
    default_on: bool
    family: str
    needs: str
    libtorch: str
    rule: str


@dataclass
class Option:
    name: str
    type: str  # STR, INT, REAL, BOOL
    default: str  # as written in options.def (strings unquoted)
    limit: str  # STR: choices ("a|b", "" for any); INT, REAL: the range ("[0, inf)"); else ""
    doc: str


# --- reading the .def files ---------------------------------------------------------------------


def _strip_comments(text: str) -> str:
    """Removes // and /* */ comments, keeping string literals (which may hold '//') intact."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "'": "'"}


def _string_value(arg: str, where: str) -> str:
    """The value of one argument made of C string literals ("a" "b" concatenate)."""
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', arg, flags=re.S)
    rest = re.sub(r'"((?:[^"\\]|\\.)*)"', "", arg, flags=re.S).strip()
    if not parts or rest:
        raise DefError(f"{where}: expected a string literal, got {arg.strip()!r}")
    return "".join(re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), p)
                   for p in parts)


def _calls(text: str, macro: str, path: Path):
    """Yields (line number, [raw arguments]) for every call of `macro` outside comments."""
    code = _strip_comments(text)
    for m in re.finditer(r"\b" + re.escape(macro) + r"\s*\(", code):
        line = code.count("\n", 0, m.start()) + 1
        args, depth, cur, i = [], 1, [], m.end()
        while i < len(code) and depth:
            c = code[i]
            if c == '"':
                j = i + 1
                while j < len(code) and code[j] != '"':
                    j += 2 if code[j] == "\\" else 1
                cur.append(code[i : j + 1])
                i = j + 1
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if not depth:
                    break
            elif c == "," and depth == 1:
                args.append("".join(cur))
                cur = []
                i += 1
                continue
            cur.append(c)
            i += 1
        if depth:
            raise DefError(f"{path}:{line}: {macro}( is never closed")
        args.append("".join(cur))
        yield line, [a.strip() for a in args]


def _ident(arg: str, where: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", arg):
        raise DefError(f"{where}: expected a name, got {arg!r}")
    return arg


def _bool(arg: str, where: str) -> bool:
    if arg not in ("true", "false"):
        raise DefError(f"{where}: expected true or false, got {arg!r}")
    return arg == "true"


def read_kinds(root: Path) -> list[Kind]:
    path = root / KINDS_DEF
    kinds = []
    for line, a in _calls(path.read_text(encoding="utf-8"), "TRAINSAN_KIND", KINDS_DEF):
        where = f"{KINDS_DEF}:{line}"
        if len(a) != 7:
            raise DefError(f"{where}: TRAINSAN_KIND takes 7 arguments (name, severity, "
                           f"default_on, family, needs, libtorch, rule), got {len(a)}")
        name = _ident(a[0], where)
        if a[1] not in SEVERITIES:
            raise DefError(f"{where}: severity of {name} is {a[1]!r}, not kError or kWarning")
        if a[4] not in NEEDS:
            raise DefError(f"{where}: needs of {name} is {a[4]!r}, not one of {', '.join(NEEDS)}")
        kinds.append(Kind(name, SEVERITIES[a[1]], _bool(a[2], where), _ident(a[3], where), a[4],
                          _string_value(a[5], where), _string_value(a[6], where)))
    if not kinds:
        raise DefError(f"{KINDS_DEF}: no TRAINSAN_KIND row")
    names = [k.name for k in kinds]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DefError(f"{KINDS_DEF}: kinds listed twice: {', '.join(dup)}")
    return kinds


def read_needs_legend(root: Path) -> dict[str, str]:
    """The header comment's explanation of each `needs` value (`//   step     the step ...`),
    continuation lines included; empty where the header does not have that shape."""
    legend: dict[str, str] = {}
    current = None
    for raw in (root / KINDS_DEF).read_text(encoding="utf-8").splitlines():
        if not raw.startswith("//"):
            if raw.strip():
                break  # the rows start: the header is over
            continue
        body = raw[2:]
        m = re.match(r"\s{2,}(" + "|".join(NEEDS) + r")\s{2,}(\S.*)$", body)
        if m:
            current = m.group(1)
            legend[current] = m.group(2).strip()
        elif current and re.match(r"\s{6,}\S", body):
            legend[current] += " " + body.strip()
        else:
            current = None
    return legend


def read_options(root: Path) -> list[Option]:
    path = root / OPTIONS_DEF
    text = path.read_text(encoding="utf-8")
    found = []
    for typ, nargs in (("STR", 4), ("INT", 4), ("REAL", 4), ("BOOL", 3)):
        for line, a in _calls(text, "TRAINSAN_OPTION_" + typ, OPTIONS_DEF):
            where = f"{OPTIONS_DEF}:{line}"
            if len(a) != nargs:
                raise DefError(f"{where}: TRAINSAN_OPTION_{typ} takes {nargs} arguments, "
                               f"got {len(a)}")
            name = _ident(a[0], where)
            if typ == "STR":
                opt = Option(name, typ, _string_value(a[1], where), _string_value(a[2], where),
                             _string_value(a[3], where))
            elif typ in ("INT", "REAL"):
                number = r"-?\d+" if typ == "INT" else r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?"
                if not re.fullmatch(number, a[1]):
                    raise DefError(f"{where}: {name}: expected a number, got {a[1]!r}")
                limit = _string_value(a[2], where)
                bound = r"\s*-?(\d+\.?\d*([eE][-+]?\d+)?|inf)\s*"
                if not re.fullmatch(rf"[\[(]{bound},{bound}[\])]", limit):
                    raise DefError(f"{where}: {name}: expected a range like \"[0, inf)\", got "
                                   f"{limit!r}")
                opt = Option(name, typ, a[1], limit, _string_value(a[3], where))
            else:
                opt = Option(name, typ, "true" if _bool(a[1], where) else "false", "",
                             _string_value(a[2], where))
            found.append((line, opt))
    if not found:
        raise DefError(f"{OPTIONS_DEF}: no TRAINSAN_OPTION_* row")
    options = [o for _, o in sorted(found, key=lambda x: x[0])]
    names = [o.name for o in options]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DefError(f"{OPTIONS_DEF}: options listed twice: {', '.join(dup)}")
    return options


# --- rendering ----------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _wrap_item(text: str) -> list[str]:
    """A Markdown list item wrapped to 100 columns, no continuation line read as a new block."""
    for width in range(100, 60, -1):
        lines = textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=False,
                              break_on_hyphens=False)
        if not any(re.match(r"\s*([-+*>#|]|\d+[.)])(\s|$)", x) for x in lines[1:]):
            return lines
    return [text]


def _libtorch(k: Kind) -> str:
    return ("no (Python only): " if k.needs == "python" else "") + k.libtorch


def _generated(source: str) -> str:
    return (f"<!-- Generated by scripts/gen_docs.py from {source}: edit that file, then run "
            "python3 scripts/gen_docs.py. -->")


def readme_kinds(kinds: list[Kind], legend: dict[str, str]) -> str:
    rows = [_generated(KINDS_DEF.as_posix()), "",
            "| kind | severity | on | what it finds | LibTorch |", "|---|---|---|---|---|"]
    for k in kinds:
        rows.append(f"| `{k.name}` | {k.severity} | {'yes' if k.default_on else 'opt-in'} | "
                    f"{_cell(k.rule)} | {_cell(_libtorch(k))} |")
    return "\n".join(rows)


def docs_kinds(kinds: list[Kind], legend: dict[str, str]) -> str:
    rows = [_generated(KINDS_DEF.as_posix()), "",
            f"{len(kinds)} kinds, in the order of the table.", "",
            "| kind | severity | default | needs | LibTorch | rule |",
            "|---|---|---|---|---|---|"]
    for k in kinds:
        rows.append(f"| `{k.name}` | {k.severity} | {'on' if k.default_on else 'opt-in'} | "
                    f"{k.needs} | {_cell(_libtorch(k))} | {_cell(k.rule)} |")
    used = [n for n in NEEDS if any(k.needs == n for k in kinds)]
    if all(n in legend for n in used):
        rows += ["", "`needs`: what the kind's rule reads, hence what a LibTorch program must give "
                 "for it.", ""]
        for n in used:
            rows += _wrap_item(f"- `{n}`: {legend[n]}")
    return "\n".join(rows)


_TYPES = {"STR": "string", "INT": "int", "REAL": "float", "BOOL": "bool"}


def _limit(o: Option) -> str:
    if o.type == "STR":
        return ", ".join(f"`{c}`" for c in o.limit.split("|")) if o.limit else "any"
    return f"`{o.limit}`" if o.limit else ""


def docs_options(options: list[Option]) -> str:
    rows = [_generated(OPTIONS_DEF.as_posix()), "",
            f"{len(options)} options, in the order of the table.", "",
            "| option | type | default | choices / range | doc |", "|---|---|---|---|---|"]
    for o in options:
        default = f'`"{o.default}"`' if o.type == "STR" else f"`{o.default}`"
        rows.append(f"| `{o.name}` | {_TYPES[o.type]} | {default} | {_limit(o)} | "
                    f"{_cell(o.doc)} |")
    return "\n".join(rows)


# --- writing between the markers ----------------------------------------------------------------


def _replace(text: str, marker: str, body: str, path: str) -> str:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i or text.count(begin) != 1 or text.count(end) != 1:
        raise DefError(f"{path}: needs exactly one {begin} and, after it, one {end}")
    return text[: i + len(begin)] + "\n" + body + "\n" + text[j:]


def targets(root: Path) -> list[tuple[str, str, str]]:
    """(file, marker, generated body) for every generated table."""
    kinds, options, legend = read_kinds(root), read_options(root), read_needs_legend(root)
    return [
        ("README.md", "kinds", readme_kinds(kinds, legend)),
        ("docs/kinds.md", "kinds", docs_kinds(kinds, legend)),
        ("docs/options.md", "options", docs_options(options)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each file whose tables are out of date")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository root (default: this script's parent's parent)")
    args = parser.parse_args(argv)
    root = args.root
    try:
        new: dict[str, str] = {}
        for rel, marker, body in targets(root):
            if rel not in new:
                path = root / rel
                if not path.is_file():
                    raise DefError(f"{rel}: missing")
                new[rel] = path.read_text(encoding="utf-8")
            new[rel] = _replace(new[rel], marker, body, rel)
    except (DefError, OSError) as e:
        print(f"gen_docs: {e}", file=sys.stderr)
        return 2
    stale = [rel for rel, text in new.items()
             if (root / rel).read_text(encoding="utf-8") != text]
    if args.check:
        for rel in stale:
            print(f"gen_docs: {rel} is out of date with {KINDS_DEF} / {OPTIONS_DEF}: "
                  "run python3 scripts/gen_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for rel in stale:
        (root / rel).write_text(new[rel], encoding="utf-8")
        print(f"gen_docs: wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
