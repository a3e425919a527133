"""The demo numbers quoted in the README and docs/verification.md are the ones `make numbers`
last wrote to docs/results/demo.json: editing one without regenerating the other fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "demo.json"


def _results() -> dict:
    return json.loads(RESULTS.read_text())["systems"]


def test_readme_quotes_the_recorded_demo_numbers() -> None:
    s = _results()
    text = (ROOT / "README.md").read_text()
    m = re.search(
        r"([\d.]+) % cosine, ([\d.]+) % PLDA, ([\d.]+) % barely trained, ([\d.]+) % baseline",
        text.replace("\n   ", " "),
    )
    assert m, "README no longer quotes the demo numbers in the expected form"
    quoted = [float(x) for x in m.groups()]
    recorded = [
        s["cosine"]["eer_pct"],
        s["plda"]["eer_pct"],
        s["barely_trained"]["eer_pct"],
        s["baseline"]["eer_pct"],
    ]
    assert quoted == recorded


def test_verification_table_default_row_is_the_recorded_run() -> None:
    s = _results()
    text = (ROOT / "docs" / "verification.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| mild (default) |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    want = [
        f"{s['cosine']['eer_pct']:.2f} % / {s['cosine']['min_dcf_01']:.3f}",
        f"{s['asnorm']['eer_pct']:.2f} % / {s['asnorm']['min_dcf_01']:.3f}",
        f"{s['plda']['eer_pct']:.2f} % / {s['plda']['min_dcf_01']:.3f}",
        f"{s['barely_trained']['eer_pct']:.2f} %",
        f"{s['baseline']['eer_pct']:.2f} %",
    ]
    assert cells == want
