"""Work per warm trace, counted rather than timed: Python function calls and C calls.

    python benchmarks/probes/calls.py [--list]

A trace's fixed cost on a shared or busy machine is hard to time (a 1 ms forward between
traces leaves the trace's code and data cold, and other processes add noise of the same
size as the cost), but the number of Python frames a trace enters outside the model's own
forward does not vary with load, and it is what that cost is made of. Counted with
`sys.setprofile` over one warm trace; the plain forward's counts are subtracted, and so are
the calls of the benchmark's own function:

  linear   `with model.trace(x): h = model.output.save()` on a 2x2 Linear
  gpt2     `with model.trace(ids): h = model.transformer.h[0].output.save()`, tiny GPT-2
           (2 layers, n_embd 64, 16 tokens)

Calls made inside compiled extension code (the hot path's, when it is live) are not seen:
the count is the Python work, which is what the compiled path exists to avoid.
`--list` prints every Python function entered by the linear trace.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def _count(fn, warm=5):
    for _ in range(warm):
        fn()
    python, c = collections.Counter(), collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            python[(os.path.basename(code.co_filename), code.co_name)] += 1
        elif event == "c_call":
            c[getattr(arg, "__qualname__", repr(arg))] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    python[(os.path.basename(__file__), fn.__name__)] -= 1
    c["setprofile"] -= 1
    return python, c


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the linear trace's Python calls")
    options = parser.parse_args(argv)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import interlace

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    linear = torch.nn.Linear(2, 2)
    wrapped_linear = interlace.Model(linear)
    x = torch.randn(1, 2)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)).eval()
    wrapped_gpt2 = interlace.Model(gpt2)
    ids = torch.randint(0, 1000, (1, 16))

    def linear_raw():
        linear(x)

    def linear_trace():
        with wrapped_linear.trace(x):
            wrapped_linear.output.save()

    def gpt2_raw():
        gpt2(ids)

    def gpt2_trace():
        with wrapped_gpt2.trace(ids):
            wrapped_gpt2.transformer.h[0].output.save()

    print(f"interlace native={interlace.native}, Python {sys.version.split()[0]}, "
          f"torch {torch.__version__}")
    print("| trace | Python calls over the plain forward | C calls over it |")
    print("|---|---|---|")
    listing = None
    for name, raw, trace in (("linear", linear_raw, linear_trace), ("gpt2", gpt2_raw, gpt2_trace)):
        raw_py, raw_c = _count(raw)
        trace_py, trace_c = _count(trace)
        print(f"| {name} | {sum(trace_py.values()) - sum(raw_py.values())} "
              f"| {sum(trace_c.values()) - sum(raw_c.values())} |")
        if name == "linear":
            listing = trace_py - raw_py
    if options.list:
        for (filename, function), n in sorted(listing.items()):
            print(f"{n:3d}  {filename}:{function}")


if __name__ == "__main__":
    main()
