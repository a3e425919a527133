"""Typed run telemetry: the records the federated engine emits and a run's logs hold.

Base layer (stdlib and `fedvox.errors` only). The simulator hands `TripRecord`,
`ServerStepRecord` and `EpochRecord` to its callback; a run appends them, with `EvalRecord`
and `TrainRecord`, to metrics.jsonl / trips.jsonl through `append_run_log`; fedstats,
compare, the report and repro read them back through `read_run_log`. Each kind spells its
on-disk keys once, in its `to_json` / `from_json`.

On disk a record is one JSON object per line with a "kind"; optional fields that are None
are left out; keys a record does not know are ignored (older logs carried duplicates).
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar, overload

from fedvox.errors import DataError

TRIP_STATUSES = ("aggregated", "stale", "dropped_out", "cancelled")

R = TypeVar("R", bound="Record")
# field metadata: a dict field stored flat, one key per entry with this prefix (agg_clip_norm)
PREFIX = "key_prefix"


@dataclass(frozen=True)
class Record:
    """What every record kind shares: its on-disk `kind` and the JSON round trip."""

    KIND: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        """The on-disk object: "kind" plus every field that is not None (tuples as lists)."""
        out: dict[str, Any] = {"kind": self.KIND}
        for f in fields(self):
            value = getattr(self, f.name)
            if PREFIX in f.metadata:
                out.update({f.metadata[PREFIX] + k: v for k, v in value.items()})
            elif value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls: type[R], obj: Mapping[str, Any]) -> R:
        """The record of an on-disk object; DataError (no file yet) names a missing or
        mistyped field. Keys the kind does not have are ignored."""
        if obj.get("kind") != cls.KIND:
            raise DataError(
                None,
                f"a {obj.get('kind')!r} record is not a {cls.KIND!r} record",
                f"read it with the record class of its kind ({', '.join(KINDS)})",
            )
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if PREFIX in f.metadata:
                pre = f.metadata[PREFIX]
                found = {k.removeprefix(pre): v for k, v in obj.items() if k.startswith(pre)}
                values[f.name] = _typed(found, hints[f.name], cls.KIND, pre)
                continue
            if f.name not in obj or obj[f.name] is None:
                if _optional(hints[f.name]):
                    continue
                raise DataError(
                    None,
                    f"{cls.KIND} record has no field '{f.name}'",
                    "repair or remove the line (every record fedvox writes has it)",
                )
            values[f.name] = _typed(obj[f.name], hints[f.name], cls.KIND, f.name)
        record = cls(**values)
        record._check()
        return record

    def _check(self) -> None:
        """Constraints between fields that a line read from disk must meet (none by default)."""


@dataclass(frozen=True)
class TripRecord(Record):
    """One client trip (download, local training, upload) at its end, in trips.jsonl.

    `time` is the virtual second the trip ended (arrived, dropped out, was cancelled);
    aggregated trips also carry their staleness, mean local loss, examples and the server
    step that aggregated them; stale trips carry their staleness.
    """

    KIND: ClassVar[str] = "trip"

    time: float
    client: int
    trip: int  # the client's own trip number
    trip_id: int  # the simulator's global trip number
    start_time: float
    start_version: int  # the server step whose model the client downloaded
    status: str  # one of TRIP_STATUSES
    bytes_down: int
    bytes_up: int
    staleness: int | None = None
    loss: float | None = None
    num_examples: int | None = None
    server_step: int | None = None

    def _check(self) -> None:
        if self.status not in TRIP_STATUSES:
            raise DataError(
                None,
                f"trip record has status {self.status!r}",
                f"use one of {', '.join(TRIP_STATUSES)}",
            )
        if self.status == "aggregated":
            need = ("staleness", "loss", "num_examples", "server_step")
            missing = [n for n in need if getattr(self, n) is None]
            if missing:
                raise DataError(
                    None,
                    f"aggregated trip record has no field '{missing[0]}'",
                    "repair or remove the line (aggregated trips carry " + ", ".join(need) + ")",
                )


@dataclass(frozen=True)
class ServerStepRecord(Record):
    """One server step: what was aggregated, the clock and cumulative counters after it.

    Counters are cumulative over the run (trips = completed trips, bytes, dropped, stale,
    cancelled); `agg` holds the aggregator's metrics (e.g. clip norm), stored as agg_<name>;
    `malicious`: how many of the step's updates came from simulated attackers (None: no attack).
    """

    KIND: ClassVar[str] = "server"

    step: int  # the server step this record ends (1 for the first)
    virtual_time_s: float
    trips: int
    updates: int
    loss: float  # mean local loss of the aggregated clients
    staleness: tuple[int, ...]  # of each aggregated update
    concurrency: int  # trips under way when the step's last update arrived
    bytes_down: int
    bytes_up: int
    dropped_out: int
    stale: int
    cancelled: int
    agg: dict[str, float] = field(default_factory=dict, metadata={PREFIX: "agg_"})
    malicious: int | None = None

    @property
    def staleness_mean(self) -> float:
        """Mean staleness of the step's updates (0 for a step without any)."""
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0


@dataclass(frozen=True)
class EpochRecord(Record):
    """DP-FTRL's once-per-epoch sampling began a new epoch (noise trees restart)."""

    KIND: ClassVar[str] = "epoch"

    epoch: int
    step: int  # server steps completed when the epoch began
    virtual_time_s: float


