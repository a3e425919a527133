"""Tests for audio reading and the real-corpus loaders (Kaldi, VoxCeleb, LibriSpeech, raw.list).

Fixtures are tiny wav/flac files written into tmp_path; every bad-input case checks the message.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from fedvox.data.audio import audio_info, read_audio, write_audio
from fedvox.data.corpus import (
    Corpus,
    Utterance,
    load_corpus,
    load_kaldi_dir,
    load_librispeech,
    load_raw_list,
    load_voxceleb,
    write_kaldi_dir,
)
from fedvox.errors import DataError

SR = 16000


def signal(n: int = 3200, channels: int = 1, seed: int = 0) -> np.ndarray:
    """Deterministic noise in [-0.5, 0.5], exactly representable-ish as 16-bit PCM."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-0.5, 0.5, size=(n, channels)).astype(np.float32)
    return x[:, 0] if channels == 1 else x


def wav(path: Path, n: int = 3200, sr: int = SR, channels: int = 1, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, signal(n, channels, seed), sr, subtype="PCM_16")
    return path


def kaldi_dir(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def good_kaldi(tmp_path: Path) -> Path:
    wav(tmp_path / "data" / "audio" / "a1.wav", seed=1)
    wav(tmp_path / "elsewhere" / "b1.wav", seed=2)
    wav(tmp_path / "data" / "audio" / "a2.wav", seed=3)
    return kaldi_dir(
        tmp_path,
        **{
            "wav.scp": f"spkA-1 audio/a1.wav\nspkB-1 {tmp_path / 'elsewhere' / 'b1.wav'}\n"
            "spkA-2 audio/a2.wav\n",
            "utt2spk": "spkA-1 spkA\nspkB-1 spkB\nspkA-2 spkA\n",
        },
    )


def located(exc: pytest.ExceptionInfo, file: str, line: int | None = None) -> str:
    """The message, after asserting it names `file` (and `line`) and carries a fix."""
    msg = str(exc.value)
    assert file in msg, msg
    if line is not None:
        assert f"{file}:{line}:" in msg, msg
    assert "Fix:" in msg, msg
    return msg


# ---------------------------------------------------------------- audio


def test_write_then_read_roundtrip_is_float32_mono(tmp_path):
    x = signal(1600)
    write_audio(tmp_path / "sub" / "x.wav", x)
    y = read_audio(tmp_path / "sub" / "x.wav")
    assert y.dtype == np.float32 and y.shape == (1600,)
    np.testing.assert_allclose(y, x, atol=1.0 / 32768 + 1e-7)
    assert sf.info(tmp_path / "sub" / "x.wav").subtype == "PCM_16"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["x.wav"]  # no temp left behind
    assert audio_info(tmp_path / "sub" / "x.wav") == (SR, 1, 1600)


def test_write_audio_clips_instead_of_wrapping(tmp_path):
    write_audio(tmp_path / "c.wav", np.array([2.0, -2.0, 0.5], dtype=np.float32))
    y = read_audio(tmp_path / "c.wav")
    assert y[0] > 0.99 and y[1] < -0.99 and abs(y[2] - 0.5) < 1e-4


def test_read_audio_segment_cuts_exact_samples(tmp_path):
    p = wav(tmp_path / "s.wav", n=3200)
    full = read_audio(p)
    seg = read_audio(p, start=0.05, end=0.1)
    np.testing.assert_array_equal(seg, full[800:1600])
    np.testing.assert_array_equal(read_audio(p, start=0.15), full[2400:])


def test_read_audio_missing_file_names_declaring_line(tmp_path):
    with pytest.raises(DataError, match="does not exist") as exc:
        read_audio(tmp_path / "nope.wav", where="data/wav.scp:12")
    msg = located(exc, "data/wav.scp", 12)
    assert "nope.wav" in msg


def test_read_audio_garbage_bytes(tmp_path):
    p = tmp_path / "junk.wav"
    p.write_bytes(b"this is not audio" * 20)
    with pytest.raises(DataError, match="unreadable or corrupt") as exc:
        read_audio(p, where="x/wav.scp:3")
    located(exc, "x/wav.scp", 3)
    with pytest.raises(DataError, match="unreadable or corrupt") as exc:
        audio_info(p)
    located(exc, "junk.wav")


def test_read_audio_empty(tmp_path):
    p = tmp_path / "empty.wav"
    sf.write(p, np.zeros(0, dtype=np.float32), SR, subtype="PCM_16")
    with pytest.raises(DataError, match=r"no audio \(0 samples\)") as exc:
        read_audio(p)
    located(exc, "empty.wav")


def test_read_audio_wrong_sample_rate_suggests_sox(tmp_path):
    p = wav(tmp_path / "r8k.wav", sr=8000)
    with pytest.raises(DataError, match="sample rate is 8000 Hz, expected 16000 Hz") as exc:
        read_audio(p, where="d/wav.scp:2")
    assert "sox r8k.wav -r 16000" in located(exc, "d/wav.scp", 2)


def test_read_audio_stereo(tmp_path):
    p = wav(tmp_path / "st.wav", channels=2)
    with pytest.raises(DataError, match="2 channels, expected mono") as exc:
        read_audio(p)
    assert "-c 1" in located(exc, "st.wav")


def test_read_audio_segment_out_of_range(tmp_path):
    p = wav(tmp_path / "s.wav", n=3200)  # 0.2 s
    with pytest.raises(DataError, match="past the end") as exc:
        read_audio(p, start=0.1, end=5.0, where="d/segments:4")
    located(exc, "d/segments", 4)
    with pytest.raises(DataError, match=r"starts at 0\.3 s, past the end"):
        read_audio(p, start=0.3, end=0.4)
    with pytest.raises(DataError, match="is empty"):
        read_audio(p, start=0.1, end=0.1)


def test_read_audio_m4a_says_convert(tmp_path):
    p = tmp_path / "00001.m4a"
    p.write_bytes(b"\x00\x00\x00\x20ftypM4A " + b"\x00" * 64)
    with pytest.raises(DataError, match="m4a") as exc:
        read_audio(p)
    assert "ffmpeg" in located(exc, "00001.m4a")


# ---------------------------------------------------------------- Kaldi


def test_kaldi_dir_loads_ids_speakers_and_paths(tmp_path):
    d = good_kaldi(tmp_path)
    (d / "spk2utt").write_text("spkA spkA-1 spkA-2\nspkB spkB-1\n")
    c = load_kaldi_dir(d)
    assert c.utt_ids() == ["spkA-1", "spkA-2", "spkB-1"]
    assert c.speakers() == ["spkA", "spkB"]
    assert c.spk2utt() == {"spkA": ["spkA-1", "spkA-2"], "spkB": ["spkB-1"]}
    assert c["spkA-1"].path == (d / "audio" / "a1.wav").absolute()
    assert c["spkB-1"].path == tmp_path / "elsewhere" / "b1.wav"
    assert c["spkA-2"].where == f"{d / 'wav.scp'}:3"
    assert c.speaker_of("spkB-1") == "spkB" and "spkA-2" in c and "zz" not in c
    c.validate()
    np.testing.assert_allclose(c.load("spkB-1"), signal(seed=2), atol=1.0 / 32768 + 1e-7)
    sub = c.subset(speakers=["spkA"])
    assert sub.utt_ids() == ["spkA-1", "spkA-2"] and len(sub) == 2
    assert c.subset(utt_ids=["spkB-1", "spkA-1"], speakers=["spkA"]).utt_ids() == ["spkA-1"]
    with pytest.raises(DataError, match="not in the corpus"):
        c.subset(utt_ids=["nobody"])


def test_kaldi_segments_cut_recordings(tmp_path):
    wav(tmp_path / "data" / "rec1.wav", n=4800, seed=7)
    d = kaldi_dir(
        tmp_path,
        **{
            "wav.scp": "rec1 rec1.wav\n",
            "utt2spk": "s1 alice\ns2 bob\ns3 bob\n",
            "segments": "s1 rec1 0.0 0.1\ns2 rec1 0.1 0.25\ns3 rec1 0.25 -1\n",
        },
    )
    c = load_kaldi_dir(d)
    full = read_audio(tmp_path / "data" / "rec1.wav")
    assert c["s2"].start == 0.1 and c["s2"].end == 0.25 and c["s3"].end is None
    np.testing.assert_array_equal(c.load("s1"), full[:1600])
    np.testing.assert_array_equal(c.load("s2"), full[1600:4000])
    np.testing.assert_array_equal(c.load("s3"), full[4000:])
    c.validate()


@pytest.mark.parametrize(
    ("files", "file", "line", "pattern"),
    [
        ({"wav.scp": "u1 a.wav\n"}, "utt2spk", None, "missing required file"),
        ({"utt2spk": "u1 s\n"}, "wav.scp", None, "missing required file"),
        (
            {"wav.scp": "u1 a.wav\nu2 b.wav\nu1 c.wav\n", "utt2spk": "u1 s\nu2 s\n"},
            "wav.scp",
            3,
            "duplicate key 'u1'",
        ),
        (
            {"wav.scp": "u1 a.wav\nu2 b.wav\n", "utt2spk": "u1 s\nu2 s\nu2 t\n"},
            "utt2spk",
            3,
            "duplicate key 'u2'",
        ),
        (
            {"wav.scp": "u1 a.wav\n", "utt2spk": "u1 s\n\nu9 s\n"},
            "utt2spk",
            3,
            "utterance 'u9' has no audio in wav.scp",
        ),
        (
            {"wav.scp": "u1 a.wav\nu2 b.wav\n", "utt2spk": "u1 s\n"},
            "wav.scp",
            2,
            "utterance 'u2' has no speaker in utt2spk",
        ),
        (
            {"wav.scp": "u1 a.wav\nu2\n", "utt2spk": "u1 s\nu2 s\n"},
            "wav.scp",
            2,
            "expected 2 fields",
        ),
        (
            {"wav.scp": "u1 a.wav\n", "utt2spk": "u1 s extra\n"},
            "utt2spk",
            1,
            "expected 2 fields 'utt-id speaker-id', got 3",
        ),
        (
            {"wav.scp": "u1 a.wav\nu2 sox b.flac -t wav - |\n", "utt2spk": "u1 s\nu2 s\n"},
            "wav.scp",
            2,
            "piped command",
        ),
        (
            {"wav.scp": "u1 /x/raw.ark:1234\n", "utt2spk": "u1 s\n"},
            "wav.scp",
            1,
            "Kaldi archive",
        ),
        (
            {
                "wav.scp": "r a.wav\n",
                "utt2spk": "u1 s\nu2 s\n",
                "segments": "u1 r 0 1\nu2 r 2.0 1.5\n",
            },
            "segments",
            2,
            r"ends \(1.5\) at or before its start \(2.0\)",
        ),
        (
            {"wav.scp": "r a.wav\n", "utt2spk": "u1 s\n", "segments": "u1 rX 0 1\n"},
            "segments",
            1,
            "recording 'rX' of segment 'u1' is not in wav.scp",
        ),
        (
            {"wav.scp": "r a.wav\n", "utt2spk": "u1 s\n", "segments": "u1 r 0 1 9\n"},
            "segments",
            1,
            "expected 4 fields",
        ),
        (
            {"wav.scp": "r a.wav\n", "utt2spk": "u1 s\n", "segments": "u1 r zero 1\n"},
            "segments",
            1,
            "start time 'zero' is not a number",
        ),
        (
            {"wav.scp": "r a.wav\n", "utt2spk": "u1 s\n", "segments": "u1 r 0 1\nu1 r 1 2\n"},
            "segments",
            2,
            "duplicate key 'u1'",
        ),
        (
            {"wav.scp": "u1 a.wav\nu2 b.wav\n", "utt2spk": "u1 s\nu2 t\n", "spk2utt": "s u1 u2\n"},
            "spk2utt",
            1,
            "'u2' is under speaker 's' but utt2spk:2 says 't'",
        ),
        (
            {"wav.scp": "u1 a.wav\nu2 b.wav\n", "utt2spk": "u1 s\nu2 s\n", "spk2utt": "s u1\n"},
            "utt2spk",
            2,
            "'u2' is missing from spk2utt",
        ),
    ],
)
def test_kaldi_dir_bad_input(tmp_path, files, file, line, pattern):
    d = kaldi_dir(tmp_path, **files)
    with pytest.raises(DataError, match=pattern) as exc:
        load_kaldi_dir(d)
    located(exc, str(d / file), line)


def _validate_error(tmp_path: Path, make_audio) -> pytest.ExceptionInfo:
    wav(tmp_path / "data" / "ok.wav")
    make_audio(tmp_path / "data" / "bad.wav")
    d = kaldi_dir(tmp_path, **{"wav.scp": "u1 ok.wav\nu2 bad.wav\n", "utt2spk": "u1 s\nu2 s\n"})
    c = load_kaldi_dir(d)  # audio is not opened at load time
    with pytest.raises(DataError) as exc:
        c.validate()
    located(exc, str(d / "wav.scp"), 2)
    assert "bad.wav" in str(exc.value)
    c.validate(check_audio=False)
    return exc


def test_validate_missing_wav(tmp_path):
    exc = _validate_error(tmp_path, lambda p: None)
    assert "does not exist" in str(exc.value)


def test_validate_unreadable_wav(tmp_path):
    exc = _validate_error(tmp_path, lambda p: p.write_bytes(b"\x01\x02garbage" * 50))
    assert "unreadable or corrupt" in str(exc.value)


def test_validate_empty_wav(tmp_path):
    exc = _validate_error(
        tmp_path, lambda p: sf.write(p, np.zeros(0, np.float32), SR, subtype="PCM_16")
    )
    assert "0 samples" in str(exc.value)


def test_validate_wrong_rate(tmp_path):
    exc = _validate_error(tmp_path, lambda p: wav(p, sr=22050))
    assert "22050 Hz, expected 16000 Hz" in str(exc.value)


def test_validate_stereo(tmp_path):
    exc = _validate_error(tmp_path, lambda p: wav(p, channels=2))
    assert "2 channels" in str(exc.value)


def test_validate_segment_past_end_points_at_segments_line(tmp_path):
    wav(tmp_path / "data" / "rec.wav", n=3200)
    d = kaldi_dir(
        tmp_path,
        **{
            "wav.scp": "r rec.wav\n",
            "utt2spk": "u1 s\nu2 s\n",
            "segments": "u1 r 0 0.1\nu2 r 0.1 3.0\n",
        },
    )
    with pytest.raises(DataError, match="past the end") as exc:
        load_kaldi_dir(d).validate()
    located(exc, str(d / "segments"), 2)


def test_write_kaldi_dir_roundtrip_and_segments(tmp_path):
    c = load_kaldi_dir(good_kaldi(tmp_path))
    out = tmp_path / "out"
    (out).mkdir()
    (out / "segments").write_text("stale r 0 1\n")
    write_kaldi_dir(c, out)
    assert not (out / "segments").exists()
    back = load_kaldi_dir(out)
    assert [(u.utt_id, u.speaker, u.path) for u in back.utterances] == [
        (u.utt_id, u.speaker, u.path) for u in c.utterances
    ]
    assert (out / "spk2utt").read_text() == "spkA spkA-1 spkA-2\nspkB spkB-1\n"

    wav(tmp_path / "data2" / "rec1.wav", n=4800)
    seg = kaldi_dir(
        tmp_path / "data2",
        **{
            "wav.scp": "rec1 ../rec1.wav\n",
            "utt2spk": "s1 a\ns2 b\n",
            "segments": "s1 rec1 0.0 0.1\ns2 rec1 0.1 -1\n",
        },
    )
    c2 = load_kaldi_dir(seg)
    write_kaldi_dir(c2, tmp_path / "out2")
    back2 = load_kaldi_dir(tmp_path / "out2")
    assert [(u.utt_id, u.path, u.start, u.end) for u in back2.utterances] == [
        (u.utt_id, u.path, u.start, u.end) for u in c2.utterances
    ]
    np.testing.assert_array_equal(back2.load("s2"), c2.load("s2"))


def test_write_kaldi_dir_rejects_spaces(tmp_path):
    c = Corpus("x", tmp_path, [Utterance("a b", "s", tmp_path / "a.wav", where="l.list:4")])
    with pytest.raises(DataError, match="whitespace") as exc:
        write_kaldi_dir(c, tmp_path / "out")
    located(exc, "l.list", 4)


# ---------------------------------------------------------------- VoxCeleb / LibriSpeech


def vox_tree(root: Path) -> Path:
    for rel in [
        "id10270/x6uYqmx31kE/00001.wav",
        "id10270/x6uYqmx31kE/00002.wav",
        "id10270/8jEAjG6SegY/00008.wav",
        "id10271/1gtz-CUIygI/00001.wav",
    ]:
        wav(root / "wav" / rel)
    return root


def test_voxceleb_ids_match_trial_list_names(tmp_path):
    root = vox_tree(tmp_path / "vox1")
    for where in (root, root / "wav"):
        c = load_voxceleb(where)
        assert c.utt_ids() == [
            "id10270/8jEAjG6SegY/00008.wav",
            "id10270/x6uYqmx31kE/00001.wav",
            "id10270/x6uYqmx31kE/00002.wav",
            "id10271/1gtz-CUIygI/00001.wav",
        ]
        assert c.speakers() == ["id10270", "id10271"]
        assert (
            c["id10271/1gtz-CUIygI/00001.wav"].path
            == (root / "wav" / "id10271" / "1gtz-CUIygI" / "00001.wav").absolute()
        )
        assert c.root == (root / "wav").absolute()
    c.validate()


def test_voxceleb2_m4a_says_convert(tmp_path):
    p = tmp_path / "vox2" / "aac" / "id00012" / "21Uxsk56VDQ" / "00001.m4a"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"\x00" * 32)
    with pytest.raises(DataError, match=r"\.m4a") as exc:
        load_voxceleb(tmp_path / "vox2")
    assert "ffmpeg" in located(exc, "00001.m4a")
    with pytest.raises(DataError, match=r"\.m4a"):
        load_corpus(tmp_path / "vox2")


