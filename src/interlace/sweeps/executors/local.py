"""The local executor: batches run one after another in this thread, on the wrapped model.

Items are drawn lazily from the iterable, a window of a few batches at a time (grouped by
batch key within it, see runner.py), so a generator or a dataset is never materialised and
only what the bodies save is kept. A tqdm progress bar shows items/s and an ETA
(`progress=False` turns it off). Ctrl-C (or any error) leaves the model clean (the engine
removes its hooks and unwinds parked bodies) and `sweep.results` holds every item finished
before it, in order.
"""

from __future__ import annotations

import itertools

from ..runner import WINDOW, InOrder, Runner, choose_batch_size

SAMPLE = 64  # items looked at to choose the automatic batch size


def run(sweep, job):
    model = sweep.model
    total = length_of(sweep.items)
    entries = entries_of(sweep, job)
    size = sweep.batch_size
    if size is None:
        head, error = take(entries, SAMPLE)
        size = choose_batch_size(model, job, head, total)
        entries = itertools.chain(head, _raise(error) if error is not None else entries)
    runner = Runner(model, job, size)
    sweep.chosen_batch_size = size
    bar = progress_bar(sweep, total)
    results = sweep.results

    def commit(item, values):
        results.add(item, values)
        if bar is not None:
            bar.update(1)

    done = InOrder(commit)
    try:
        while True:
            window, error = take(entries, runner.size * WINDOW)
            if window:
                runner.run_window(window, done)
            if error is not None:
                raise error  # the items before it have finished
            if not window:
                break
    finally:
        if bar is not None:
            bar.close()
        sweep.chosen_batch_size = runner.size


def entries_of(sweep, job):
    """The sweep's items as runner Entries, made lazily (an input error stops the stream)."""
    keys = {}
    model = sweep.model
    for index, item in enumerate(sweep.items):
        if len(keys) > 1024:
            keys.clear()
        yield job.entry(model, index, item, keys)


def take(entries, n):
    """Up to `n` entries, and the error that stopped the stream early (or None)."""
    out = []
    try:
        for entry in entries:
            out.append(entry)
            if len(out) >= n:
                break
    except Exception as error:  # an item's input could not be made: named by Job.entry
        return out, error
    return out, None


def _raise(error):
    raise error
    yield  # unreachable: makes this a generator


def length_of(items):
    try:
        return len(items)
    except TypeError:  # a generator: no total, the bar counts up
        return None


def progress_bar(sweep, total):
    """A tqdm bar (items/s, ETA) when `progress=True`, else None."""
    if not sweep.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="item", desc="sweep", dynamic_ncols=True)
