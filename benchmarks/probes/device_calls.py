"""What a warm trace asks of torch and of the device, per call, beside the raw forward and
plain hooks: counted with `torch.profiler`, not timed.

    python benchmarks/probes/device_calls.py                  # CPU, tiny GPT-2, ~20 s
    python benchmarks/probes/device_calls.py --device cuda    # bf16; adds the CUDA runtime's calls

On a GPU a small model's forward is bound by the host (launching kernels), so a trace that
asked the device for anything more than the model does (a kernel, a copy, above all a
synchronisation, which stops the host until the device has caught up) would cost far more
there than its instruction count says. This lists, per workload, every event whose count per
call differs from the raw forward's: torch operators (`aten::...`) and, on CUDA, runtime calls
(`cudaLaunchKernel`, `cudaStreamSynchronize`, `cudaMemcpyAsync`, ...). Plain hooks and interlace
should differ from the raw forward only by their own edits' operators (`zero_mlps`, `edit`: a
`zeros_like` per MLP); `invokes` also shows what the model does with the mask and positions a
language model's batch passes (the plain-hook batch passes none). It also says whether this
process has compiled anything (then every trace sets dynamo's stance, `compiled.py`).

Workloads are the harness's (`benchmarks/contenders.py`): save_one, zero_mlps, invokes (16).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

if not __package__:  # run as a script: this checkout's benchmarks package and src/
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.path.insert(0, os.path.join(root, "src"))
    sys.path.insert(0, root)

from benchmarks import contenders as C  # noqa: E402
from benchmarks import subjects  # noqa: E402

CONTENDERS = (("raw", C.Raw), ("hooks", C.Hooks), ("interlace", C.Interlace))
WORKLOADS = {
    "save_one": lambda c, s: c.save_one(s),
    "zero_mlps": lambda c, s: c.zero_mlps(s),
    "invokes": lambda c, s: c.invokes(s, 16),
}


def events_per_call(run, calls, device):
    """{event name: count per call} over `calls` warm calls of `run`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(5):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    counts = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CPU":  # host events: operators and runtime calls
            counts[event.name] += 1
    return {name: n / calls for name, n in counts.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    s = subjects.build(args.shape, args.device, dtype)
    print(f"events per call that differ from the raw forward's ({args.shape}, {device}, "
          f"{args.calls} warm calls each)")
    with torch.no_grad():
        for work in args.workloads.split(","):
            counts = {name: events_per_call(WORKLOADS[work](cls(), s), args.calls, device)
                      for name, cls in CONTENDERS}
            raw = counts["raw"]
            names = sorted({n for c in counts.values() for n in c
                            if abs(c.get(n, 0) - raw.get(n, 0)) > 1e-9 and _counted(n)})
            print(f"\n### {work}\n")
            print("| event | raw | hooks | interlace |\n|---|---:|---:|---:|")
            for n in names:
                print(f"| `{n}` | " + " | ".join(f"{counts[c].get(n, 0):g}" for c, _ in CONTENDERS) + " |")
            if not names:
                print("| (none) | | | |")
    from interlace.intervention import compiled

    print(f"\nthis process compiled something (traces set dynamo's stance): {compiled._Eager.compiled}")


def _counted(name):
    """Operators and the CUDA runtime's and driver's calls (`cuda...`, `cu...`: launches,
    copies, synchronisations); not the profiler's own Python-level records."""
    return name.startswith(("aten::", "cu"))


if __name__ == "__main__":
    main()
