"""Torch-free tests of the tracer core (run on CPython 3.10-3.13)."""