def test_voxceleb_empty_tree(tmp_path):
    (tmp_path / "v" / "wav" / "id1").mkdir(parents=True)
    with pytest.raises(DataError, match="no audio found in the VoxCeleb layout") as exc:
        load_voxceleb(tmp_path / "v")
    located(exc, "wav")


def libri_tree(root: Path) -> Path:
    for rel in ["19/198/19-198-0000.flac", "19/198/19-198-0001.flac", "26/495/26-495-0000.flac"]:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        sf.write(p, signal(1600), SR, format="FLAC")
    (root / "19" / "198" / "19-198.trans.txt").write_text("19-198-0000 HELLO\n")
    return root


def test_librispeech_layout(tmp_path):
    c = load_librispeech(libri_tree(tmp_path / "train-clean-100"))
    assert c.utt_ids() == ["19-198-0000", "19-198-0001", "26-495-0000"]
    assert c.speaker_of("26-495-0000") == "26"
    assert c.load("19-198-0001").shape == (1600,)
    c.validate()


def test_librispeech_name_disagrees_with_folders(tmp_path):
    root = libri_tree(tmp_path / "ls")
    sf.write(root / "26" / "495" / "27-495-0009.flac", signal(1600), SR, format="FLAC")
    with pytest.raises(DataError, match="disagrees with its folders 26/495/") as exc:
        load_librispeech(root)
    located(exc, "27-495-0009.flac")


