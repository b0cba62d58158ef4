"""Every docs page's examples run: each ```python block of docs/*.md, in order, in one process.

A page's blocks share one namespace (a later block may use what an earlier one defined), so
a page reads as a session. Blocks fenced as ```python no-run (output, or code that needs a
GPU or the hub) are shown, not run; blocks fenced as ```python needs=MODULE run only where
MODULE is installed (an optional extra), else they are left out. Each page runs in a fresh subprocess: a page may wrap
models and mount things without touching the test process.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python(?:[ \t]+needs=([\w.]+))?[ \t]*\n(.*?)^```", re.S | re.M)


def _pages():
    return sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))


def _script(page):
    blocks = [block for needs, block in BLOCK.findall(page.read_text())
              if not needs or importlib.util.find_spec(needs) is not None]
    parts = []
    for i, block in enumerate(blocks):
        # each block keeps its own line numbers in tracebacks via a marker comment
        parts.append(f"# --- {page.name}, example {i + 1}\n{block}")
    return "\n".join(parts)


@pytest.mark.slow  # starts a subprocess
@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_docs_page_examples_run(page, tmp_path):
    script = tmp_path / (page.stem.replace("-", "_") + "_examples.py")
    script.write_text(_script(page))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"{page.name} examples failed:\n{done.stdout}\n{done.stderr}"
