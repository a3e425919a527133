"""The run report: a markdown results table next to the command that made it, and plots.

Written atomically at the end of a run (and rewritten by `fedvox eval`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedvox.atomic import atomic_write_text
from fedvox.records import EvalRecord


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def results_table(rows: list[tuple[str, dict]]) -> str:
    """Markdown table: system | EER | minDCF p=0.01 | minDCF p=0.05 | trials."""
    lines = [
        "| system | EER | minDCF (p=0.01) | minDCF (p=0.05) | target / nontarget trials |",
        "|---|---|---|---|---|",
    ]
    for name, m in rows:
        lines.append(
            f"| {name} | {pct(m['eer'])} | {m['min_dcf_01']:.4f} | {m['min_dcf_05']:.4f} "
            f"| {m['n_target']} / {m['n_nontarget']} |"
        )
    return "\n".join(lines)


def learning_curve_table(points: list[EvalRecord]) -> str:
    """Markdown table of the evaluations made during training (federated runs add client
    trips and virtual hours, DP runs ε)."""
    if not points:
        return ""
    fed = points[0].trips is not None and points[0].virtual_time_s is not None
    dp = points[-1].epsilon is not None
    head = "| step | train loss | cosine EER |" + (" client trips | virtual hours |" if fed else "")
    head += " ε |" if dp else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        loss = "-" if p.loss is None else f"{p.loss:.3f}"
        row = f"| {p.step} | {loss} | {pct(p.eer)} |"
        if fed:
            hours = "-" if p.virtual_time_s is None else f"{p.virtual_time_s / 3600:.2f}"
            row += f" {p.trips} | {hours} |"
        if dp:
            row += " - |" if p.epsilon is None else f" {p.epsilon:.3g} |"
        lines.append(row)
    return "\n".join(lines)


def write_report(
    path: Path,
    title: str,
    manifest: dict,
    rows: list[tuple[str, dict]],
    curve: list[EvalRecord],
    det_png: str | None,
    notes: list[str] | None = None,
    extra: list[str] | None = None,
) -> Path:
    """Write report.md: provenance, results table, learning curve and DET plot."""
    git = manifest.get("git", {})
    parts = [
        f"# {title}",
        "",
        f"- command: `{' '.join(Path(a).name if i == 0 else a for i, a in enumerate(manifest.get('command', sys.argv)))}`",
        f"- config hash: `{manifest.get('config_hash')}`, seed {manifest.get('seed')}",
        f"- fedvox {manifest.get('packages', {}).get('fedvox')}, torch {manifest.get('packages', {}).get('torch')}, "
        f"git {str(git.get('commit'))[:10]}{' (dirty)' if git.get('dirty') else ''}",
        f"- platform: {manifest.get('platform')}, torch threads {manifest.get('torch_threads')}",
        "",
        "## Results (held-out speakers)",
        "",
        results_table(rows),
        "",
    ]
    if curve:
        parts += ["## Learning curve", "", learning_curve_table(curve), ""]
    if det_png:
        parts += ["## DET curve", "", f"![DET curve]({det_png})", ""]
    if extra:
        parts += extra
    if notes:
        parts += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    parts += ["<!-- metrics as JSON -->", "```json", json.dumps(dict(rows), indent=1), "```", ""]
    return atomic_write_text(path, "\n".join(parts))
