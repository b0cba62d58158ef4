"""Sweeps: one trace body run for thousands of items, as a few batched forward passes.

`model.sweep(items, input=...)` (on `Model` and `LanguageModel`) returns a `SweepTracer`;
see `tracer.py` for the block, `runner.py` for batching and retries, `results.py` for what is
kept, and `executors/` for where batches run (locally or on Ray).
"""

from .inputs import Inputs
from .results import SweepResults
from .tracer import SweepTracer

__all__ = ["SweepTracer", "SweepResults", "Inputs"]
