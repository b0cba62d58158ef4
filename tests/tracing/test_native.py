"""`interlace._native`: which implementation is live, and the two environment switches.

Each case runs in a fresh interpreter, because the choice is made once at import.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import interlace
from interlace import _native

BLOCK_CFRAMES = textwrap.dedent(
    """\
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "interlace._cframes":
                raise ImportError("simulated: no compiled module")
    sys.meta_path.insert(0, Block())
    """
)

FAKE_FREE_THREADED = textwrap.dedent(
    """\
    import sysconfig
    _real = sysconfig.get_config_var
    sysconfig.get_config_var = lambda name: 1 if name == "Py_GIL_DISABLED" else _real(name)
    """
)

REPORT = textwrap.dedent(
    """\
    import logging, sys
    logging.basicConfig(stream=sys.stdout, format="LOG %(levelname)s %(message)s")
    import interlace, interlace._native as n
    print("native", interlace.native, n.frames.__name__, sorted(n.why_not))
    """
)


def run(prelude="", **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLACE_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run(
        [sys.executable, "-c", prelude + REPORT],
        capture_output=True, text=True, timeout=120, env=full_env,
    )


def test_flag_matches_the_loaded_module():
    assert interlace.native is _native.native
    assert _native.frames.COMPILED is (_native.frames.__name__ == "interlace._cframes")
    if interlace.native:
        assert _native.frames.__name__ == "interlace._cframes"


@pytest.mark.slow  # starts a subprocess
def test_no_extensions_forces_the_twin():
    proc = run(INTERLACE_NO_EXTENSIONS="1")
    assert proc.returncode == 0, proc.stderr
    assert "native False interlace._pyframes" in proc.stdout
    assert "LOG" not in proc.stdout


@pytest.mark.slow  # starts a subprocess
@pytest.mark.native_only
def test_default_loads_the_compiled_module():
    proc = run()
    assert proc.returncode == 0, proc.stderr
    assert "native True interlace._cframes []" in proc.stdout


@pytest.mark.slow  # starts a subprocess
@pytest.mark.native_only
def test_require_extensions_passes_when_built():
    proc = run(INTERLACE_REQUIRE_EXTENSIONS="1")
    assert proc.returncode == 0, proc.stderr
    assert "native True interlace._cframes" in proc.stdout


@pytest.mark.slow  # starts a subprocess
def test_a_failed_import_falls_back_to_the_twin_quietly():
    proc = run(BLOCK_CFRAMES)
    assert proc.returncode == 0, proc.stderr
    assert "native False interlace._pyframes ['_cframes']" in proc.stdout


@pytest.mark.slow  # starts a subprocess
def test_require_extensions_makes_a_failed_import_loud():
    proc = run(BLOCK_CFRAMES, INTERLACE_REQUIRE_EXTENSIONS="1")
    assert proc.returncode != 0
    assert "ImportError: INTERLACE_REQUIRE_EXTENSIONS=1 but interlace._cframes did not load" in proc.stderr
    assert "simulated: no compiled module" in proc.stderr


@pytest.mark.slow  # starts a subprocess
def test_unsupported_interpreter_uses_the_twin_and_says_so_once():
    proc = run(FAKE_FREE_THREADED)
    assert proc.returncode == 0, proc.stderr
    assert "native False interlace._pyframes" in proc.stdout
    logs = [line for line in proc.stdout.splitlines() if line.startswith("LOG")]
    assert len(logs) == 1, proc.stdout
    assert "not written for" in logs[0] and "free-threaded" in logs[0]


@pytest.mark.slow  # starts a subprocess
def test_unsupported_interpreter_with_require_fails_loudly():
    proc = run(FAKE_FREE_THREADED, INTERLACE_REQUIRE_EXTENSIONS="1")
    assert proc.returncode != 0
    assert "ImportError: INTERLACE_REQUIRE_EXTENSIONS=1 but interlace's extension is not written for" in proc.stderr


@pytest.mark.native_only
def test_compiled_functions_check_their_arguments():
    frames = _native.frames
    with pytest.raises(TypeError, match="needs a frame"):
        frames.arm(object(), 0, 0, 0, frames.JUMP)
    with pytest.raises(SystemError, match=r"_cframes_impl\.c:\d+: disarm\(\) needs an armed handle"):
        frames.disarm(object())
    if sys.version_info >= (3, 12):
        def f():
            return 1

        with pytest.raises(SystemError, match=r"_cframes_impl\.c:\d+: expected LOAD_FAST"):
            frames.patch_checks(f.__code__, (0,))  # unit 0 is RESUME, not a read
        with pytest.raises(SystemError, match="out of range"):
            frames.patch_checks(f.__code__, (10_000,))


@pytest.mark.native_only
def test_disarm_is_idempotent_and_reports_whether_the_skip_fired():
    frames = _native.frames
    before = sys.gettrace()
    handle = frames.arm(sys._getframe(), 10**6, 10**6, 0, frames.JUMP)
    assert frames.disarm(handle) is False
    assert frames.disarm(handle) is False
    assert sys.gettrace() is before
