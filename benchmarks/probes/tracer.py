"""Per-entry cost of skipping a `with` body, against `contextlib.nullcontext()`.

    python benchmarks/probes/tracer.py           # this interpreter, both paths
    python benchmarks/probes/tracer.py --all     # every .venv* interpreter in the repo

Rows (median of REPEATS rounds of N entries each, the rows taking turns within a round, in
CPU time of this process, ratios to nullcontext):

* nullcontext        `with contextlib.nullcontext(): x = 1`
* native skip, Py    the compiled mechanism alone, with __enter__/__exit__ in Python
                     calling skip.arm/disarm (plans made by skip.plan)
* native Tracer      `interlace.Tracer` with a backend that does nothing: the whole Tracer
                     (its __init__, the warm __enter__/__exit__ in C, the backend call)
* native Tracer, Py  the same Tracer with its Python __enter__/__exit__ (the policy methods,
                     which read the same registered record: what the twin's warm path does)
* deferred + .save()  a backend doing what an interleaving one does (`tracer.defer()`,
                     `body.run()`, `tracer.push_result()`), body `x = [1].save()`: the
                     per-trace steps (C natively: frames.deferred_methods, object_save)
* deferred, Py       the same through the Python methods (the policy: what the twin runs)
* twin skip / Tracer the same with INTERLACE_NO_EXTENSIONS=1 (a child process)
* settrace ref       nnsight's way, written here: sys.settrace + frame.f_trace raising at
                     the first body line, suppressed in __exit__
* cold capture       first trace of a block at the end of a 5,000-line file (source read,
                     parse, compile, bytecode analysis), in a fresh process
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(ROOT, "src")
N = 20_000
REPEATS = 15


class SettraceSkip:
    """nnsight's skip: a global no-op tracer so f_trace runs, raising at the body's line."""

    class Skip(Exception):
        pass

    def __enter__(self):
        frame = sys._getframe(1)
        self.prev = sys.gettrace()
        start = frame.f_lineno

        def local(f, event, arg):
            if event == "line" and f.f_lineno != start:
                raise SettraceSkip.Skip

            return local

        sys.settrace(lambda *a: None)
        frame.f_trace = local
        self.frame = frame
        return self

    def __exit__(self, exc_type, exc, tb):
        sys.settrace(self.prev)
        self.frame.f_trace = None
        self.frame = None
        return exc_type is SettraceSkip.Skip


def make_runner(expression: str, body: str = "x = 1", **names):
    """`run(n)`: n times `with <expression>: <body>`, written out as a user would (no factory
    call in between), in a code object of its own: with sites are keyed by code object, and a
    row must not pay for another's (e.g. nullcontext for the monitoring events a skip
    enabled). The source goes into linecache, where a Tracer reads it."""
    import linecache

    source = f"def run(n):\n    for _ in range(n):\n        with {expression}:\n            {body}\n"
    filename = f"<bench_tracer row {len(linecache.cache)}: {expression}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(names)
    exec(compile(source, filename, "exec"), namespace)
    return namespace["run"]


def per_entry(runs: dict) -> dict:
    """us per entry of each runner: the median of REPEATS rounds, the runners taking turns
    within each round (so a burst of load on a shared machine hits every row alike), timed in
    CPU time of this process (time spent descheduled does not count)."""
    for run in runs.values():
        run(200)  # warm: capture, plan, quickening
    times = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name, run in runs.items():
            t0 = time.process_time()
            run(N)
            times[name].append((time.process_time() - t0) / N)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def measure_here() -> dict:
    sys.path.insert(0, SRC)
    import interlace
    from interlace import Backend, Tracer
    from interlace.tracing import skip

    class Nothing(Backend):
        def __call__(self, tracer):
            pass

    nothing = Nothing()

    def stand_in_block(frame):
        return types.SimpleNamespace(
            filename=frame.f_code.co_filename, lineno=frame.f_lineno,
            first_body_line=frame.f_lineno + 1, same_line=False, first_is_try=False,
            assigned_names=frozenset({"x"}),
        )

    plans_by_site = {}

    class SkipOnly:
        """Only the skip mechanism (what the extension does), no capture/backend."""

        __slots__ = ("handle",)

        def __enter__(self):
            frame = sys._getframe(1)
            plan = plans_by_site.get((id(frame.f_code), frame.f_lasti))
            if plan is None:
                plan = plans_by_site[(id(frame.f_code), frame.f_lasti)] = skip.plan(frame, stand_in_block(frame))
            self.handle = skip.arm(frame, plan)
            return self

        def __exit__(self, exc_type, exc, tb):
            skip.disarm(self.handle)
            return True

    out = {"native": interlace.native, "python": sys.version.split()[0]}
    runs = {"nullcontext": make_runner("nullcontext()", nullcontext=contextlib.nullcontext),
            "skip": make_runner("SkipOnly()", SkipOnly=SkipOnly)}

    runs["tracer"] = make_runner("Tracer(backend=nothing)", Tracer=Tracer, nothing=nothing)

    from interlace.tracing import tracer as tracer_module

    class PolicyTracer(Tracer):
        """The Tracer with its Python __enter__/__exit__ only (no C warm path: the policy
        finds the registered record itself, as on the twin)."""

        __enter__ = tracer_module._policy_enter
        __exit__ = tracer_module._policy_exit

    runs["tracer_py"] = make_runner("PolicyTracer(backend=nothing)", PolicyTracer=PolicyTracer,
                                    nothing=nothing)

    class Deferred(Backend):
        """Defer, run, push: an interleaving backend's per-trace steps, model aside."""

        def __call__(self, tracer):
            tracer.push_result(tracer.defer().run())

    class DeferredPolicy(Backend):
        """The same steps through their Python methods (the policy; the twin's methods)."""

        def __call__(self, tracer):
            body = tracer_module._policy_defer(tracer)
            tracer_module._policy_push_result(tracer, tracer_module._policy_run(body))

    runs["deferred"] = make_runner("Tracer(backend=deferred)", "x = [1].save()", Tracer=Tracer,
                                   deferred=Deferred())
    runs["deferred_py"] = make_runner("Tracer(backend=deferred)", "x = [1].save()", Tracer=Tracer,
                                      deferred=DeferredPolicy())
    if not os.environ.get("INTERLACE_NO_EXTENSIONS"):
        runs["settrace"] = make_runner("SettraceSkip()", SettraceSkip=SettraceSkip)
    out.update(per_entry(runs))
    return out


