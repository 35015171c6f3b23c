"""Shared figure settings: the Agg backend (no display needed), resolution, and saving."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 150


def save_figure(fig, path: Path) -> Path:
    """Lay out, write as PNG at :data:`DPI`, close (figures are not kept open between runs)."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