# ---------------------------------------------------------------- raw.list


def test_raw_list(tmp_path):
    wav(tmp_path / "audio" / "a.wav")
    wav(tmp_path / "audio" / "b.wav")
    lst = tmp_path / "lists" / "raw.list"
    lst.parent.mkdir()
    lst.write_text(
        json.dumps({"key": "k2", "spk": "s2", "wav": str(tmp_path / "audio" / "b.wav")})
        + "\n\n"
        + json.dumps({"key": "k1", "spk": "s1", "wav": "../audio/a.wav"})
        + "\n"
    )
    c = load_raw_list(lst)
    assert c.utt_ids() == ["k1", "k2"]
    assert c["k1"].path == (tmp_path / "audio" / "a.wav").absolute()
    assert c["k1"].where == f"{lst}:3"
    c.validate()


@pytest.mark.parametrize(
    ("lines", "line", "pattern"),
    [
        (['{"key": "a", "spk": "s", "wav": "a.wav"}', "{not json"], 2, "invalid JSON"),
        (['{"key": "a", "wav": "a.wav"}'], 1, "missing field 'spk'"),
        (['{"key": "a", "spk": 3, "wav": "a.wav"}'], 1, "field 'spk' must be a non-empty"),
        (
            ['{"key": "a", "spk": "s", "wav": "a.wav"}', '{"key": "a", "spk": "s", "wav": "b"}'],
            2,
            "duplicate key 'a' \\(first at line 1\\)",
        ),
    ],
)
def test_raw_list_bad_input(tmp_path, lines, line, pattern):
    lst = tmp_path / "raw.list"
    lst.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=pattern) as exc:
        load_raw_list(lst)
    located(exc, str(lst), line)


