"""A trace leaves nothing of the caller's locals behind (3.10-3.12 keep an `f_locals` snapshot).

Reading a function frame's `f_locals` leaves a dict on the frame holding every local of that
moment; without emptying it, `del model` later in the same function frees nothing.
"""

import gc
import weakref

import interlace


class Big:
    """Stands for a model: something the user drops and expects to be freed at once."""


def test_a_deleted_local_is_freed_while_the_function_still_runs():
    gc.collect()
    gc.disable()
    try:
        big = Big()
        ref = weakref.ref(big)
        with interlace.Tracer():
            seen = interlace.save(type(big).__name__)
        assert seen == "Big"
        del big
        assert ref() is None
    finally:
        gc.enable()


def test_the_first_trace_at_a_site_leaves_nothing_either():
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):  # the first pass captures the site, the second is warm
            big = Big()
            ref = weakref.ref(big)
            with interlace.Tracer():
                kept = interlace.save([big is not None])
            del big
            assert ref() is None and kept == [True]
    finally:
        gc.enable()


def test_locals_still_read_correctly_after_a_trace():
    a, b = 1, 2
    with interlace.Tracer():
        c = interlace.save(a + b)
    assert locals()["c"] == 3 and locals()["a"] == 1
    d = c + a
    assert d == 4
