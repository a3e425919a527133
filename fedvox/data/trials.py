"""Speaker-verification trial lists (VoxCeleb "1 a b" and Kaldi "a b target") bound to a corpus.

Data path: extractor ──► scoring; each trial pairs two utt ids of an evaluation corpus.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedvox.data.corpus import Corpus, numbered_lines, read_text
from fedvox.errors import ConfigError, DataError

_KALDI_LABELS = {"target": True, "nontarget": False}
_VOX_LABELS = {"1": True, "0": False}
_FORMAT_FIX = (
    "use one format per file: VoxCeleb '1 enroll test' (1 = target, 0 = nontarget) "
    "or Kaldi 'enroll test target|nontarget'"
)


@dataclass(frozen=True)
class Trial:
    """One verification trial: does `test` come from the speaker of `enroll`?"""

    enroll: str  # utt id
    test: str  # utt id
    target: bool


@dataclass
class TrialList:
    """Trials in file order, and where they came from."""

    trials: list[Trial]
    source: Path | None = None

    def __len__(self) -> int:
        return len(self.trials)

    def labels(self) -> np.ndarray:
        """Target (True) / nontarget (False) per trial."""
        return np.fromiter((t.target for t in self.trials), dtype=bool, count=len(self.trials))

    def utt_ids(self) -> list[str]:
        """Sorted unique utt ids the trials use (what must be embedded)."""
        return sorted({u for t in self.trials for u in (t.enroll, t.test)})


def _line_format(fields: list[str]) -> str | None:
    """'kaldi', 'voxceleb' or None (no recognisable label) for one 3-field line."""
    # Label-last wins: a Kaldi utt id may well be "1", a trailing "target" is unambiguous.
    if fields[2] in _KALDI_LABELS:
        return "kaldi"
    if fields[0] in _VOX_LABELS:
        return "voxceleb"
    return None


def read_trials(path: Path, corpus: Corpus) -> TrialList:
    """Read a VoxCeleb or Kaldi trial list (detected per file); tokens resolved in `corpus`."""
    path = Path(path)
    text = read_text(path, "trial list")

    fmt: str | None = None
    fmt_line = 0
    trials: list[Trial] = []
    for number, raw in numbered_lines(text):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if len(fields) != 3:
            raise DataError(
                path,
                f"expected 3 fields, got {len(fields)}",
                "write one trial per line: '1 enroll test' (VoxCeleb) or "
                "'enroll test target' (Kaldi)",
                line=number,
            )
        this = _line_format(fields)
        if this is None:
            if fmt == "kaldi":
                problem = f"label '{fields[2]}' is not 'target' or 'nontarget'"
            elif fmt == "voxceleb":
                problem = f"label '{fields[0]}' is not 1 (target) or 0 (nontarget)"
            else:
                problem = (
                    f"no valid label: expected '1'/'0' first (VoxCeleb) or "
                    f"'target'/'nontarget' last (Kaldi), got '{fields[0]}' ... '{fields[2]}'"
                )
            raise DataError(path, problem, _FORMAT_FIX, line=number)
        if fmt is None:
            fmt, fmt_line = this, number
        elif this != fmt:
            raise DataError(
                path,
                f"mixed formats: this line is {this}, line {fmt_line} is {fmt}",
                _FORMAT_FIX,
                line=number,
            )
        if fmt == "kaldi":
            enroll, test, label = fields[0], fields[1], _KALDI_LABELS[fields[2]]
        else:
            enroll, test, label = fields[1], fields[2], _VOX_LABELS[fields[0]]
        where = f"{path}:{number}"
        trials.append(Trial(corpus.resolve(enroll, where), corpus.resolve(test, where), label))

    if not trials:
        raise DataError(path, "trial list has no trials", "check it is the right file")
    n_target = sum(t.target for t in trials)
    if n_target == 0 or n_target == len(trials):
        missing = "target" if n_target == 0 else "nontarget"
        raise DataError(
            path,
            f"all {len(trials)} trials are {'nontarget' if n_target == 0 else 'target'}: "
            f"no {missing} trials, so EER is undefined",
            "use a list with both target and nontarget trials (check the labels)",
        )
    return TrialList(trials, source=path)


def _token(utt_id: str, corpus: Corpus | None) -> str:
    """How a VoxCeleb list names an utterance: its path under the corpus root if unambiguous."""
    if corpus is None or utt_id not in corpus:
        return utt_id
    utt = corpus[utt_id]
    if utt.start is not None or utt.end is not None:
        return utt_id  # a segment has no path of its own
    candidates = []
    try:
        candidates.append(utt.path.relative_to(corpus.root).as_posix())
    except ValueError:
        pass
    candidates.append("/".join(utt.path.parts[-3:]))  # spk/video/n.wav, the VoxCeleb form
    for token in candidates:
        try:
            if corpus.resolve(token) == utt_id:
                return token
        except DataError:
            continue
    return utt_id


def write_trials(
    path: Path, trials: TrialList, corpus: Corpus | None = None, fmt: str = "kaldi"
) -> None:
    """Write a trial list atomically, as Kaldi "a b target" or VoxCeleb "1 a b".

    VoxCeleb format names utterances by their path under the corpus root (e.g.
    "spk/yt/n.wav") when that path finds the same utterance back; otherwise by utt id.
    """
    if fmt not in ("kaldi", "voxceleb"):
        raise ConfigError("fmt", f"unknown trial format '{fmt}'", "use 'kaldi' or 'voxceleb'")
    path = Path(path)
    lines = []
    for t in trials.trials:
        if fmt == "kaldi":
            a, b = t.enroll, t.test
            line = f"{a} {b} {'target' if t.target else 'nontarget'}"
        else:
            a, b = _token(t.enroll, corpus), _token(t.test, corpus)
            line = f"{1 if t.target else 0} {a} {b}"
        for name in (a, b):
            if not name or any(c.isspace() for c in name):
                raise DataError(
                    path,
                    f"utterance '{name}' is empty or contains whitespace; a trial list cannot "
                    "hold it",
                    "rename the utterance without spaces",
                )
        lines.append(line + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.writelines(lines)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
