"""Timing, result checks and peak memory, for contenders in this process and for the twin's.

Contenders of one case are timed in rounds: every round runs each of them once, in a new
random order, so that a burst of load on the machine hits them alike; a figure is the median
over rounds and a ratio is the median of the per-round ratios to the floor (plain hooks).
On CUDA every timed call is bracketed by `torch.cuda.synchronize()`.

The pure-Python twin cannot share a process with the compiled path (the choice is made once,
at import), so it runs in a worker process (`benchmarks.worker`) that builds the same subjects
from the same seeds; so does the baseline (`--baseline REF`: interlace as it was at REF, whose
`src/` the worker puts first on its path), and, when a baseline is measured, this tree's
interlace too, so that before and after run in processes of the same kind. Within a round
the harness asks a worker to time its call, and waits: the processes take turns and never
run at the same time. The worker times itself, so the pipe's latency is not counted.

A call timed in a worker is not a call timed here: a process woken by a pipe runs its call
on colder caches than one that never slept (an A/A run with the same interlace in this
process and in a worker read the worker ~10% slower). So every worker also times the floor
(plain hooks) and the raw forward, in the same rounds, and a worker's contender is compared
with the floor timed in its own process (`own_floor`).
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import statistics
import subprocess
import sys
import threading
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import subjects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configure(settings: dict) -> None:
    """Process-wide settings every process of a run shares: torch threads, no autograd."""
    import warnings

    if settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    torch.set_grad_enabled(False)
    warnings.filterwarnings("ignore", message=".*LanguageModel is deprecated.*")
    # an open-ended `tracer.iter[:]` ends with a warning by design (nnsight's and interlace's)
    warnings.filterwarnings("ignore", message=".*was never reached.*")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Local:
    """A contender's callable in this process."""

    def __init__(self, fn, device):
        self.fn = fn
        self.device = device

    def time(self) -> int:
        """ns for one call."""
        fn = self.fn
        sync(self.device)
        start = time.perf_counter_ns()
        fn()
        sync(self.device)
        return time.perf_counter_ns() - start

    def result(self):
        return self.fn()

    def peak(self) -> int:
        """Bytes of tensor memory the call needs above what was in use before it (its peak,
        saved values included): CUDA's allocator peak on a GPU, `TensorPeak` on a CPU."""
        if torch.device(self.device).type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = self.fn()
            sync(self.device)
            peak = torch.cuda.max_memory_allocated() - base
            del out
            return peak
        with TensorPeak() as mode:
            out = self.fn()
        del out
        return mode.peak


