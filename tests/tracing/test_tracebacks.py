"""Errors from a traced block reach the user with the user's frames only.

Natively `Tracer.__enter__`/`__exit__`/`__aenter__`/`__aexit__` are C methods that clean
every error leaving them and add no frame, so a traceback has *no* interlace frame: not
hidden (pytest/IPython's `__tracebackhide__`), gone, for `traceback.extract_tb` and for a
plain `python script.py`. The pure-Python twin keeps the one frame that re-raises (CPython
records the frame a `raise` runs in).
"""

import asyncio
import os
import subprocess
import sys
import traceback

import pytest

import interlace
from interlace import Backend, Tracer, UnsupportedBlockError, WithBlockNotFoundError, save

PACKAGE = os.path.dirname(interlace.__file__) + os.sep


def ours(error):
    """Names of interlace's frames in `error`'s traceback."""
    return [fr.name for fr in traceback.extract_tb(error.__traceback__) if fr.filename.startswith(PACKAGE)]


def users(error):
    """Names of the other frames (the user's, in any file)."""
    return [fr.name for fr in traceback.extract_tb(error.__traceback__) if not fr.filename.startswith(PACKAGE)]


def expect(twin_frame):
    return [] if interlace.native else [twin_frame]


class Custom(Exception):
    pass


def body_error(x):
    with Tracer():
        h = save(x)  # noqa: F841
        raise Custom(f"boom {x}")


def test_body_errors_cold_and_warm_have_no_interlace_frame():
    for i in range(4):  # the first entry is cold (Python policy), the rest warm (C)
        with pytest.raises(Custom, match=f"boom {i}") as info:
            body_error(i)
        assert ours(info.value) == expect("__exit__")
        assert users(info.value)[-2:] == ["body_error", "body_error"]  # the with line, the body line
        assert info.value.__context__ is None  # not our skip signal (twin) or anything else


def test_backend_errors_have_no_interlace_frame():
    def helper():
        raise KeyError("in the backend")

    class Failing(Backend):
        def __call__(self, tracer):
            helper()

    def f():
        with Tracer(backend=Failing()):
            x = 1  # noqa: F841

    for _ in range(3):
        with pytest.raises(KeyError) as info:
            f()
        assert ours(info.value) == expect("__exit__")
        assert users(info.value)[-3:] == ["f", "__call__", "helper"]


def test_refusals_from_enter_have_no_interlace_frame():
    def refused():
        with Tracer():
            return 1

    def not_a_with(tracer):
        return tracer.__enter__()

    for _ in range(2):
        with pytest.raises(UnsupportedBlockError) as info:
            refused()
        assert ours(info.value) == expect("__enter__")
        with pytest.raises(WithBlockNotFoundError) as info:
            not_a_with(Tracer())
        assert ours(info.value) == expect("__enter__")


def test_nested_traces_and_async_with_have_no_interlace_frame():
    def nested():
        with Tracer():
            with Tracer():
                raise Custom("inner")

    async def coroutine():
        async with Tracer():
            raise Custom("async")

    for _ in range(2):
        with pytest.raises(Custom, match="inner") as info:
            nested()
        assert ours(info.value) == expect("__exit__")  # the outer one cleans the inner's
        assert users(info.value)[-3:] == ["nested", "nested", "nested"]
        with pytest.raises(Custom, match="async") as info:
            asyncio.run(coroutine())
        assert ours(info.value) == expect("__aexit__")


SCRIPT = """\
from interlace import Tracer, save

def compute(x):
    return 1 // x

def main():
    for x in (1, 0):
        with Tracer():
            y = save(compute(x))
    return y

main()
"""


@pytest.mark.slow  # starts a subprocess
def test_a_plain_python_script_prints_only_the_users_frames(tmp_path):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(PACKAGE)))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    err = done.stderr
    assert err.rstrip().endswith("ZeroDivisionError: integer division or modulo by zero"), err
    for line in ("line 12, in <module>", "line 8, in main", "line 9, in main", "line 4, in compute"):
        assert line in err, err
    assert "SkipSignal" not in err and "During handling" not in err, err
    internal = [line for line in err.splitlines() if PACKAGE in line]
    if interlace.native:
        assert internal == [], err
    else:
        assert len(internal) == 1 and "__exit__" in internal[0], err
