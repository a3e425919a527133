"""Real speech corpora (Kaldi data dirs, VoxCeleb, LibriSpeech, WeSpeaker raw.list) as one type.

Data path: corpus ──► audio ──► features; trial lists and client partitions name its utt ids.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedvox.data.audio import (
    audio_info,
    check_format,
    read_audio,
    segment_frames,
    split_where,
)
from fedvox.errors import DataError

_AUDIO_SUFFIXES = (".wav", ".flac")
_LAYOUTS = (
    "a Kaldi data dir (wav.scp, utt2spk), a WeSpeaker raw.list file (JSON lines with "
    "key/spk/wav), a VoxCeleb tree (wav/<speaker>/<video>/<n>.wav), or a LibriSpeech "
    "subset (<speaker>/<chapter>/<speaker>-<chapter>-<n>.flac)"
)
# Suffixes of up to this many path components are indexed for `Corpus.resolve`; longer
# tokens are looked up by their last components and then checked in full.
_SUFFIX_DEPTH = 3


@dataclass(frozen=True)
class Utterance:
    """One utterance: an audio file, or a [start, end) second range of one."""

    utt_id: str
    speaker: str
    path: Path  # absolute path of the audio file
    start: float | None = None  # seconds (from Kaldi `segments`)
    end: float | None = None
    where: str = ""  # "file:line" that declared it, for error messages


def _abspath(base: Path, text: str) -> Path:
    """Absolute path of `text` against `base`; symlinks are kept so path suffixes still match."""
    return Path(os.path.abspath(base / os.path.expanduser(text)))


def _strip_ext(key: str) -> str:
    """Drop the extension of the last path component ("a/b.wav" -> "a/b")."""
    head, sep, last = key.rpartition("/")
    stem = last.rsplit(".", 1)[0] if "." in last.lstrip(".") else last
    return head + sep + stem


@dataclass
class Corpus:
    """Utterances sorted by id, with their speakers; lookups by id and by path suffix."""

    name: str
    root: Path
    utterances: list[Utterance]  # sorted by utt_id
    sample_rate: int = 16000
    _by_id: dict[str, Utterance] = field(init=False, repr=False, compare=False)
    _suffixes: dict[str, int | list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.utterances = sorted(self.utterances, key=lambda u: u.utt_id)
        self._by_id = {}
        for utt in self.utterances:
            prev = self._by_id.get(utt.utt_id)
            if prev is not None:
                file, line = split_where(utt.where or None)
                raise DataError(
                    file or self.name,
                    f"duplicate utterance id '{utt.utt_id}' (also at {prev.where or self.name})",
                    "give every utterance a unique id",
                    line=line,
                )
            self._by_id[utt.utt_id] = utt

    def __len__(self) -> int:
        return len(self.utterances)

    def __getitem__(self, utt_id: str) -> Utterance:
        return self._by_id[utt_id]

    def __contains__(self, utt_id: object) -> bool:
        return utt_id in self._by_id

    def utt_ids(self) -> list[str]:
        return [u.utt_id for u in self.utterances]

    def speakers(self) -> list[str]:
        return sorted({u.speaker for u in self.utterances})

    def speaker_of(self, utt_id: str) -> str:
        return self._by_id[utt_id].speaker

    def spk2utt(self) -> dict[str, list[str]]:
        """Speaker -> its utt ids; both levels sorted."""
        out: dict[str, list[str]] = {}
        for utt in self.utterances:  # already sorted by id
            out.setdefault(utt.speaker, []).append(utt.utt_id)
        return {spk: out[spk] for spk in sorted(out)}

    def subset(
        self, utt_ids: Iterable[str] | None = None, speakers: Iterable[str] | None = None
    ) -> Corpus:
        """The utterances in `utt_ids` (if given) whose speaker is in `speakers` (if given)."""
        keep = self.utterances
        if utt_ids is not None:
            wanted = set(utt_ids)
            missing = sorted(wanted - self._by_id.keys())
            if missing:
                raise DataError(
                    self.name,
                    f"{len(missing)} requested utterance(s) are not in the corpus, "
                    f"e.g. '{missing[0]}'",
                    "pick utterance ids from this corpus",
                )
            keep = [u for u in keep if u.utt_id in wanted]
        if speakers is not None:
            wanted_spk = set(speakers)
            missing = sorted(wanted_spk - set(self.speakers()))
            if missing:
                raise DataError(
                    self.name,
                    f"{len(missing)} requested speaker(s) are not in the corpus, "
                    f"e.g. '{missing[0]}'",
                    "pick speakers from this corpus",
                )
            keep = [u for u in keep if u.speaker in wanted_spk]
        return Corpus(self.name, self.root, list(keep), self.sample_rate)

    def source_of(self, utt_id: str) -> str | None:
        """What names an utterance's samples without reading them (file, size, mtime in ns,
        segment, rate), for the feature store's source index; None if the file is missing."""
        utt = self._by_id[utt_id]
        try:
            st = utt.path.stat()
        except OSError:
            return None
        return f"{utt.path}|{st.st_size}|{st.st_mtime_ns}|{utt.start}|{utt.end}|{self.sample_rate}"

    def load(self, utt_id: str) -> np.ndarray:
        """Samples of one utterance (its segment, if it is one), float32 mono."""
        utt = self._by_id[utt_id]
        return read_audio(utt.path, self.sample_rate, utt.start, utt.end, where=utt.where or None)

    def validate(self, check_audio: bool = True) -> None:
        """Raise DataError on the first problem; with check_audio, read every file's header."""
        if not self.utterances:
            raise DataError(self.name, "corpus has no utterances", f"point fedvox at {_LAYOUTS}")
        if not check_audio:
            return
        headers: dict[Path, tuple[int, int, int]] = {}
        for utt in self.utterances:
            where = utt.where or None
            header = headers.get(utt.path)
            if header is None:
                header = audio_info(utt.path, where=where)
                check_format(utt.path, *header, self.sample_rate, where)
                headers[utt.path] = header
            if utt.start is not None or utt.end is not None:
                segment_frames(utt.path, header[0], header[2], utt.start, utt.end, where)

    def resolve(self, token: str, where: str = "") -> str:
        """Map a trial-list token to an utt id: the id itself, or a unique path suffix.

        Path suffixes match whole components, with or without the extension, so the
        VoxCeleb token "id10270/x6uYqmx31kE/00001.wav" finds ".../id10270/x6uYqmx31kE/00001.wav".
        """
        if token in self._by_id:
            return token
        norm = token.replace("\\", "/")
        while norm.startswith("./"):
            norm = norm[2:]
        parts = [p for p in norm.split("/") if p not in ("", ".")]
        matches: list[int] = []
        if parts:
            index = self._suffix_index()
            matches = self._match(index, parts)
            if not matches:
                stripped = [*parts[:-1], _strip_ext(parts[-1])]
                if stripped != parts:
                    matches = self._match(index, stripped)
        file, line = split_where(where or None)
        file = file or self.name
        if len(matches) == 1:
            return self.utterances[matches[0]].utt_id
        if not matches:
            raise DataError(
                file,
                f"utterance '{token}' is not in corpus {self.name} ({len(self)} utterances)",
                "check the trial list belongs to this data dir, or regenerate it",
                line=line,
            )
        names = ", ".join(f"'{self.utterances[i].utt_id}'" for i in matches[:3])
        raise DataError(
            file,
            f"'{token}' is ambiguous in corpus {self.name}: it matches {len(matches)} "
            f"utterances ({names}{', ...' if len(matches) > 3 else ''})",
            "name utterances by their utt id, or by a longer path",
            line=line,
        )

    def _match(self, index: dict[str, int | list[int]], parts: list[str]) -> list[int]:
        """Utterance positions whose path ends with `parts` (last component with or w/o ext)."""
        key = "/".join(parts[-_SUFFIX_DEPTH:])
        hit = index.get(key)
        if hit is None:
            return []
        found = [hit] if isinstance(hit, int) else hit
        if len(parts) <= _SUFFIX_DEPTH:
            return list(found)
        out = []
        for i in found:
            path_parts = list(self.utterances[i].path.parts)
            tail = path_parts[-len(parts) :]
            if len(tail) == len(parts) and tail[:-1] == parts[:-1]:
                if tail[-1] == parts[-1] or _strip_ext(tail[-1]) == parts[-1]:
                    out.append(i)
        return out

    def _suffix_index(self) -> dict[str, int | list[int]]:
        """Path suffix (1.._SUFFIX_DEPTH components, with and without extension) -> positions.

        Built once on first use; an int for a unique suffix keeps it small on big corpora.
        """
        if self._suffixes is not None:
            return self._suffixes
        index: dict[str, int | list[int]] = {}

        def add(key: str, i: int) -> None:
            hit = index.get(key)
            if hit is None:
                index[key] = i
            elif isinstance(hit, int):
                if hit != i:
                    index[key] = [hit, i]
            elif hit[-1] != i:
                hit.append(i)

        for i, utt in enumerate(self.utterances):
            parts = utt.path.parts
            for depth in range(1, min(_SUFFIX_DEPTH, len(parts)) + 1):
                key = "/".join(parts[-depth:])
                add(key, i)
                add(_strip_ext(key), i)
        self._suffixes = index
        return index