class TensorPeak(TorchDispatchMode):
    """The peak of tensor storage allocated while the mode is on (CPU has no allocator stats;
    the resident set cannot see small tensors, which malloc serves from memory it already has).
    Every aten op's output storage that is new (not one of its inputs', i.e. not a view or an
    in-place result) counts from the op until the storage is freed."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in inputs and key not in self.live:
                    self.live[key] = size
                    self.now += size
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


def runner(contender, op: str, shape: str, args: tuple, settings: dict):
    """The runner of `contender` doing `op` on `shape`, or None if it does not do that."""
    if isinstance(contender, RemoteContender):
        return contender.runner(op, shape, args)
    subject = subjects.build(shape, settings["device"], settings["dtype"])
    fn = getattr(contender, op)(subject, *args)
    return None if fn is None else Local(fn, settings["device"])


def interleaved(runners: dict, rounds: int, warmup: int) -> dict:
    """{name: [ns per round]}: each round runs every runner once, in a shuffled order."""
    order = list(runners.items())
    for _ in range(warmup):
        for _, r in order:
            r.time()
    times = {name: [] for name in runners}
    for _ in range(rounds):
        random.shuffle(order)
        for name, r in order:
            times[name].append(r.time())
    return times


def summarize(times: dict, floor: str, per_call: int = 1) -> dict:
    """Per contender: median/min us, and against `floor` the median per-round ratio and the
    median per-round difference in us. `per_call` divides (calls that repeat the work)."""
    ref = times.get(floor)
    out = {}
    for name, ts in times.items():
        row = {"median_us": statistics.median(ts) / 1e3 / per_call, "min_us": min(ts) / 1e3 / per_call,
               "rounds": len(ts)}
        if ref is not None:
            row["ratio"] = statistics.median([a / b for a, b in zip(ts, ref)])
            row["overhead_us"] = statistics.median([a - b for a, b in zip(ts, ref)]) / 1e3 / per_call
        out[name] = row
    return out


def _tensors(value) -> list:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "logits"):  # a transformers ModelOutput
        return [value.logits]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def agree(results: dict, floor: str, loose: frozenset = frozenset()) -> dict:
    """{name: (agrees, max abs difference)} of each result against the floor's. Contenders in
    `loose` compute the model differently (their own implementation): a looser tolerance."""
    ref = _tensors(results.get(floor))
    out = {}
    for name, value in results.items():
        if name == floor or not ref:
            continue
        got = _tensors(value)
        if len(got) != len(ref) or any(a.shape != b.shape for a, b in zip(got, ref)):
            out[name] = (False, float("inf"))
            continue
        diff, ok = 0.0, True
        for a, b in zip(got, ref):
            low = {a.dtype, b.dtype} & {torch.bfloat16, torch.float16}  # half precision: looser
            a, b = a.detach().float().cpu(), b.detach().float().cpu()
            d = (a - b).abs().max().item() if a.numel() else 0.0
            scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
            tol = (2e-2 if low else 1e-4) * (10 if name in loose else 1)
            diff, ok = max(diff, d), ok and d <= tol * scale
        out[name] = (ok, diff)
    return out


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if hasattr(value, "logits"):
        return value.logits.detach().cpu()
    if isinstance(value, (list, tuple)):
        return [_to_cpu(v) for v in value]
    return None


class Worker:
    """A worker process (the twin's, or the baseline's): requests and replies are pickles over
    its stdin/stdout; its stderr is passed through to ours, and its last lines are kept so
    that a worker that dies can say why in one line (`last_error`).

    twin: the pure-Python twin of this checkout (INTERLACE_NO_EXTENSIONS=1).
    src:  an interlace's `src/` (a baseline tree, or this checkout's when it is measured beside
          a baseline), put first on the worker's path, its compiled extension required
          (INTERLACE_REQUIRE_EXTENSIONS=1).
    """

    def __init__(self, settings: dict, twin: bool = False, src: str | None = None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLACE_")}
        if twin:
            env["INTERLACE_NO_EXTENSIONS"] = "1"
        else:
            env["INTERLACE_REQUIRE_EXTENSIONS"] = "1"
        if src:
            env["INTERLACE_BENCH_SRC"] = src  # benchmarks/__init__.py puts it first on sys.path
        env["PYTHONPATH"] = os.pathsep.join([ROOT, src or os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._tail = collections.deque(maxlen=50)
        self._stderr = threading.Thread(target=self._forward, daemon=True)
        self._stderr.start()
        try:
            self.info = self.ask("init", settings)
        except BaseException:
            self.close()
            raise

    def _forward(self):
        """Pass the worker's stderr through, keeping its last lines."""
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self._tail.append(line.rstrip())
            sys.stderr.write(line)
            sys.stderr.flush()

    def last_error(self) -> str:
        """The last non-empty line the worker wrote to stderr (after it exited: its error)."""
        if self.proc.poll() is not None:
            self._stderr.join(timeout=5)
        return next((line.strip() for line in reversed(self._tail) if line.strip()), "")

    def ask(self, *message):
        try:
            pickle.dump(message, self.proc.stdin)
            self.proc.stdin.flush()
            status, value = pickle.load(self.proc.stdout)
        except (EOFError, BrokenPipeError):
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"the worker process exited (status {code}): "
                               f"{self.last_error() or 'it printed nothing'}") from None
        if status == "error":
            raise RuntimeError(f"the worker failed:\n{value}")
        return value

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask("quit")
            except (RuntimeError, OSError):
                pass
            self.proc.wait(timeout=30)
        self._stderr.join(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:  # (stdin of a worker that died: its unflushed request is lost)
                pass


class Remote:
    """A runner in the worker process."""

    def __init__(self, worker: Worker, key: int):
        self.worker, self.key = worker, key

    def time(self) -> int:
        return self.worker.ask("time", self.key)

    def result(self):
        return self.worker.ask("result", self.key)

    def peak(self):
        return self.worker.ask("peak", self.key)


class RemoteContender:
    """A contender measured by a worker process: the interlace twin, the baseline, or (beside
    a baseline) this tree's interlace. `runner(..., who="hooks")` is the worker's own floor."""

    def __init__(self, worker: Worker | None, name: str = "twin", label: str = "interlace twin",
                 reason: str | None = None):
        self.worker, self.name, self.label, self.reason = worker, name, label, reason
        self.version = worker.info["version"] if worker else ""

    def unavailable(self):
        return self.reason

    def runner(self, op, shape, args, who: str = "interlace"):
        key = self.worker.ask("runner", op, shape, args, who)
        return None if key is None else Remote(self.worker, key)

    def structural(self, shape):
        """What the worker's wrapper left on its module outside a trace (workloads.structural)."""
        return self.worker.ask("structural", shape)


def serve() -> None:
    """The worker's loop (see `Worker`): runs `Interlace` contender calls on request, on
    whichever interlace its path and environment chose (the twin's, or a baseline's), and
    the raw forward and plain hooks: the floor timed in this same process."""
    import traceback

    from .contenders import Hooks, Interlace, Raw

    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, not into the replies
    contenders = {"interlace": Interlace(), "hooks": Hooks(), "raw": Raw()}
    contender, runners, settings = contenders["interlace"], {}, {}
    while True:
        try:
            message = pickle.load(inp)
        except EOFError:
            return
        try:
            kind = message[0]
            if kind == "quit":
                pickle.dump(("ok", None), out)
                out.flush()
                return
            if kind == "init":
                settings.update(message[1])
                configure(settings)
                import interlace

                reply = {"native": interlace.native, "version": interlace.__version__,
                         "file": interlace.__file__, "pid": os.getpid()}
            elif kind == "runner":
                _, op, shape, args, who = message
                r = runner(contenders[who], op, shape, args, settings)
                reply = None
                if r is not None:
                    reply = len(runners)
                    runners[reply] = r
            elif kind == "time":
                reply = runners[message[1]].time()
            elif kind == "result":
                reply = _to_cpu(runners[message[1]].result())
            elif kind == "peak":
                reply = runners[message[1]].peak()
            elif kind == "structural":
                from .workloads import structural

                subject = subjects.build(message[1], settings["device"], settings["dtype"])
                contender.model(subject)  # wrapped, as the `wrapped` workload's runner wraps it
                reply = structural(subject.module)
            else:
                raise ValueError(f"unknown request {kind!r}")
            pickle.dump(("ok", reply), out)
        except Exception:  # noqa: BLE001 - reported to the harness, which raises it
            pickle.dump(("error", traceback.format_exc()), out)
        out.flush()
