"""Every error and warning a user can see has one home, `interlace.errors`, and is importable
from `interlace` (so `except interlace.CacheError:` works without knowing the module)."""

from __future__ import annotations

import ast
import pathlib

import interlace
from interlace import errors

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "interlace"
_PUBLIC_BASES = {"InterlaceError", "UserWarning"}


def _classes(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases}
            yield node, bases


def test_public_errors_are_defined_only_in_errors_py():
    elsewhere = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "errors.py"
        for node, bases in _classes(path)
        if bases & _PUBLIC_BASES
    ]
    assert elsewhere == [], "define these in interlace/errors.py:\n" + "\n".join(elsewhere)


def test_every_error_is_exported_from_interlace():
    names = [node.name for node, _ in _classes(ROOT / "errors.py")]
    assert len(names) >= 14
    for name in names:
        assert name in interlace.__all__, name
        assert getattr(interlace, name) is getattr(errors, name)
