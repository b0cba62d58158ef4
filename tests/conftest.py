"""Suite-wide switches: which path is live, and the `native_only` marker.

CI runs the whole suite twice: natively (INTERLACE_REQUIRE_EXTENSIONS=1) and with
INTERLACE_NO_EXTENSIONS=1. Tests the pure-Python twin cannot pass carry
`@pytest.mark.native_only` and are skipped on the twin's run.
"""

import pytest

import interlace


def pytest_report_header(config):
    return f"interlace path: {'native (compiled extension)' if interlace.native else 'pure-Python twin'}"


def pytest_collection_modifyitems(config, items):
    if interlace.native:
        return
    skip = pytest.mark.skip(reason="native-only: the pure-Python twin cannot keep this shape")
    for item in items:
        if "native_only" in item.keywords:
            item.add_marker(skip)
