"""Plain-text tables and the heatmap: how the demo shows its numbers."""

from __future__ import annotations

from pathlib import Path


def format_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A fixed-width text table; `align` has one of "l"/"r" per column (default: text left,
    numbers right)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    if any(len(r) != len(headers) for r in cells):
        raise ValueError("every row needs one cell per header")
    if align is None:
        align = "".join("r" if rows and isinstance(rows[0][c], (int, float)) else "l"
                        for c in range(len(headers)))
    widths = [max(len(r[c]) for r in cells) for c in range(len(headers))]

    def line(r):
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w)
                         for v, w, a in zip(r, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def shade(x: float) -> str:
    """One character for a 0..1 score, so a text table reads like a heatmap."""
    ramp = " .:-=+*#%@"
    x = min(max(x, 0.0), 1.0)
    return ramp[min(int(x * len(ramp)), len(ramp) - 1)]


def heatmap(scores, row_labels: list[str], col_labels: list[str], title: str,
            path: Path) -> Path:
    """Save `scores` (rows x cols, 0..1) as an annotated heatmap PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.1 * len(col_labels) + 2.5, 0.6 * len(row_labels) + 2))
    im = ax.imshow(scores, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(col_labels)), labels=col_labels)
    ax.set_yticks(range(len(row_labels)), labels=row_labels)
    ax.set_xlabel("position patched (clean -> corrupted prompt)")
    ax.set_ylabel("block output patched")
    for r in range(len(row_labels)):
        for c in range(len(col_labels)):
            v = float(scores[r][c])
            ax.text(c, r, f"{v:.2f}", ha="center", va="center",
                    color="white" if v > 0.6 else "black", fontsize=9)
    fig.colorbar(im, ax=ax, label="share of the clean answer restored")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
