"""Typed run records: the JSON round trip of each kind and what the run-log reader refuses."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from fedvox.errors import DataError
from fedvox.records import (
    KINDS,
    EpochRecord,
    EvalRecord,
    Record,
    ServerStepRecord,
    TrainRecord,
    TripRecord,
    append_run_log,
    encode_line,
    read_run_log,
    read_run_log_lines,
)

TRIP = TripRecord(
    time=12.5,
    client=3,
    trip=1,
    trip_id=7,
    start_time=4.0,
    start_version=2,
    status="aggregated",
    bytes_down=400,
    bytes_up=300,
    staleness=1,
    loss=2.25,
    num_examples=16,
    server_step=4,
)
DROPPED = TripRecord(
    time=9.0,
    client=5,
    trip=0,
    trip_id=8,
    start_time=5.0,
    start_version=3,
    status="dropped_out",
    bytes_down=400,
    bytes_up=0,
)
SERVER = ServerStepRecord(
    step=4,
    virtual_time_s=12.5,
    trips=9,
    updates=2,
    loss=2.5,
    staleness=(1, 0),
    concurrency=4,
    bytes_down=4000,
    bytes_up=2700,
    dropped_out=1,
    stale=0,
    cancelled=0,
    agg={"clip_norm": 0.5, "fraction_clipped": 0.25},
)
EPOCH = EpochRecord(epoch=2, step=6, virtual_time_s=30.0)
EVAL_FED = EvalRecord(
    step=4,
    eer=0.25,
    eer_threshold=0.6,
    min_dcf_01=0.9,
    min_dcf_05=0.7,
    n_target=12,
    n_nontarget=60,
    loss=2.5,
    trips=9,
    virtual_time_s=12.5,
    bytes_up=2700,
    bytes_down=4000,
    epsilon=3.5,
    delta=1e-3,
)
EVAL_CEN = EvalRecord(
    step=3,
    eer=0.4,
    eer_threshold=0.1,
    min_dcf_01=1.0,
    min_dcf_05=0.95,
    n_target=12,
    n_nontarget=60,
    loss=4.0,
)
TRAIN = TrainRecord(step=10, loss=3.5, lr=0.01, margin=0.1, frames=200)
ALL = [TRIP, DROPPED, SERVER, EPOCH, EVAL_FED, EVAL_CEN, TRAIN]


@pytest.mark.parametrize("record", ALL, ids=lambda r: f"{r.KIND}")
def test_each_kind_round_trips_through_its_json(record: Record) -> None:
    obj = record.to_json()
    assert obj["kind"] == record.KIND
    back = type(record).from_json(json.loads(json.dumps(obj)))
    assert back == record
    assert back.to_json() == obj


def test_on_disk_keys_are_one_name_per_quantity() -> None:
    """The server step as metrics.jsonl holds it: step/virtual_time_s/trips, flat agg_ keys,
    nothing duplicated; a trip keeps its engine names; absent optionals are left out."""
    assert SERVER.to_json() == {
        "kind": "server",
        "step": 4,
        "virtual_time_s": 12.5,
        "trips": 9,
        "updates": 2,
        "loss": 2.5,
        "staleness": [1, 0],
        "concurrency": 4,
        "bytes_down": 4000,
        "bytes_up": 2700,
        "dropped_out": 1,
        "stale": 0,
        "cancelled": 0,
        "agg_clip_norm": 0.5,
        "agg_fraction_clipped": 0.25,
    }
    assert set(DROPPED.to_json()) == {
        "kind",
        "time",
        "client",
        "trip",
        "trip_id",
        "start_time",
        "start_version",
        "status",
        "bytes_down",
        "bytes_up",
    }
    assert set(EVAL_CEN.to_json()) == {"kind", "step", "loss", *EVAL_CEN.verification()}
    assert SERVER.staleness_mean == 0.5


def test_older_lines_with_duplicate_keys_still_read(tmp_path: Path) -> None:
    """A log written before the records carried server_step/time/trips_completed twice and a
    null eval loss: the extra keys are ignored, null is an absent optional."""
    old = {**SERVER.to_json(), "server_step": 4, "time": 12.5, "trips_completed": 9}
    path = tmp_path / "metrics.jsonl"
    ev = {**EVAL_CEN.to_json(), "loss": None}
    path.write_text(json.dumps(old) + "\n" + json.dumps(ev) + "\n")
    assert read_run_log(path) == [SERVER, replace(EVAL_CEN, loss=None)]


def test_append_then_read_gives_the_records_back_by_kind(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_run_log(path) == []  # an absent log has no records
    append_run_log(path, [TRAIN, EVAL_CEN])
    append_run_log(path, [])
    append_run_log(path, [SERVER, EPOCH, EVAL_FED])
    assert path.read_text() == "".join(
        encode_line(r) for r in [TRAIN, EVAL_CEN, SERVER, EPOCH, EVAL_FED]
    )
    assert read_run_log(path) == [TRAIN, EVAL_CEN, SERVER, EPOCH, EVAL_FED]
    assert read_run_log(path, (EvalRecord,)) == [EVAL_CEN, EVAL_FED]
    assert read_run_log(path, (ServerStepRecord, EpochRecord)) == [SERVER, EPOCH]
    assert read_run_log_lines(path, (EvalRecord,)) == [(2, EVAL_CEN), (5, EVAL_FED)]


def test_only_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append_run_log(path, [TRAIN, EVAL_CEN])
    with open(path, "a") as f:
        f.write(encode_line(EVAL_FED)[:25])  # a crash mid-append: no newline
    assert read_run_log(path) == [TRAIN, EVAL_CEN]
    # the same bytes followed by a newline were not torn by an append: corrupt
    path.write_text(encode_line(TRAIN) + encode_line(EVAL_FED)[:25] + "\n")
    with pytest.raises(DataError, match=r"metrics\.jsonl:2: not a JSON line\. Fix: remove"):
        read_run_log(path)


def test_corrupt_middle_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "trips.jsonl"
    path.write_text(encode_line(TRIP) + "\n" + '{"kind": "trip", "ti\n' + encode_line(DROPPED))
    with pytest.raises(DataError, match=r"trips\.jsonl:3: not a JSON line\. Fix: ") as e:
        read_run_log(path, (TripRecord,))
    assert e.value.line == 3 and e.value.file == str(path)


def test_missing_or_mistyped_field_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    no_eer = {k: v for k, v in EVAL_FED.to_json().items() if k != "eer"}
    path.write_text(encode_line(TRAIN) + json.dumps(no_eer) + "\n")
    with pytest.raises(DataError, match=r"metrics\.jsonl:2: eval record has no field 'eer'"):
        read_run_log(path)
    # a kind not asked for is skipped unparsed, so a reader of train records is unaffected
    assert read_run_log(path, (TrainRecord,)) == [TRAIN]
    path.write_text(json.dumps({**TRAIN.to_json(), "step": "10"}) + "\n")
    with pytest.raises(DataError, match=r":1: train record field 'step' is not int \(got '10'\)"):
        read_run_log(path)
    path.write_text(json.dumps({**SERVER.to_json(), "staleness": [1, 0.5]}) + "\n")
    with pytest.raises(DataError, match=r":1: server record field 'staleness' is not int"):
        read_run_log(path)
    path.write_text(json.dumps({**SERVER.to_json(), "agg_clip_norm": "big"}) + "\n")
    with pytest.raises(DataError, match=r":1: server record field 'agg_clip_norm' is not float"):
        read_run_log(path)
    path.write_text(json.dumps({**TRAIN.to_json(), "frames": True}) + "\n")
    with pytest.raises(DataError, match="'frames' is not int"):
        read_run_log(path)


def test_trip_constraints_are_checked_on_read(tmp_path: Path) -> None:
    path = tmp_path / "trips.jsonl"
    path.write_text(json.dumps({**DROPPED.to_json(), "status": "lost"}) + "\n")
    with pytest.raises(DataError, match=r":1: trip record has status 'lost'"):
        read_run_log(path)
    no_step = {k: v for k, v in TRIP.to_json().items() if k != "server_step"}
    path.write_text(json.dumps(no_step) + "\n")
    with pytest.raises(DataError, match=r":1: aggregated trip record has no field 'server_step'"):
        read_run_log(path)


def test_unknown_kinds_are_rejected_even_when_not_asked_for(tmp_path: Path) -> None:
    """Deliberate: a run log holds only fedvox's own kinds, so a line of another kind (a hand
    edit, another version's log) is refused rather than silently dropped."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(encode_line(EVAL_CEN) + '{"kind": "server_step", "step": 1}\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl:2: not a run record \(kind 'server_step'"):
        read_run_log(path, (EvalRecord,))
    path.write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(DataError, match=r":1: not a run record \(kind None"):
        read_run_log(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r":1: not a run record"):
        read_run_log(path)


def test_from_json_refuses_another_kind() -> None:
    with pytest.raises(DataError, match="'train' record is not a 'eval' record"):
        EvalRecord.from_json(TRAIN.to_json())


def test_non_finite_numbers_survive_the_log(tmp_path: Path) -> None:
    """A diverged federated step logs loss NaN; the log keeps it rather than refusing it."""
    path = tmp_path / "metrics.jsonl"
    append_run_log(path, [replace(SERVER, loss=math.nan)])
    (back,) = read_run_log(path, (ServerStepRecord,))
    assert math.isnan(back.loss)


def test_every_kind_is_registered_once() -> None:
    assert set(KINDS) == {"trip", "server", "epoch", "eval", "train"}
    assert all(cls.KIND == kind for kind, cls in KINDS.items())
