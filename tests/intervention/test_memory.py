"""10,000 traces that each save one output and drop it: nothing accumulates."""

import gc

import torch

import interlace


def _rss_mib():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    except OSError:  # not Linux: the object count still tells
        return 0.0


def test_ten_thousand_traces_do_not_grow(mlp):
    model = interlace.Model(mlp)
    x = torch.randn(2, 6)

    def one():
        with torch.no_grad(), model.trace(x):
            h = model[2].output.save()
        return h

    for _ in range(300):  # warm-up: capture caches, worker pool, learned order
        one()
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_mib()
    for _ in range(10_000):
        one()
    gc.collect()
    assert len(gc.get_objects()) <= objects
    assert _rss_mib() - rss < 5.0
