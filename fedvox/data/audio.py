"""Audio file reading and writing: float32 mono samples in [-1, 1], checked at the door.

First stop of the data path (audio ──► features): every corpus loads its waveforms here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from fedvox.errors import DataError

# Kaldi's extract-segments tolerates segments that end up to 0.5 s past the recording
# (--max-overshoot=0.5) and truncates them; real Kaldi segments files rely on it.
MAX_SEGMENT_OVERSHOOT_S = 0.5

# Containers libsndfile cannot decode; VoxCeleb2 ships .m4a.
_COMPRESSED_SUFFIXES = {".m4a", ".aac", ".mp4", ".wma", ".opus", ".webm"}

# soundfile reads a ".raw" name as headerless PCM and then wants the sample rate, channels
# and sample format from the caller (a TypeError); fedvox lists carry none of them.
_HEADERLESS_SUFFIXES = {".raw"}
# What soundfile raises on a file it cannot open or decode.
_OPEN_ERRORS = (sf.SoundFileError, RuntimeError, OSError, TypeError)

_REENCODE_FIX = (
    "convert it to 16 kHz mono wav, e.g. `ffmpeg -i {name} -ar 16000 -ac 1 out.wav`, "
    "or remove it from the list"
)


def split_where(where: str | None) -> tuple[str | None, int | None]:
    """Split a "file:line" location into (file, line); a bare file gives (file, None)."""
    if not where:
        return None, None
    head, sep, tail = where.rpartition(":")
    if sep and tail.isdigit() and head:
        return head, int(tail)
    return where, None


def _error(path: Path, where: str | None, problem: str, fix: str) -> DataError:
    """A DataError located at `where` (the list line that declared the file) or else the file."""
    file, line = split_where(where)
    if file is None:
        return DataError(path, problem, fix)
    return DataError(file, f"audio file '{path}': {problem}", fix, line=line)


def _open_problem(path: Path, where: str | None, exc: Exception) -> DataError:
    """Turn a soundfile open failure into an actionable DataError."""
    if not path.exists():
        return _error(
            path,
            where,
            "file does not exist",
            "check the path (relative paths are resolved against the folder of the list "
            "that names them), or regenerate the list",
        )
    if path.is_dir():
        return _error(path, where, "is a directory, not an audio file", "list audio files only")
    if path.suffix.lower() in _COMPRESSED_SUFFIXES:
        return _error(
            path,
            where,
            f"'{path.suffix}' audio cannot be read (soundfile/libsndfile has no AAC decoder)",
            _REENCODE_FIX.format(name=path.name),
        )
    if path.suffix.lower() in _HEADERLESS_SUFFIXES:
        return _error(
            path,
            where,
            f"'{path.suffix}' is headerless audio: the file does not say its sample rate, "
            "channels or sample format",
            "convert it to a wav with a header, e.g. `sox -t raw -r 16000 -e signed -b 16 "
            f"-c 1 {path.name} out.wav`, or remove it from the list",
        )
    reason = str(exc).rsplit(":", 1)[-1].strip().rstrip(".") or type(exc).__name__
    return _error(
        path,
        where,
        f"unreadable or corrupt audio ({reason})",
        _REENCODE_FIX.format(name=path.name),
    )


def audio_info(path: Path, where: str | None = None) -> tuple[int, int, int]:
    """Return (sample_rate, channels, frames) from the file header, or raise DataError."""
    path = Path(path)
    try:
        info = sf.info(str(path))
    except _OPEN_ERRORS as exc:
        raise _open_problem(path, where, exc) from None
    return int(info.samplerate), int(info.channels), int(info.frames)


def check_format(
    path: Path, sample_rate: int, channels: int, frames: int, expected_sample_rate: int, where
) -> None:
    """Raise DataError unless the header says non-empty mono audio at the expected rate."""
    if sample_rate != expected_sample_rate:
        raise _error(
            path,
            where,
            f"sample rate is {sample_rate} Hz, expected {expected_sample_rate} Hz",
            f"resample it, e.g. `sox {path.name} -r {expected_sample_rate} out.wav`",
        )
    if channels != 1:
        raise _error(
            path,
            where,
            f"has {channels} channels, expected mono",
            f"mix down with `sox {path.name} -c 1 out.wav` or pick a channel with "
            f"`sox {path.name} out.wav remix 1`",
        )
    if frames <= 0:
        raise _error(
            path,
            where,
            "contains no audio (0 samples)",
            "re-create the file or drop it from the list",
        )


def segment_frames(
    path: Path,
    sample_rate: int,
    frames: int,
    start: float | None,
    end: float | None,
    where: str | None,
) -> tuple[int, int]:
    """Frame range [first, last) of a segment given in seconds; DataError if out of range."""
    duration = frames / sample_rate
    t0 = 0.0 if start is None else float(start)
    t1 = duration if end is None else float(end)
    fix = "correct the segment times (seconds from the start of the recording)"
    if not (np.isfinite(t0) and np.isfinite(t1)) or t0 < 0:
        raise _error(path, where, f"segment {t0}-{t1} s has an invalid start", fix)
    if t0 >= duration:
        raise _error(
            path,
            where,
            f"segment starts at {t0} s, past the end of the audio ({duration:.3f} s)",
            fix,
        )
    if t1 > duration + MAX_SEGMENT_OVERSHOOT_S:
        raise _error(
            path,
            where,
            f"segment ends at {t1} s, past the end of the audio ({duration:.3f} s)",
            fix,
        )
    first = round(t0 * sample_rate)
    last = min(frames, round(t1 * sample_rate))
    if last <= first:
        raise _error(path, where, f"segment {t0}-{t1} s is empty", fix)
    return first, last


def read_audio(
    path: Path,
    expected_sample_rate: int = 16000,
    start: float | None = None,
    end: float | None = None,
    where: str | None = None,
) -> np.ndarray:
    """Read mono float32 samples in [-1, 1], optionally only [start, end) seconds.

    `where` ("data/wav.scp:12") names the list line that declared the file, for errors.
    """
    path = Path(path)
    try:
        handle = sf.SoundFile(str(path))
    except _OPEN_ERRORS as exc:
        raise _open_problem(path, where, exc) from None
    with handle:
        sample_rate, channels, frames = handle.samplerate, handle.channels, handle.frames
        check_format(path, sample_rate, channels, frames, expected_sample_rate, where)
        first, last = 0, frames
        if start is not None or end is not None:
            first, last = segment_frames(path, sample_rate, frames, start, end, where)
        try:
            handle.seek(first)
            data = handle.read(last - first, dtype="float32", always_2d=True)
        except _OPEN_ERRORS as exc:
            raise _open_problem(path, where, exc) from None
    if data.shape[0] == 0:
        raise _error(
            path,
            where,
            "contains no audio (0 samples)",
            "re-create the file or drop it from the list",
        )
    samples = np.ascontiguousarray(data[:, 0])
    if not np.isfinite(samples).all():  # float wavs can hold NaN/inf; features would be NaN
        bad = int(np.flatnonzero(~np.isfinite(samples))[0]) + first
        raise _error(
            path,
            where,
            f"holds NaN or infinite samples (first at sample {bad}, {bad / sample_rate:.3f} s)",
            "re-create the file (a float wav must hold finite samples) or drop it from the list",
        )
    return samples


def write_audio(path: Path, samples: np.ndarray, sample_rate: int = 16000) -> None:
    """Write samples as a 16-bit PCM wav, atomically (temp file in the same dir, then rename)."""
    path = Path(path)
    data = np.asarray(samples, dtype=np.float32)
    if data.ndim not in (1, 2):
        raise ValueError(f"samples must be 1-D (mono) or 2-D (frames, channels), got {data.shape}")
    if not np.all(np.isfinite(data)):
        raise ValueError(f"samples for {path} contain NaN or infinity")
    # libsndfile wraps around on overflow when converting float to int16; clip instead.
    data = np.clip(data, -1.0, 1.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        sf.write(tmp, data, sample_rate, subtype="PCM_16", format="WAV")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
