"""The one place that chooses the compiled extension or its pure-Python twin.

PLACEHOLDER — owned by the native-extension work (see docs/architecture.md).
"""

native = False