# ---------------------------------------------------------------- Kaldi data dirs


def read_text(path: Path, what: str = "file") -> str:
    """A UTF-8 text file (a leading byte-order mark dropped), or DataError naming the line
    of the first byte that is not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(path, f"{what} does not exist", "check the path") from None
    except OSError as exc:
        raise DataError(path, f"cannot be read ({exc.strerror})", "check the file") from None
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(
            path, f"{what} is not UTF-8 text", "save it as UTF-8 text", line=line
        ) from None


def numbered_lines(text: str) -> list[tuple[int, str]]:
    r"""(line number, line) as an editor counts them: lines end at '\n' only.

    str.splitlines() also breaks at \v, \f, \x1c-\x1e, \x85 and \u2028, which would
    shift the line numbers of every error after one of them.
    """
    return list(enumerate(text.split("\n"), start=1))


def _read_lines(path: Path) -> list[tuple[int, list[str], str]]:
    """Non-blank lines of a text file as (line number, fields, text)."""
    out = []
    for number, raw in numbered_lines(read_text(path)):
        stripped = raw.strip()
        if stripped:
            out.append((number, stripped.split(), stripped))
    return out


def _require(path: Path, what: str) -> None:
    if not path.is_file():
        raise DataError(
            path,
            f"missing required file ({what})",
            "create it; a Kaldi data dir needs wav.scp and utt2spk (see `utils/fix_data_dir.sh`)",
        )


def _check_fields(path: Path, number: int, fields: list[str], expected: str, count: int) -> None:
    if len(fields) != count:
        raise DataError(
            path,
            f"expected {count} fields '{expected}', got {len(fields)}",
            f"write one '{expected}' per line, separated by spaces",
            line=number,
        )


def _read_wav_scp(data_dir: Path, path: Path) -> dict[str, tuple[Path, str]]:
    """wav.scp -> {key: (absolute audio path, "file:line")}."""
    out: dict[str, tuple[Path, str]] = {}
    for number, fields, text in _read_lines(path):
        if text.endswith("|"):
            raise DataError(
                path,
                f"entry '{fields[0]}' is a piped command, which fedvox does not run",
                "write the audio to wav files and list their paths "
                "(run the command once with its output redirected to a .wav file)",
                line=number,
            )
        _check_fields(path, number, fields, "recording-id path", 2)
        key, audio = fields
        if re.search(r"\.ark:\d+$", audio):
            raise DataError(
                path,
                f"entry '{key}' points into a Kaldi archive ({audio})",
                "write the audio to wav files and list their paths",
                line=number,
            )
        if key in out:
            raise DataError(
                path,
                f"duplicate key '{key}' (first at {out[key][1]})",
                "give every line a unique key (`sort -u` or `utils/fix_data_dir.sh`)",
                line=number,
            )
        out[key] = (_abspath(data_dir, audio), f"{path}:{number}")
    return out


def _read_utt2spk(path: Path) -> dict[str, tuple[str, int]]:
    """utt2spk -> {utt: (speaker, line)}."""
    out: dict[str, tuple[str, int]] = {}
    for number, fields, _ in _read_lines(path):
        _check_fields(path, number, fields, "utt-id speaker-id", 2)
        utt, spk = fields
        if utt in out:
            raise DataError(
                path,
                f"duplicate key '{utt}' (first at line {out[utt][1]})",
                "list each utterance once",
                line=number,
            )
        out[utt] = (spk, number)
    return out


def _check_spk2utt(path: Path, utt2spk: dict[str, tuple[str, int]], utt2spk_path: Path) -> None:
    """spk2utt, when present, must say exactly what utt2spk says."""
    seen: dict[str, int] = {}
    speakers: set[str] = set()
    fix = "regenerate it with `utils/utt2spk_to_spk2utt.pl utt2spk > spk2utt`, or delete it"
    for number, fields, _ in _read_lines(path):
        if len(fields) < 2:
            raise DataError(
                path,
                f"expected 'speaker-id utt-id ...', got {len(fields)} field(s)",
                fix,
                line=number,
            )
        spk, *utts = fields
        if spk in speakers:
            raise DataError(path, f"duplicate speaker '{spk}'", fix, line=number)
        speakers.add(spk)
        for utt in utts:
            if utt in seen:
                raise DataError(
                    path,
                    f"utterance '{utt}' listed twice (also at line {seen[utt]})",
                    fix,
                    line=number,
                )
            seen[utt] = number
            if utt not in utt2spk:
                raise DataError(
                    path, f"utterance '{utt}' is not in {utt2spk_path.name}", fix, line=number
                )
            if utt2spk[utt][0] != spk:
                raise DataError(
                    path,
                    f"utterance '{utt}' is under speaker '{spk}' but "
                    f"{utt2spk_path.name}:{utt2spk[utt][1]} says '{utt2spk[utt][0]}'",
                    fix,
                    line=number,
                )
    for utt, (_, number) in utt2spk.items():
        if utt not in seen:
            raise DataError(
                utt2spk_path,
                f"utterance '{utt}' is missing from {path.name}",
                fix,
                line=number,
            )


def _parse_time(path: Path, number: int, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value):
        raise DataError(
            path,
            f"{what} time '{text}' is not a number",
            "write 'segment-id recording-id start end' with times in seconds",
            line=number,
        )
    return value


# utt id -> (audio path, start, end, "file:line" that declared it)
_AudioMap = dict[str, tuple[Path, float | None, float | None, str]]


def _read_segments(
    segments: Path, recordings: dict[str, tuple[Path, str]], wav_scp: Path
) -> _AudioMap:
    """Kaldi `segments`: each segment a [start, end) range of a wav.scp recording (end -1 =
    to the recording's end)."""
    audio: _AudioMap = {}
    fix = "write 'segment-id recording-id start end' with times in seconds"
    for number, fields, _ in _read_lines(segments):
        _check_fields(segments, number, fields, "segment-id recording-id start end", 4)
        seg, rec, t0, t1 = fields
        start = _parse_time(segments, number, t0, "start")
        end = _parse_time(segments, number, t1, "end")
        if seg in audio:
            raise DataError(
                segments,
                f"duplicate key '{seg}' (first at {audio[seg][3]})",
                "give every segment a unique id",
                line=number,
            )
        if rec not in recordings:
            raise DataError(
                segments,
                f"recording '{rec}' of segment '{seg}' is not in {wav_scp.name}",
                f"add the recording to {wav_scp.name} or drop the segment",
                line=number,
            )
        if start < 0:
            raise DataError(segments, f"segment '{seg}' starts before 0 s", fix, line=number)
        if end == -1:  # Kaldi: -1 means "to the end of the recording"
            end_or_none: float | None = None
        elif end <= start:
            raise DataError(
                segments,
                f"segment '{seg}' ends ({end}) at or before its start ({start})",
                fix,
                line=number,
            )
        else:
            end_or_none = end
        audio[seg] = (recordings[rec][0], start, end_or_none, f"{segments}:{number}")
    return audio


def _join_speakers(
    audio: _AudioMap, source: Path, utt2spk: dict[str, tuple[str, int]], utt2spk_path: Path
) -> list[Utterance]:
    """Utterances with both audio (from `source`) and a speaker; one without either is an
    error naming the file and line that declared it."""
    for utt, (_, number) in utt2spk.items():
        if utt not in audio:
            raise DataError(
                utt2spk_path,
                f"utterance '{utt}' has no audio in {source.name}",
                f"add it to {source.name} or remove it from utt2spk "
                "(`utils/fix_data_dir.sh` does this)",
                line=number,
            )
    utterances = []
    for utt, (audio_path, start, end, where) in audio.items():
        if utt not in utt2spk:
            file, line = split_where(where)
            raise DataError(
                file,
                f"utterance '{utt}' has no speaker in utt2spk",
                "add it to utt2spk or remove it (`utils/fix_data_dir.sh` does this)",
                line=line,
            )
        utterances.append(Utterance(utt, utt2spk[utt][0], audio_path, start, end, where))
    return utterances


def load_kaldi_dir(path: Path, sample_rate: int = 16000) -> Corpus:
    """Load a Kaldi data dir (wav.scp, utt2spk, optional spk2utt and segments).

    Relative audio paths are resolved against the data dir. Audio is not opened here;
    `Corpus.validate()` does that.
    """
    data_dir = Path(path)
    if not data_dir.is_dir():
        raise DataError(data_dir, "is not a directory", f"point fedvox at {_LAYOUTS}")
    wav_scp, utt2spk_path = data_dir / "wav.scp", data_dir / "utt2spk"
    _require(wav_scp, "utterance/recording -> audio path")
    _require(utt2spk_path, "utterance -> speaker")
    recordings = _read_wav_scp(data_dir, wav_scp)
    utt2spk = _read_utt2spk(utt2spk_path)
    if (data_dir / "spk2utt").is_file():
        _check_spk2utt(data_dir / "spk2utt", utt2spk, utt2spk_path)
    segments = data_dir / "segments"
    if segments.is_file():
        audio, source = _read_segments(segments, recordings, wav_scp), segments
    else:
        audio = {k: (p, None, None, where) for k, (p, where) in recordings.items()}
        source = wav_scp
    utterances = _join_speakers(audio, source, utt2spk, utt2spk_path)
    if not utterances:
        raise DataError(wav_scp, "lists no audio", "add 'utt-id path' lines")
    return Corpus(str(data_dir), Path(os.path.abspath(data_dir)), utterances, sample_rate)


def _write_text_atomic(path: Path, lines: Iterable[str]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _no_space(value: str, what: str, utt: Utterance) -> str:
    if not value or any(c.isspace() for c in value):
        file, line = split_where(utt.where or None)
        raise DataError(
            file,
            f"{what} '{value}' is empty or contains whitespace, which Kaldi files cannot hold",
            "rename it without spaces",
            line=line,
        )
    return value


def write_kaldi_dir(corpus: Corpus, out_dir: Path) -> None:
    """Write wav.scp, utt2spk, spk2utt (and segments if any) with absolute audio paths.

    A stale `segments` from an earlier write is removed so the dir stays consistent.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for utt in corpus.utterances:
        _no_space(utt.utt_id, "utterance id", utt)
        _no_space(utt.speaker, "speaker id", utt)
        _no_space(str(utt.path), "audio path", utt)
    segmented = any(u.start is not None or u.end is not None for u in corpus.utterances)
    utt2spk = [f"{u.utt_id} {u.speaker}" for u in corpus.utterances]
    spk2utt = [f"{spk} {' '.join(utts)}" for spk, utts in corpus.spk2utt().items()]
    if segmented:
        # Recording ids: path relative to the root (or the name), made unique and space-free.
        rec_of: dict[Path, str] = {}
        used: set[str] = set()
        for p in sorted({u.path for u in corpus.utterances}):
            try:
                base = _strip_ext(p.relative_to(corpus.root).as_posix()).replace("/", "-")
            except ValueError:
                base = p.stem
            rec, n = base, 1
            while rec in used:
                n += 1
                rec = f"{base}-{n}"
            used.add(rec)
            rec_of[p] = rec
        wav_lines = [f"{rec} {p}" for p, rec in sorted(rec_of.items(), key=lambda kv: kv[1])]
        seg_lines = [
            f"{u.utt_id} {rec_of[u.path]} {0.0 if u.start is None else u.start} "
            f"{-1 if u.end is None else u.end}"
            for u in corpus.utterances
        ]
    else:
        wav_lines = [f"{u.utt_id} {u.path}" for u in corpus.utterances]
    _write_text_atomic(out_dir / "wav.scp", wav_lines)
    _write_text_atomic(out_dir / "utt2spk", utt2spk)
    _write_text_atomic(out_dir / "spk2utt", spk2utt)
    if segmented:
        _write_text_atomic(out_dir / "segments", seg_lines)
    else:
        (out_dir / "segments").unlink(missing_ok=True)


# ---------------------------------------------------------------- directory corpora


def _subdirs(path: Path) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return sorted(
            (e for e in it if e.is_dir() and not e.name.startswith(".")), key=lambda e: e.name
        )


def _files(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return sorted(
            (e for e in it if e.is_file() and not e.name.startswith(".")), key=lambda e: e.name
        )


def _voxceleb_wav_dir(root: Path) -> Path:
    for name in ("wav", "aac"):  # VoxCeleb2 dev/test unpack to aac/
        if (root / name).is_dir():
            return root / name
    return root


def load_voxceleb(root: Path, sample_rate: int = 16000) -> Corpus:
    """Load VoxCeleb1/2 as root/wav/<speaker>/<video>/<n>.wav (root may be the wav/ dir).

    Utt ids are "<speaker>/<video>/<n>.wav", exactly as the official trial lists name them.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(root, "is not a directory", "point fedvox at the VoxCeleb root or wav/")
    wav_dir = _voxceleb_wav_dir(root)
    where_base = Path(os.path.abspath(wav_dir))
    utterances = []
    for spk in _subdirs(wav_dir):
        for video in _subdirs(Path(spk.path)):
            for entry in _files(video.path):
                suffix = os.path.splitext(entry.name)[1].lower()
                rel = f"{spk.name}/{video.name}/{entry.name}"
                if suffix == ".m4a":
                    raise DataError(
                        Path(entry.path),
                        "VoxCeleb2 .m4a (AAC) audio cannot be read by soundfile",
                        "convert the tree to 16 kHz mono wav, e.g. for each file "
                        "`ffmpeg -i x.m4a -ar 16000 -ac 1 x.wav`, and point fedvox at the wav tree",
                    )
                if suffix in _AUDIO_SUFFIXES:
                    utterances.append(
                        Utterance(rel, spk.name, where_base / rel, where=str(wav_dir / rel))
                    )
    if not utterances:
        raise DataError(
            wav_dir,
            "no audio found in the VoxCeleb layout wav/<speaker>/<video>/<n>.wav",
            "point fedvox at the VoxCeleb root (the folder holding wav/) or at wav/ itself",
        )
    return Corpus(str(root), where_base, utterances, sample_rate)


def load_librispeech(root: Path, sample_rate: int = 16000) -> Corpus:
    """Load a LibriSpeech subset: root/<speaker>/<chapter>/<speaker>-<chapter>-<n>.flac."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(root, "is not a directory", "point fedvox at e.g. LibriSpeech/dev-clean")
    base = Path(os.path.abspath(root))
    utterances = []
    for spk in _subdirs(root):
        for chapter in _subdirs(Path(spk.path)):
            for entry in _files(chapter.path):
                stem, suffix = os.path.splitext(entry.name)
                if suffix.lower() not in _AUDIO_SUFFIXES:
                    continue  # transcripts (*.trans.txt) live next to the audio
                parts = stem.split("-")
                if len(parts) != 3 or parts[0] != spk.name or parts[1] != chapter.name:
                    raise DataError(
                        Path(entry.path),
                        f"file name disagrees with its folders {spk.name}/{chapter.name}/ "
                        f"(expected '{spk.name}-{chapter.name}-<n>{suffix}')",
                        "move or rename the file, or use a Kaldi data dir / raw.list instead",
                    )
                rel = f"{spk.name}/{chapter.name}/{entry.name}"
                utterances.append(Utterance(stem, spk.name, base / rel, where=str(root / rel)))
    if not utterances:
        raise DataError(
            root,
            "no audio found in the LibriSpeech layout <speaker>/<chapter>/<spk>-<chap>-<n>.flac",
            "point fedvox at a subset folder such as LibriSpeech/train-clean-100",
        )
    return Corpus(str(root), base, utterances, sample_rate)


# ---------------------------------------------------------------- WeSpeaker raw.list


class _DuplicateField(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _unique_fields(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose fields are unique: json.loads keeps the last of two silently."""
    obj: dict[str, object] = {}
    for name, value in pairs:
        if name in obj:
            raise _DuplicateField(name)
        obj[name] = value
    return obj


def load_raw_list(path: Path, sample_rate: int = 16000) -> Corpus:
    """Load a WeSpeaker raw.list: JSON lines {"key", "spk", "wav"}; relative wavs vs its dir."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file does not exist", "check the path to the raw.list")
    base = Path(os.path.abspath(path.parent))
    seen: dict[str, int] = {}
    utterances = []
    fix = 'write one JSON object per line: {"key": "utt", "spk": "speaker", "wav": "path.wav"}'
    for number, _, text in _read_lines(path):
        try:
            obj = json.loads(text, object_pairs_hook=_unique_fields)
        except _DuplicateField as dup:
            raise DataError(
                path, f"field '{dup.name}' appears twice in one object", fix, line=number
            ) from None
        except json.JSONDecodeError as exc:
            raise DataError(path, f"invalid JSON ({exc.msg})", fix, line=number) from None
        except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
            problem = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise DataError(path, f"invalid JSON ({problem})", fix, line=number) from None
        if not isinstance(obj, dict):
            raise DataError(path, "line is not a JSON object", fix, line=number)
        for name in ("key", "spk", "wav"):
            value = obj.get(name)
            if not isinstance(value, str) or not value:
                problem = (
                    f"missing field '{name}'"
                    if value is None
                    else f"field '{name}' must be a non-empty string"
                )
                raise DataError(path, problem, fix, line=number)
        key = obj["key"]
        if key in seen:
            raise DataError(
                path,
                f"duplicate key '{key}' (first at line {seen[key]})",
                "give every utterance a unique key",
                line=number,
            )
        seen[key] = number
        utterances.append(
            Utterance(key, obj["spk"], _abspath(base, obj["wav"]), where=f"{path}:{number}")
        )
    if not utterances:
        raise DataError(path, "lists no utterances", fix)
    return Corpus(str(path), base, utterances, sample_rate)


# ---------------------------------------------------------------- auto-detection


def _first_match(pattern_root: Path, pattern: str) -> bool:
    return next(iter(pattern_root.glob(pattern)), None) is not None


def _looks_like_json_lines(path: Path) -> bool:
    try:
        with path.open("r", encoding="utf-8") as fh:
            for raw in fh:
                if raw.strip():
                    return raw.lstrip().startswith("{")
    except (OSError, UnicodeDecodeError):
        return False
    return False


def _looks_like_voxceleb(root: Path) -> bool:
    for base in (root / "wav", root / "aac", root):
        if not base.is_dir():
            continue
        for spk in base.glob("id*"):
            if spk.is_dir() and (_first_match(spk, "*/*.wav") or _first_match(spk, "*/*.m4a")):
                return True
    return False


def load_corpus(path: Path, sample_rate: int = 16000) -> Corpus:
    """Load any supported corpus, detecting its layout from what is on disk."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, "does not exist", f"point fedvox at {_LAYOUTS}")
    if path.is_file():
        if path.name == "wav.scp":
            return load_kaldi_dir(path.parent, sample_rate)
        if path.suffix in (".list", ".jsonl") or _looks_like_json_lines(path):
            return load_raw_list(path, sample_rate)
        raise DataError(
            path, "is a file but not a raw.list of JSON lines", f"point fedvox at {_LAYOUTS}"
        )
    if (path / "wav.scp").is_file():
        return load_kaldi_dir(path, sample_rate)
    if _looks_like_voxceleb(path):
        return load_voxceleb(path, sample_rate)
    if _first_match(path, "*/*/*.flac"):
        return load_librispeech(path, sample_rate)
    raise DataError(path, "is not a corpus layout fedvox recognises", f"point fedvox at {_LAYOUTS}")
