"""`model.edit()` on Ray workers: a sweep of an edited wrapper replays its edits on every
worker's replica, equal to the local executor item for item (and to plain hooks).

The session's local Ray cluster on the CPU (conftest.py); skipped when ray is not installed.
"""

import pytest
import torch

ray = pytest.importorskip("ray", reason="executor='ray' needs ray: pip install 'interlace[ray]'")

pytestmark = pytest.mark.slow


def test_a_sweep_of_an_edited_wrapper_on_ray_applies_the_edits(ray_cluster, gpt2, model, corrupt):
    scale = 3.0
    with model.edit() as (tracer, edited):
        for _ in tracer.all():
            edited.transformer.h[0].mlp.output[:] = edited.transformer.h[0].mlp.output * scale
    positions = list(range(4))
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs (Ray gives an actor one CPU): bitwise equal
    try:
        for executor in ("local", "ray"):
            with torch.no_grad(), edited.sweep(positions, input=corrupt, batch_size=2, workers=2,
                                               executor=executor, progress=False) as sweep:
                edited.transformer.h[1].output[:, sweep.item] = 0
                logits = edited.lm_head.output[:, -1].save()
            out[executor] = logits
        with torch.no_grad(), model.sweep(positions, input=corrupt, batch_size=2, workers=2,
                                          executor="ray", progress=False) as sweep:
            model.transformer.h[1].output[:, sweep.item] = 0
            unedited = model.lm_head.output[:, -1].save()
        for pos, local, remote, plain in zip(positions, out["local"], out["ray"], unedited):
            assert torch.equal(local, remote)

            def zero(m, a, o, pos=pos):
                o = o.clone()
                o[:, pos] = 0
                return o

            handles = [gpt2.transformer.h[0].mlp.register_forward_hook(lambda m, a, o: o * scale),
                       gpt2.transformer.h[1].register_forward_hook(zero)]
            try:
                with torch.no_grad():
                    ref = gpt2(corrupt).logits[:, -1]
            finally:
                for handle in handles:
                    handle.remove()
            assert torch.equal(remote, ref)
            assert not torch.equal(remote, plain)  # the edits reached the workers
    finally:
        torch.set_num_threads(threads)
