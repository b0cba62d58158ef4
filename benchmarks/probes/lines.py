"""Whose cache lines one call touches beyond another's: two kept `steps.py --footprint` dumps, compared.

    python benchmarks/probes/steps.py --footprint --keep DIR      # keeps cg.out.1 ... one per row
    python benchmarks/probes/lines.py DIR/cg.out.5 DIR/cg.out.9   # gencore's row, then the trace's
    python benchmarks/probes/lines.py A B --calls 10 --top 40     # calls per dump, rows shown

With `--footprint` the simulated caches are flushed before each call, so a dump's last-level
misses are the distinct 64-byte lines its calls touched: instruction misses (`ILmr`) are
lines of machine code, data misses (`DLmr` + `DLmw`) lines of objects, bytecode and tables.
`steps.py`'s table gives each row's total; this says whose they are: per shared library
(interlace's compiled extension, the interpreter, torch...) and per function, B minus A, per
call. A trace's time on a small model follows its lines more than its instructions
(docs/architecture.md, "Where a trace's time goes"), so this is the probe that says where a
difference in lines lives. Needs valgrind's `callgrind_annotate`.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys

EVENTS = ("ILmr", "DLmr", "DLmw")
# a row of `callgrind_annotate --show=ILmr,DLmr,DLmw`: three counts (each "1,234 (0.5%)",
# "1,234" or "." for none), then "file:function [object]"
_COUNT = r"(?:[\d,]+(?: \(\s*[\d.]+%\))?|\.)"
_ROW = re.compile(rf"^\s*({_COUNT})\s+({_COUNT})\s+({_COUNT})\s+(\S.*)$")


def _number(text):
    return 0 if text == "." else int(text.split()[0].replace(",", ""))


def parse(annotated: str) -> dict:
    """`callgrind_annotate --show=ILmr,DLmr,DLmw` output -> {(library, function): [code lines,
    data lines]}, exclusive, summed over the dump. Parts of a function inlined from a header
    (`object.h:__pyx_...`) come without their object: their library is "?"."""
    costs = collections.defaultdict(lambda: [0, 0])
    started = False
    for line in annotated.splitlines():
        if not started:
            started = "file:function" in line
            continue
        row = _ROW.match(line)
        if row is None or "PROGRAM TOTALS" in line:
            continue
        code, read, written = map(_number, row.groups()[:3])
        name = row.group(4)
        library = "?"
        found = re.search(r" \[([^\]]*)\]$", name)
        if found:
            library = found.group(1).rsplit("/", 1)[-1]
            name = name[:found.start()]
        function = name.rsplit("/", 1)[-1]
        costs[library, function][0] += code
        costs[library, function][1] += read + written
    return costs


def load(path):
    done = subprocess.run(["callgrind_annotate", f"--show={','.join(EVENTS)}", "--threshold=100",
                           "--auto=no", path], capture_output=True, text=True, check=True)
    return parse(done.stdout)


def compare(before: dict, after: dict, calls: int):
    """(per library: [code, data] lines of `after` minus `before`, per call; per function, the
    same), each sorted by the size of the difference."""
    libraries = collections.defaultdict(lambda: [0.0, 0.0])
    functions = []
    for key in set(before) | set(after):
        a, b = before.get(key, (0, 0)), after.get(key, (0, 0))
        code, data = (b[0] - a[0]) / calls, (b[1] - a[1]) / calls
        libraries[key[0]][0] += code
        libraries[key[0]][1] += data
        functions.append((code, data, key))
    by_size = sorted(libraries.items(), key=lambda kv: -abs(kv[1][0]) - abs(kv[1][1]))
    functions.sort(key=lambda row: -abs(row[0]) - abs(row[1]))
    return by_size, functions


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="a kept dump (steps.py --footprint --keep DIR: DIR/cg.out.N)")
    parser.add_argument("after", help="another, counted against the first")
    parser.add_argument("--calls", type=int, default=10, help="calls per dump (steps.py's --traces)")
    parser.add_argument("--top", type=int, default=30, help="functions shown")
    args = parser.parse_args()
    if shutil.which("callgrind_annotate") is None:
        print("lines.py needs valgrind's callgrind_annotate; it is not on PATH")
        return 0
    by_library, functions = compare(load(args.before), load(args.after), args.calls)
    code = sum(c for c, _ in (v for _, v in by_library))
    data = sum(d for _, d in (v for _, v in by_library))
    print(f"lines per call, after - before: {code:+,.0f} code, {data:+,.0f} data\n")
    print("| library | code lines | data lines |\n|---|---:|---:|")
    for library, (c, d) in by_library:
        if abs(c) >= 0.5 or abs(d) >= 0.5:
            print(f"| {library} | {c:+,.0f} | {d:+,.0f} |")
    print("\n| function | library | code lines | data lines |\n|---|---|---:|---:|")
    for c, d, (library, function) in functions[:args.top]:
        print(f"| {function[:100]} | {library} | {c:+,.0f} | {d:+,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
