"""Metric curves as PNG files (the RL reward curve, the SFT loss curve), drawn headless with matplotlib."""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

__all__ = ["plot_history"]

logger = logging.getLogger(__name__)


def plot_history(history: Sequence[dict], series: Sequence[tuple[str, str, str]], path: str, title: str,
                 ylabel: str, step_key: str) -> Optional[str]:
    """Plot ``(metric key, label, matplotlib format)`` series of logged metric dicts against ``step_key``.

    A series is drawn from the entries that have its key; returns ``path``, or None when nothing was logged."""
    curves = []
    for key, label, fmt in series:
        points = [(h[step_key], h[key]) for h in history if key in h and step_key in h]
        if points:
            curves.append((points, label, fmt))
    if not curves:
        return None
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed, so %s is not drawn (pip install matplotlib)", path)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for points, label, fmt in curves:
        ax.plot([s for s, _ in points], [v for _, v in points], fmt, ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