@dataclass(frozen=True)
class EvalRecord(Record):
    """A held-out cosine evaluation during training (`quick_eval`'s metrics).

    Federated runs add the client trips, virtual seconds and bytes so far, and epsilon/delta
    when DP is on; centralised runs leave those out.
    """

    KIND: ClassVar[str] = "eval"

    step: int
    eer: float  # a fraction, not percent
    eer_threshold: float
    min_dcf_01: float
    min_dcf_05: float
    n_target: int
    n_nontarget: int
    loss: float | None = None  # training loss of the last step (server step) before it
    trips: int | None = None
    virtual_time_s: float | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    epsilon: float | None = None
    delta: float | None = None
    # mean cosine between held-out speakers' un-centred prototypes (speaker_offset)
    offset: float | None = None
    # a backdoor's impostor-vs-target trials accepted at the EER threshold (a fraction)
    attack_success: float | None = None

    def verification(self) -> dict[str, float | int]:
        """The verification metrics alone, as the report's results table takes them."""
        return {
            "eer": self.eer,
            "eer_threshold": self.eer_threshold,
            "min_dcf_01": self.min_dcf_01,
            "min_dcf_05": self.min_dcf_05,
            "n_target": self.n_target,
            "n_nontarget": self.n_nontarget,
        }


@dataclass(frozen=True)
class TrainRecord(Record):
    """One centralised training step (logged every 10 steps)."""

    KIND: ClassVar[str] = "train"

    step: int
    loss: float
    lr: float
    margin: float
    frames: int  # chunk length of the step's batch


RunRecord = TripRecord | ServerStepRecord | EpochRecord | EvalRecord | TrainRecord
KINDS: dict[str, type[Record]] = {
    c.KIND: c for c in (TripRecord, ServerStepRecord, EpochRecord, EvalRecord, TrainRecord)
}


def encode_line(record: Record) -> str:
    """One log line: the record's JSON object with sorted keys, and a newline."""
    return json.dumps(record.to_json(), sort_keys=True) + "\n"


def append_run_log(path: Path, records: Iterable[Record]) -> None:
    """Append records as JSON lines, flushed and fsynced (a crash can tear only the last)."""
    text = "".join(encode_line(r) for r in records)
    if not text:
        return
    with open(path, "a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@overload
def read_run_log_lines(path: Path, kinds: None = None) -> list[tuple[int, RunRecord]]: ...
@overload
def read_run_log_lines(path: Path, kinds: Iterable[type[R]]) -> list[tuple[int, R]]: ...
def read_run_log_lines(
    path: Path, kinds: Iterable[type[Record]] | None = None
) -> list[tuple[int, Record]]:
    """(line number, record) of each record of `kinds` (all kinds when None), in file order.

    An absent file has none; blank lines are skipped, and so is a last line that is not
    valid JSON and has no newline (an append torn by a crash). Any other bad line, a record
    with a missing or mistyped field, or a kind fedvox does not know raises DataError with
    the file and line. Lines of known kinds not asked for are skipped unparsed.
    """
    path = Path(path)
    if not path.is_file():
        return []
    wanted = {k.KIND for k in kinds} if kinds is not None else set(KINDS)
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    torn = not text.endswith("\n")
    out: list[tuple[int, Record]] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if torn and i == len(lines):
                continue
            raise DataError(
                path, "not a JSON line", "remove or repair the corrupted line", i
            ) from None
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind not in KINDS:
            raise DataError(
                path,
                f"not a run record (kind {kind!r}; fedvox writes {', '.join(KINDS)})",
                "remove the line, or read the log with the fedvox version that wrote it",
                i,
            )
        if kind not in wanted:
            continue
        try:
            out.append((i, KINDS[kind].from_json(obj)))
        except DataError as e:
            raise DataError(path, e.problem, e.fix, i) from None
    return out


@overload
def read_run_log(path: Path, kinds: None = None) -> list[RunRecord]: ...
@overload
def read_run_log(path: Path, kinds: Iterable[type[R]]) -> list[R]: ...
def read_run_log(path: Path, kinds: Iterable[type[Record]] | None = None) -> list[Record]:
    """The records of `kinds` (all when None) in a JSON-lines run log, typed; see
    `read_run_log_lines` for what is skipped and what is refused."""
    return [r for _, r in read_run_log_lines(path, kinds)]


# -- field typing ------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The evaluated type hints of a record class (cached)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _optional(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) and type(None) in hint.__args__


def _typed(value: Any, hint: Any, kind: str, name: str) -> Any:
    """`value` checked against the field's type (lists become tuples); DataError if not."""
    if _optional(hint):
        (hint,) = [a for a in hint.__args__ if a is not type(None)]
    origin = typing.get_origin(hint)
    ok: bool
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, list):
            return tuple(_typed(v, item, kind, name) for v in value)
        ok = False
    elif origin is dict:
        item = typing.get_args(hint)[1]
        if isinstance(value, dict):
            return {k: _typed(v, item, kind, f"{name}{k}") for k, v in value.items()}
        ok = False
    else:  # pragma: no cover - a record class declared a type this reader cannot check
        raise TypeError(f"{kind}.{name}: unsupported field type {hint!r}")
    if not ok:
        want = getattr(hint, "__name__", str(hint))
        raise DataError(
            None,
            f"{kind} record field '{name}' is not {want} (got {value!r})",
            "repair or remove the line",
        )
    return value
