"""Errors a user can act on: each names the file, the line or field, and the fix.

The command line catches `FedvoxError` and prints its message without a traceback.
"""

from __future__ import annotations

from pathlib import Path


class FedvoxError(Exception):
    """Base class for every error fedvox raises on bad input or configuration."""


class DataError(FedvoxError, ValueError):
    """Bad input data: names the file (and line), what is wrong, and how to fix it."""

    def __init__(
        self,
        file: str | Path | None,
        problem: str,
        fix: str,
        line: int | None = None,
    ) -> None:
        self.file = None if file is None else str(file)
        self.line = line
        self.problem = problem
        self.fix = fix
        where = ""
        if self.file is not None:
            where = self.file + (f":{line}" if line is not None else "") + ": "
        super().__init__(f"{where}{problem}. Fix: {fix}")


class ConfigError(FedvoxError, ValueError):
    """Invalid configuration: names the field, the bad value and the fix."""

    def __init__(self, field: str, problem: str, fix: str = "", source: str | None = None):
        self.field = field
        self.problem = problem
        self.fix = fix
        self.source = source
        where = f"{source}: " if source else ""
        tail = f". Fix: {fix}" if fix else ""
        super().__init__(f"{where}field '{field}': {problem}{tail}")


class StepSkipped(FedvoxError):
    """A server step's aggregate could not be formed, and the run was told to go on without it.

    Raised by a summer (e.g. secure aggregation aborted below its threshold with
    on_abort = "skip"); the simulator leaves the model unchanged for that step, logs the
    reason and stores `metrics` in the step's record.
    """

    def __init__(self, reason: str, metrics: dict[str, float] | None = None) -> None:
        self.reason = reason
        self.metrics = dict(metrics or {})
        super().__init__(reason)