# ---------------------------------------------------------------- detection and resolve


def test_load_corpus_detects_each_layout(tmp_path):
    kd = good_kaldi(tmp_path)
    assert load_corpus(kd).utt_ids() == load_kaldi_dir(kd).utt_ids()
    assert load_corpus(kd / "wav.scp").name == str(kd)
    vox = vox_tree(tmp_path / "vox")
    assert load_corpus(vox).utt_ids()[0] == "id10270/8jEAjG6SegY/00008.wav"
    assert len(load_corpus(vox / "wav")) == 4
    assert load_corpus(libri_tree(tmp_path / "ls")).utt_ids()[0] == "19-198-0000"
    jl = tmp_path / "utts.txt"
    jl.write_text('{"key": "x", "spk": "s", "wav": "vox/wav/id10270/x6uYqmx31kE/00001.wav"}\n')
    assert load_corpus(jl).utt_ids() == ["x"]


def test_load_corpus_unknown_layout(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.txt").write_text("hi")
    with pytest.raises(DataError, match="not a corpus layout") as exc:
        load_corpus(tmp_path / "stuff")
    assert "wav.scp" in located(exc, "stuff") and "raw.list" in str(exc.value)
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "missing")


def test_resolve_by_id_and_path_suffix(tmp_path):
    root = vox_tree(tmp_path / "vox")
    lines = []
    for i, p in enumerate(sorted((root / "wav").rglob("*.wav"))):
        lines.append(f"utt{i} {p}")
    d = kaldi_dir(tmp_path, **{"wav.scp": "\n".join(lines) + "\n"})
    (d / "utt2spk").write_text("".join(f"utt{i} spk{i}\n" for i in range(len(lines))))
    c = load_kaldi_dir(d)
    target = next(u.utt_id for u in c.utterances if u.path.match("x6uYqmx31kE/00002.wav"))
    assert c.resolve("utt0") == "utt0"
    assert c.resolve("id10270/x6uYqmx31kE/00002.wav") == target
    assert c.resolve("id10270/x6uYqmx31kE/00002") == target  # without extension
    assert c.resolve("./x6uYqmx31kE/00002.wav") == target
    assert c.resolve("wav/id10270/x6uYqmx31kE/00002.wav") == target  # longer than the index
    assert c.resolve("id10270/x6uYqmx31kE/00002.flac") == target  # other extension
    assert c._suffixes is not None  # built once, reused
    with pytest.raises(DataError, match="ambiguous") as exc:
        c.resolve("00001.wav", where="t.txt:5")
    located(exc, "t.txt", 5)
    with pytest.raises(DataError, match="not in corpus") as exc:
        c.resolve("id10270/abc/00009.wav", where="trials.txt:17")
    msg = located(exc, "trials.txt", 17)
    assert re.search(r"corpus .*data \(4 utterances\)", msg)
    with pytest.raises(DataError, match="not in corpus"):
        c.resolve("0270/x6uYqmx31kE/00002.wav")  # whole components only


def test_corpus_duplicate_ids_rejected(tmp_path):
    us = [Utterance("a", "s", tmp_path / "a.wav", where="x:1")] * 2
    with pytest.raises(DataError, match="duplicate utterance id 'a'"):
        Corpus("c", tmp_path, us)


def test_validate_empty_corpus(tmp_path):
    with pytest.raises(DataError, match="no utterances"):
        Corpus("c", tmp_path, []).validate()
