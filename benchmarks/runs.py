"""Several whole runs (`--runs N`) read as one: the median of the per-run figures, and their spread.

One run's figures are already medians over its rounds; what they cannot show is how much a
whole run moves (workers started afresh, the machine's load a minute later). `combine` takes
N runs' results and gives one result of the same shape: every number the median of the N
per-run numbers at the same place, booleans true only if true in every run (a result that
disagreed once is reported; `max_diff` is the largest), anything else as the first run that
has it. The figures a
reader compares (ratios, overheads, slopes, import and first-trace times) also get
`<key>_spread`: [min, max] over the runs, which the report prints beside the median.
"""

from __future__ import annotations

import statistics

#: Figures whose spread over runs is kept beside their median.
SPREAD = frozenset({"ratio", "vs_baseline", "overhead_us", "over_raw_us", "per_edit_us",
                    "over_empty_wall_ms", "first_ms"})


#: Top-level entries that describe a run rather than measure it: the first run's.
AS_FIRST = ("hardware", "settings", "labels", "baseline")


def combine(runs: list) -> dict:
    """One result from several runs' results (see the module docstring)."""
    out = _merge(runs)
    for key in AS_FIRST:
        if key in runs[0]:
            out[key] = runs[0][key]
    return out


def _merge(values: list):
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, dict):
        dicts = [v for v in present if isinstance(v, dict)]
        out = {}
        for key in dict.fromkeys(k for d in dicts for k in d):
            out[key] = _merge([d.get(key) for d in dicts])
            if key == "max_diff":  # the worst disagreement of any run
                out[key] = max(_numbers([d.get(key) for d in dicts]), default=out[key])
            nums = _numbers([d.get(key) for d in dicts])
            if key in SPREAD and nums and len(dicts) > 1:
                out[f"{key}_spread"] = [min(nums), max(nums)]
        return out
    if isinstance(first, bool):
        return all(v is True for v in present)
    nums = _numbers(present)
    if nums and len(nums) == len(present):
        return statistics.median(nums)
    return first


def _numbers(values: list) -> list:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
