"""DET plots for verification results: miss vs false-alarm rate on normal-deviate axes.

Used by the report step after scoring; draws with matplotlib's Agg canvas (no display, no
pyplot global state) and writes the PNG atomically.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy.stats import norm

from fedvox.atomic import atomic_write
from fedvox.eval.metrics import compute_eer, det_curve

# Percent tick positions of the classic NIST DET plot.
_TICKS = np.array([0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 40, 50]) / 100.0
_LIMITS = (0.0005, 0.5)
_MAX_POINTS = 20_000


def _probit(p: np.ndarray) -> np.ndarray:
    return norm.ppf(np.clip(p, 1e-9, 1 - 1e-9))


def plot_det(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, title: str = "DET"
) -> Path:
    """Draw one DET curve per label from (target_scores, nontarget_scores); mark each EER.

    Returns the written PNG path.
    """
    fig = Figure(figsize=(5.5, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lo, hi = _probit(np.array(_LIMITS))
    for label, (tgt, non) in curves.items():
        p_miss, p_fa, _ = det_curve(tgt, non)
        eer, _ = compute_eer(tgt, non)
        x, y = _probit(p_fa), _probit(p_miss)
        if x.size > _MAX_POINTS:  # a million-trial list needs no million vertices
            keep = np.unique(np.linspace(0, x.size - 1, _MAX_POINTS).astype(int))
            x, y = x[keep], y[keep]
        (line,) = ax.plot(x, y, lw=1.5)  # the axes clip what lies outside
        line.set_label(f"{label} (EER {100 * eer:.2f}%)")
        e = float(np.clip(_probit(np.array([eer]))[0], lo, hi))
        ax.plot([e], [e], "o", color=line.get_color(), ms=5)
    ticks = _probit(_TICKS)
    labels = [f"{100 * t:g}" for t in _TICKS]
    ax.set_xticks(ticks, labels)
    ax.set_yticks(ticks, labels)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.plot([lo, hi], [lo, hi], ls=":", lw=0.8, color="grey")  # EER diagonal
    ax.set_xlabel("False alarm rate (%)")
    ax.set_ylabel("Miss rate (%)")
    ax.set_title(title)
    ax.grid(True, ls=":", lw=0.5)
    if curves:
        ax.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write(Path(path), lambda f: f.write(buf.getvalue()))
