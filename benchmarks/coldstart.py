"""Cold start of one contender, in this fresh process; prints one JSON line of ms.

    python -m benchmarks.coldstart --contender interlace --shape tiny [--device cpu]

torch and transformers are imported and the model is built first (not counted), then:
import_ms     importing the library (interlace, nnsight, transformer_lens)
wrap_ms       wrapping the model (interlace.Model, nnsight.NNsight, TransformerBridge)
first_ms      the first trace (saving layer 0) at a site never traced before
new_site_ms   later first traces at other new sites (median): capture and planning per site
warm_ms       the first site again (median of 5): what every later trace costs
The harness (`python -m benchmarks`, workload cold_start) runs this once per contender and
repetition, with INTERLACE_NO_EXTENSIONS=1 for the twin and INTERLACE_BENCH_SRC naming the
baseline's tree for the baseline.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

SITE = """
def site_{i}(model, s):
    with model.trace(s.ids):
        h = save(s.layers(model)[0].output)
    return h
"""

TL_SITE = """
def site_{i}(bridge, s):
    out = []
    bridge.run_with_hooks(s.ids, fwd_hooks=[("blocks.0.hook_out", lambda t, hook: out.append(t))])
    return out[0]
"""

LIBRARY = {"interlace": "interlace", "twin": "interlace", "baseline": "interlace", "nnsight": "nnsight",
           "tlens": "transformer_lens"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contender", required=True, choices=sorted(LIBRARY))
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--sites", type=int, default=4, help="new sites traced after the first")
    args = parser.parse_args(argv)

    import torch

    from . import contenders, measure, subjects

    measure.configure({"threads": args.threads, "device": args.device})
    s = subjects.build(args.shape, args.device, args.dtype)
    timer = time.perf_counter

    def ms(fn):
        measure.sync(args.device)
        start = timer()
        value = fn()
        measure.sync(args.device)
        return (timer() - start) * 1e3, value

    out = {}
    out["import_ms"], _ = ms(lambda: importlib.import_module(LIBRARY[args.contender]))
    if args.contender == "tlens":
        out["wrap_ms"], model = ms(lambda: contenders.TransformerLens().bridge(s))
        template, save = TL_SITE, None
    else:
        wrapper = contenders.NNsight() if args.contender == "nnsight" else contenders.Interlace()
        out["wrap_ms"], model = ms(lambda: wrapper.model(s))
        template, save = SITE, importlib.import_module(LIBRARY[args.contender]).save
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "bench_sites.py"), "w") as f:
            f.write("".join(template.format(i=i) for i in range(args.sites + 1)))
        sys.path.insert(0, tmp)
        sites = importlib.import_module("bench_sites")
        sites.save = save
        with torch.no_grad():
            out["first_ms"], _ = ms(lambda: sites.site_0(model, s))
            new = [ms(lambda i=i: getattr(sites, f"site_{i}")(model, s))[0] for i in range(1, args.sites + 1)]
            out["new_site_ms"] = statistics.median(new) if new else None
            out["warm_ms"] = statistics.median(ms(lambda: sites.site_0(model, s))[0] for _ in range(5))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
