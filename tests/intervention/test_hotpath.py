"""The hot path's mechanism, on the compiled module and its twin side by side."""

import importlib

import pytest

from interlace import _native

IMPLS = ["interlace._pyhotpath"]
try:
    importlib.import_module("interlace._chotpath")
    IMPLS.append("interlace._chotpath")
except ImportError:
    pass


@pytest.fixture(params=IMPLS)
def hp(request):
    return importlib.import_module(request.param)


def test_native_selects_the_engine_hot_path():
    expected = "interlace._pyhotpath" if _native.NO_EXTENSIONS else "interlace._chotpath"
    if not _native.NO_EXTENSIONS and "interlace._chotpath" not in IMPLS:
        expected = "interlace._pyhotpath"
    assert _native.hotpath.__name__ == expected


def test_counts_occurrences_exactly_when_learning(hp):
    hub = hp.Hub(5, 0, None, None, True)
    assert [hub.fire(0), hub.fire(3), hub.fire(3), hub.fire(1)] == [0, 0, 1, 0]
    assert hub.so_far(3) == 2 and hub.so_far(2) == 0 and hub.calls == 1
    assert hub.record == [0, 3, 3, 1]


def test_derives_counts_of_unhooked_keys_from_the_learned_order(hp):
    # one root call: 0 (root in), 2, 3, 2, 3, 1 (root out): key 3 happens twice per call
    order = (0, 2, 3, 2, 3, 1)
    positions = tuple(tuple(i for i, k in enumerate(order) if k == key) for key in range(5))
    visits = tuple(len(p) for p in positions)
    hub = hp.Hub(5, 0, visits, positions, False)
    hub.observe(0)
    assert hub.so_far(3) == 0
    hub.fire(0)  # call 1 starts
    assert hub.so_far(3) == 0 and hub.position == 0
    hub.observe(2)
    hub.fire(2)
    hub.fire(2)  # position 3: key 3 happened once (index 2), not yet index 4
    assert hub.position == 3 and hub.so_far(3) == 1
    hub.observe(3)  # hooked from now: continues from the derived count
    assert hub.fire(3) == 1
    hub.fire(0)  # call 2
    assert hub.so_far(1) == 1 and hub.so_far(2) == 2 and hub.fire(2) == 2


def test_parks_and_takes_in_order(hp):
    hub = hp.Hub(4, 0, None, None, True)
    assert hub.take(1, 0) is None
    a, b, c = object(), object(), object()
    hub.park(1, 0, a)
    hub.park(1, 0, b)
    hub.park(2, 5, c)
    assert hub.nparked == 3
    assert hub.take(1, 1) is None
    assert hub.take(1, 0) == [a, b]
    assert hub.take(1, 0) is None
    assert hub.drain() == [(2, 5, c)]
    assert hub.nparked == 0 and hub.take(2, 5) is None


def test_pointer_pin_relax_save_restore(hp):
    p = hp.Pointer()
    assert p.bind(7) == 0  # default: occurrence 0
    saved = p.save()
    p.depth += 1
    p.pin(3)
    assert p.bind(0) == 3  # the pin binds the next request...
    assert p.bind(4) == 4 and p.iteration == hp.RELAXED  # ...then the pointer relaxes
    p.pin(5)
    p.restore(saved)
    assert p.bind(9) == 0 and p.depth == 0
    with pytest.raises(ValueError, match="iteration must be >= 0, got -1"):
        p.pin(-1)
