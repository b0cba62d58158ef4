"""The twin's process: `python -m benchmarks.worker`, started by the harness (measure.Worker)
with INTERLACE_NO_EXTENSIONS=1; it times `interlace` calls on request, taking turns with it."""

from .measure import serve

if __name__ == "__main__":
    serve()
