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
import operator
import time

from ..runner import WINDOW, InOrder, Runner, choose_batch_size

SAMPLE = 64  # items looked at to choose the automatic batch size


def run(sweep, job):
    model = sweep.model
    total = length_of(sweep.items)
    bar = progress_bar(sweep, total)
    runner = None
    try:
        done = committer(sweep, job, bar)
        entries = entries_of(sweep, job, done)
        size = sweep.batch_size
        if size is None:
            head, error = take(entries, SAMPLE)
            size = choose_batch_size(model, job, head, total)
            entries = itertools.chain(head, _raise(error) if error is not None else entries)
        runner = Runner(model, job, size)
        sweep.chosen_batch_size = size
        while True:
            if job.store is not None:
                job.store.flush_rows = runner.size  # a shard per batch, about
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
        if runner is not None:
            sweep.chosen_batch_size = runner.size


def entries_of(sweep, job, done):
    """The sweep's items as runner Entries, made lazily (an input error stops the stream).

    With `save_to=`, an item an earlier run finished is checked against the one on disk and
    handed to `done.skip` instead (its body does not run again).
    """
    entries = job.entries(sweep.model, sweep.items)
    store = job.store
    if store is None or not len(store.finished):  # nothing on disk to skip (a fresh folder)
        return entries
    return (entry for entry in entries if not _skipped(store, job, entry, done))


def _skipped(store, job, entry, done):
    if store.skips(job, entry):
        done.skip(entry.index)
        return True
    return False


def committer(sweep, job, bar):
    """What finished items go through, in item order: `sweep.results` (or the `save_to=`
    folder), and the progress bar (with `save_to=`: MB/s written, besides rows/s)."""
    results = sweep.results
    store = job.store
    start = time.perf_counter()
    last = [start]

    def commit(entries, values):
        if store is None:
            results.extend(list(map(_ITEM, entries)), values)
        else:
            store.commit(job, entries, values)
        if bar is not None:
            bar.update(len(entries))
            now = time.perf_counter()
            if store is not None and now - last[0] > 0.5:
                last[0] = now
                bar.set_postfix_str(f"{store.nbytes / 1e6 / (now - start):.1f} MB/s",
                                    refresh=False)

    done = InOrder(commit)
    if bar is not None and store is not None:
        skip = done.skip

        def skipping(index):  # finished by an earlier run: counted, not timed
            skip(index)
            bar.update(1)

        done.skip = skipping
    return done


_ITEM = operator.attrgetter("item")


def take(entries, n):
    """Up to `n` entries, and the error that stopped the stream early (or None)."""
    out = []
    try:  # (a list keeps what it took when the stream raises part-way)
        out.extend(itertools.islice(entries, n))
    except Exception as error:  # an item's input could not be made: named by Job.entries
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

    unit = "item" if getattr(sweep, "save_to", None) is None else "row"
    return tqdm(total=total, unit=unit, desc="sweep", dynamic_ncols=True)