def cold_capture() -> float:
    """ms for the first trace of a block at the end of a 5,000-line file (fresh process)."""
    lines = ["from interlace import Tracer, Backend", "class Nothing(Backend):",
             "    def __call__(self, tracer):", "        pass", ""]
    k = 0
    while len(lines) < 4990:
        lines += [f"def filler_{k}(a, b):", f"    c = a + b * {k}", "    return c", ""]
        k += 1
    lines += ["def target():", "    with Tracer(backend=Nothing()):", "        h = 1",
              "    return 0", ""]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big_module.py")
        with open(path, "w") as fh:
            fh.write("\n".join(lines))
        code = textwrap.dedent(
            f"""\
            import sys, time, importlib
            sys.path[:0] = [{SRC!r}, {tmp!r}]
            import interlace
            m = importlib.import_module("big_module")
            t0 = time.perf_counter(); m.target(); t1 = time.perf_counter()
            m.target(); t2 = time.perf_counter()
            print((t1 - t0 - (t2 - t1)) * 1e3)
            """
        )
        samples = []
        for _ in range(5):
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True)
            samples.append(float(proc.stdout.strip()))
    return statistics.median(samples)


def report() -> dict:
    native = measure_here()
    env = {**os.environ, "INTERLACE_NO_EXTENSIONS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--json"], capture_output=True, text=True,
                          env=env, check=True)
    twin = json.loads(proc.stdout)
    return {"native": native, "twin": twin, "cold_ms": cold_capture()}


def show(r: dict) -> None:
    n, t = r["native"], r["twin"]
    base = n["nullcontext"]
    print(f"Python {n['python']}  (compiled extension live: {n['native']})")
    rows = [
        ("nullcontext", n["nullcontext"], base),
        ("native skip, Python enter/exit", n["skip"], base),
        ("native Tracer (no-op backend)", n["tracer"], base),
        ("native Tracer, Python enter/exit", n["tracer_py"], base),
        ("native deferred + .save()", n["deferred"], base),
        ("native deferred, Python steps", n["deferred_py"], base),
        ("twin skip, Python enter/exit", t["skip"], t["nullcontext"]),
        ("twin Tracer (no-op backend)", t["tracer"], t["nullcontext"]),
        ("twin Tracer, Python enter/exit", t["tracer_py"], t["nullcontext"]),
        ("twin deferred + .save()", t["deferred"], t["nullcontext"]),
        ("settrace reference (nnsight)", n["settrace"], base),
    ]
    for name, us, ref in rows:
        print(f"  {name:33s} {us:8.3f} us   {us / ref:6.2f}x nullcontext")
    print(f"  settrace ref / native skip       {n['settrace'] / n['skip']:6.2f}x")
    print(f"  settrace ref / native Tracer     {n['settrace'] / n['tracer']:6.2f}x")
    print(f"  cold capture, 5,000-line file    {r['cold_ms']:8.3f} ms")


def main(argv):
    if "--json" in argv:
        print(json.dumps(measure_here()))
        return
    if "--all" in argv:
        for venv in sorted(glob.glob(os.path.join(ROOT, ".venv*"))):
            exe = os.path.join(venv, "bin", "python")
            if os.path.exists(exe):
                subprocess.run([exe, __file__], check=False)
        return
    show(report())


if __name__ == "__main__":
    main(sys.argv[1:])
