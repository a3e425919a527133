"""Fuzzing of every reader of outside input: audio, Kaldi data dirs, raw.list, trial lists,
the TOML config, model files and checkpoints, and the secure-aggregation messages.

Property: any input gives a result or the reader's own error (DataError / ConfigError naming
the file and line or field, SecAggAbort, shamir's ValueError), never another exception from
deep inside, and never a silent partial load. Hypothesis runs derandomized with a fixed
example budget, so the file is deterministic and takes seconds. The plain tests under
"Regressions" hold the minimal examples the fuzzers found.
"""

from __future__ import annotations

import io
import json
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import numpy as np
import pytest
import soundfile as sf
import tomli_w
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fedvox.data.audio import audio_info, read_audio
from fedvox.data.corpus import Corpus, Utterance, load_kaldi_dir, load_raw_list
from fedvox.data.trials import TrialList, read_trials
from fedvox.errors import ConfigError, DataError
from fedvox.experiment.config import ExperimentConfig, load_config
from fedvox.experiment.runfolder import RunFolder
from fedvox.models import build_extractor
from fedvox.models.io import load_model, model_info, save_model
from fedvox.privacy import shamir
from fedvox.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    Entropy,
    KeyBroadcast,
    MaskedInput,
    ProtocolParams,
    SecAggAbort,
    SecAggClient,
    SecAggServer,
    SecAggViolation,
    UnmaskResponse,
    neighbour_graph,
)
from fedvox.rng import derived_rng


def fuzz(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings of this file: derandomized (CI sees the same examples every run)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        # One failure, shrunk, without the explain phase: every kept failure holds its
        # frames alive, and a model file's frames hold megabytes.
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


def lines_of(data: bytes) -> int:
    """Lines an editor shows (what `sed -n Np` counts): newline-separated."""
    return data.count(b"\n") + 1


def check_data_error(err: DataError, files: dict[Path, bytes]) -> None:
    """A DataError names a file; a line it names exists in that file."""
    assert err.file, f"error names no file: {err}"
    assert "Fix:" in str(err)
    if err.line is not None:
        named = files.get(Path(err.file))
        assert named is not None, f"{err.file} is not one of the inputs {sorted(files)}"
        assert 1 <= err.line <= lines_of(named), f"line {err.line} of a {lines_of(named)}-line file"


# Odd whitespace and line breaks: str.splitlines() and str.split() treat all of them as
# separators, Kaldi and editors only '\n' (lines) and blanks/tabs (fields).
ODD_SPACE = [" ", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\xa0", "\u2028"]
token = st.text(alphabet=st.sampled_from([*"ab1-_./~", *ODD_SPACE, "é", "\x00"]), max_size=6)
junk_line = st.lists(token, max_size=5).map(" ".join)


def to_bytes(text: str, raw: bytes, mode: int) -> bytes:
    """Encode text, sometimes with a byte-order mark or a stray non-UTF-8 byte."""
    data = text.encode("utf-8")
    if mode == 1:
        return b"\xef\xbb\xbf" + data
    if mode == 2 and data:
        cut = len(raw) % len(data)
        return data[:cut] + b"\xff" + data[cut:]
    return data


# ------------------------------------------------------------------ audio


def _wav_bytes(n: int, rate: int, channels: int, subtype: str) -> bytes:
    buf = io.BytesIO()
    x = np.linspace(-0.9, 0.9, n * channels, dtype=np.float32).reshape(n, channels)
    sf.write(buf, x, rate, subtype=subtype, format="WAV")
    return buf.getvalue()


def _check_audio(path: Path, start: float | None, end: float | None) -> None:
    try:
        sr, ch, frames = audio_info(path)
    except DataError as err:
        check_data_error(err, {})
    else:
        assert sr > 0 and ch > 0 and frames >= 0
    try:
        x = read_audio(path, 16000, start, end)
    except DataError as err:
        check_data_error(err, {})
    else:
        assert x.dtype == np.float32 and x.ndim == 1 and x.size > 0
        assert np.all(np.isfinite(x)), "non-finite samples passed the door"


@fuzz(120)
@given(
    data=st.binary(max_size=300),
    suffix=st.sampled_from([".wav", ".flac", ".raw", ".RAW", ".m4a", ".txt", ""]),
)
def test_fuzz_audio_random_bytes(tmp_path: Path, data: bytes, suffix: str) -> None:
    path = tmp_path / f"x{suffix}"
    path.write_bytes(data)
    _check_audio(path, None, None)


SPECIALS = [float("nan"), float("inf"), -float("inf"), 1e30]
times = st.one_of(st.none(), st.none(), st.floats(0, 0.01), st.floats(allow_nan=True, width=32))


@fuzz(150)
@given(
    n=st.integers(0, 300),
    rate=st.sampled_from([16000, 16000, 16000, 8000]),
    channels=st.sampled_from([1, 1, 1, 2]),
    subtype=st.sampled_from(["PCM_16", "PCM_U8", "PCM_24", "FLOAT", "DOUBLE"]),
    cut=st.one_of(st.none(), st.none(), st.integers(0, 2000)),
    patches=st.lists(st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=4)), max_size=2),
    poke=st.one_of(st.none(), st.tuples(st.integers(0, 40), st.sampled_from(SPECIALS))),
    data_len=st.one_of(st.none(), st.none(), st.integers(0, 2**32 - 1)),
    start=times,
    end=times,
)
def test_fuzz_audio_corrupted_wav(
    tmp_path: Path,
    n: int,
    rate: int,
    channels: int,
    subtype: str,
    cut: int | None,
    patches: list[tuple[int, bytes]],
    poke: tuple[int, float] | None,
    data_len: int | None,
    start: float | None,
    end: float | None,
) -> None:
    data = bytearray(_wav_bytes(n, rate, channels, subtype))
    if poke is not None:  # one sample set to NaN, an infinity or a huge value
        fmt = {"FLOAT": "<f", "DOUBLE": "<d"}.get(subtype, "<h")
        at = data.find(b"data") + 8 + poke[0] * struct.calcsize(fmt)
        value = poke[1] if fmt != "<h" else 0x7FFF
        data[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    if data_len is not None:  # a header whose data chunk length lies
        i = data.find(b"data")
        data[i + 4 : i + 8] = struct.pack("<I", data_len)
    for pos, patch in patches:
        data[pos : pos + len(patch)] = patch
    if cut is not None:
        del data[cut:]
    path = tmp_path / "x.wav"
    path.write_bytes(bytes(data))
    _check_audio(path, start, end)


# ------------------------------------------------------------------ Kaldi data dirs


def _fields(data: bytes) -> list[list[str]]:
    """Fields of the non-blank lines, split as Kaldi does (lines at '\\n' only)."""
    text = data.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    return [line.split() for line in text.split("\n") if line.strip()]


@st.composite
def kaldi_dirs(draw: st.DrawFn) -> dict[str, bytes]:
    """A Kaldi data dir, mostly consistent, with a few edits that may break it."""
    ids = draw(st.lists(st.text("abc12-", min_size=1, max_size=4), min_size=1, max_size=5))
    spk = draw(st.lists(st.sampled_from(["s1", "s2"]), min_size=len(ids), max_size=len(ids)))
    segmented = draw(st.booleans())
    utts = [f"{u}-seg" for u in ids] if segmented else ids
    files: dict[str, list[str]] = {
        "wav.scp": [f"{u} a/{u}.wav" for u in ids],
        "utt2spk": [f"{u} {s}" for u, s in zip(utts, spk, strict=True)],
    }
    if segmented:
        files["segments"] = [f"{u}-seg {u} 0.0 1.5" for u in ids]
    if draw(st.booleans()):
        by: dict[str, list[str]] = {}
        for u, s in zip(utts, spk, strict=True):
            by.setdefault(s, []).append(u)
        files["spk2utt"] = [f"{s} {' '.join(us)}" for s, us in by.items()]
    for _ in range(draw(st.integers(0, 3))):  # edits
        name = draw(st.sampled_from(sorted(files)))
        lines = files[name]
        at = draw(st.integers(0, len(lines)))
        kind = draw(st.sampled_from(["drop", "dup", "blank", "junk", "space"]))
        if kind == "drop" and lines:
            del lines[min(at, len(lines) - 1)]
        elif kind == "dup" and lines:
            lines.insert(at, lines[min(at, len(lines) - 1)])
        elif kind == "blank":
            lines.insert(at, draw(st.sampled_from(["", " ", "\t", "\r"])))
        elif kind == "junk":
            lines.insert(at, draw(junk_line))
        elif kind == "space" and lines:
            i = min(at, len(lines) - 1)
            lines[i] = lines[i].replace(" ", draw(st.sampled_from(ODD_SPACE)), 1)
    out = {}
    for name, lines in files.items():
        text = "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n"]))
        out[name] = to_bytes(text, draw(st.binary(max_size=8)), draw(st.integers(0, 6)))
    return out


@fuzz(200)
@given(files=kaldi_dirs())
def test_fuzz_kaldi_data_dir(tmp_path: Path, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        d = Path(tmp)
        for name, data in files.items():
            (d / name).write_bytes(data)
        try:
            corpus = load_kaldi_dir(d)
        except DataError as err:
            check_data_error(err, {d / k: v for k, v in files.items()} | {d: b""})
            return
    # Loaded: every utterance of utt2spk is there, with its speaker, and nothing else.
    utt2spk = {f[0]: f[1] for f in _fields(files["utt2spk"])}
    assert {u.utt_id: u.speaker for u in corpus.utterances} == utt2spk
    source = "segments" if "segments" in files else "wav.scp"
    assert set(utt2spk) == {f[0] for f in _fields(files[source])}


@fuzz(150)
@given(
    before=st.lists(
        st.sampled_from(["u{} s1", "u{} s1{odd}", "", "{odd}", "u{}\ts2\r"]), max_size=6
    ),
    odd=st.sampled_from(ODD_SPACE),
)
def test_fuzz_kaldi_error_names_the_bad_line(tmp_path: Path, before: list[str], odd: str) -> None:
    """A bad utt2spk line after any valid lines is reported at its own line number."""
    good = [line.format(i, odd=odd) for i, line in enumerate(before)]
    bad_line = len(good) + 1
    text = "\n".join([*good, "x y z"]) + "\n"
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        d = Path(tmp)
        (d / "wav.scp").write_text("".join(f"u{i} a.wav\n" for i in range(len(good))) + "x a\n")
        (d / "utt2spk").write_text(text, encoding="utf-8")
        with pytest.raises(DataError) as exc:
            load_kaldi_dir(d)
    assert exc.value.line == bad_line, str(exc.value)


# ------------------------------------------------------------------ raw.list

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
raw_list_line = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "key": st.one_of(st.text(max_size=4), json_values),
            "spk": st.one_of(st.text(max_size=4), json_values),
            "wav": st.one_of(st.text(max_size=6), json_values),
        },
    ).map(json.dumps),
    json_values.map(json.dumps),
    junk_line,
    # Pathological repeats: deep nesting, long numbers.
    st.builds(
        lambda s, k: s * k, st.sampled_from(["[", '{"a":', "1", "-", '"']), st.integers(0, 6000)
    ),
    st.sampled_from(['{"key": "a", "spk": "s", "wav": "a.wav", "key": "b"}']),
)


@fuzz(200)
@given(
    lines=st.lists(raw_list_line, max_size=5),
    mode=st.integers(0, 6),
    raw=st.binary(max_size=8),
)
def test_fuzz_raw_list(tmp_path: Path, lines: list[str], mode: int, raw: bytes) -> None:
    data = to_bytes("\n".join(lines) + "\n", raw, mode)
    path = tmp_path / "raw.list"
    path.write_bytes(data)
    try:
        corpus = load_raw_list(path)
    except DataError as err:
        check_data_error(err, {path: data})
        return
    # Loaded: one utterance per non-blank line, no line skipped.
    assert len(corpus) == len(_fields(data))


# ------------------------------------------------------------------ trial lists


def _trial_corpus(tmp_path: Path) -> Corpus:
    utts = [
        Utterance(f"s{s}-{i}", f"s{s}", tmp_path / f"s{s}" / f"v/{i}.wav")
        for s in range(2)
        for i in range(2)
    ]
    return Corpus("fuzz", tmp_path, utts)


trial_token = st.sampled_from(
    ["s0-0", "s0-1", "s1-0", "s1-1", "s0/v/0.wav", "v/1", "1", "0", "target", "nontarget", "zz"]
)
trial_line = st.one_of(
    st.lists(trial_token, min_size=3, max_size=3).map(" ".join),
    st.lists(trial_token, max_size=4).map(lambda t: "\t".join(t)),
    st.sampled_from(["", "# comment", "  ", "1 s0-0 s0-1", "s0-0 s1-0 nontarget"]),
    junk_line,
)


@fuzz(200)
@given(lines=st.lists(trial_line, max_size=6), mode=st.integers(0, 6), raw=st.binary(max_size=8))
def test_fuzz_trial_list(tmp_path: Path, lines: list[str], mode: int, raw: bytes) -> None:
    data = to_bytes("\n".join(lines), raw, mode)
    path = tmp_path / "trials.txt"
    path.write_bytes(data)
    try:
        trials = read_trials(path, _trial_corpus(tmp_path))
    except DataError as err:
        check_data_error(err, {path: data})
        return
    assert isinstance(trials, TrialList)
    kept = [f for f in _fields(data) if not f[0].startswith("#")]
    assert len(trials) == len(kept), "a trial line was skipped"


# ------------------------------------------------------------------ the TOML config


def _sections(model: type[Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Table path -> {field name: annotation}, for every table of the config schema."""
    out: dict[str, dict[str, Any]] = {prefix: {}}
    for name, info in model.model_fields.items():
        out[prefix][name] = info.annotation
        for arg in (info.annotation, *get_args(info.annotation)):
            if isinstance(arg, type) and hasattr(arg, "model_fields"):
                out |= _sections(arg, f"{prefix}{name}.")
    return out


SECTIONS = _sections(ExperimentConfig)
toml_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(["fedavg", "fedbuff", "gaussian", "dp_ftrl", "local", "world:test"]),
)
toml_values = st.one_of(toml_scalars, st.lists(toml_scalars, max_size=3))


def typed(annotation: Any) -> st.SearchStrategy[Any]:
    """Values of the field's own type (any in range or not): what gets past pydantic."""
    args = get_args(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(-3, 300) | st.integers(-(2**63), 2**63 - 1)
    if annotation is float:
        return st.floats(-2, 5) | st.floats() | st.integers(-3, 3)
    if annotation is str:
        return st.sampled_from(["synthetic", "world:test", "world:public", "x", ""])
    if get_origin(annotation) is Literal:
        return st.sampled_from(args)
    if get_origin(annotation) is tuple:
        if args and args[-1] is Ellipsis:
            return st.lists(typed(args[0]), max_size=3)
        return st.tuples(*map(typed, args)).map(list)
    options = [typed(a) for a in args if a is not type(None) and not hasattr(a, "model_fields")]
    return st.one_of(options) if options else toml_values


@st.composite
def config_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A config of real table/field names, values mostly of the field's type, some of any."""
    d: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 3))):
        table = draw(st.sampled_from(sorted(SECTIONS)))
        key = draw(st.sampled_from([*SECTIONS[table], "typo"]))
        node = d
        for part in table.rstrip(".").split(".") if table else []:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            if not isinstance(node.get(key), dict):
                ann = SECTIONS[table].get(key, Any)
                node[key] = draw(st.one_of(typed(ann), typed(ann), typed(ann), toml_values))
    return d


def _check_config(path: Path) -> None:
    try:
        cfg = load_config(path)
    except ConfigError as err:
        assert err.field and err.problem, str(err)
        assert err.source == str(path) or err.field == "(file)", str(err)
        return
    # Validated at the edge: every seed it holds seeds a generator.
    world = cfg.data.world
    for seed in (cfg.seed, cfg.data.synthetic.seed, world.seed if world else 0):
        derived_rng(seed, 0)


@fuzz(250)
@given(d=config_dicts())
def test_fuzz_config_valid_toml_wrong_values(tmp_path: Path, d: dict[str, Any]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps(d), encoding="utf-8")
    _check_config(path)


@fuzz(60)
@given(
    where=st.sampled_from(["seed", "data.synthetic.seed", "data.world.seed"]),
    value=st.integers(-(2**70), 2**70),
)
def test_fuzz_config_seeds(tmp_path: Path, where: str, value: int) -> None:
    """Every seed a config accepts seeds numpy's generators (which take integers >= 0)."""
    d: dict[str, Any] = {}
    node = d
    *tables, key = where.split(".")
    for part in tables:
        node = node.setdefault(part, {})
    node[key] = value
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps(d), encoding="utf-8")
    _check_config(path)


@fuzz(150)
@given(
    data=st.one_of(
        st.binary(max_size=60),
        st.builds(
            lambda s, k: s * k,
            st.sampled_from([b"a = [", b"a = {b = ", b"["]),
            st.integers(1, 5000),
        ),
        st.text(max_size=40).map(lambda t: t.encode("utf-8")),
    ),
    mode=st.integers(0, 6),
    raw=st.binary(max_size=8),
)
def test_fuzz_config_bytes(tmp_path: Path, data: bytes, mode: int, raw: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        blob = data
    else:
        blob = to_bytes(text, raw, mode)
    path = tmp_path / "c.toml"
    path.write_bytes(blob)
    _check_config(path)


# ------------------------------------------------------------------ model files, checkpoints


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real model file (a path: its megabyte of bytes must stay out of failure reports)."""
    torch.manual_seed(0)
    model = build_extractor("xvector-tiny", 8, norm="layer")
    path = tmp_path_factory.mktemp("model") / "model.pt"
    save_model(
        path, model, model_name="xvector-tiny", feat_dim=8, norm="layer", embedding_layer=None
    )
    return path


def _check_model(path: Path) -> None:
    for reader in (model_info, load_model):
        try:
            out = reader(path)
        except DataError as err:
            check_data_error(err, {})
            assert err.file == str(path)
        else:
            assert isinstance(out, dict | torch.nn.Module)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch on a corrupt pickle header
@fuzz(60)
@given(
    cut=st.one_of(st.none(), st.integers(0, 40000)),
    flips=st.lists(st.tuples(st.integers(0, 40000), st.integers(1, 255)), max_size=3),
    random=st.binary(max_size=200),
    use_random=st.booleans(),
)
def test_fuzz_model_file_bytes(
    tmp_path: Path,
    model_file: Path,
    cut: int | None,
    flips: list[tuple[int, int]],
    random: bytes,
    use_random: bool,
) -> None:
    data = bytearray(random if use_random else model_file.read_bytes())
    for pos, x in flips:
        if pos < len(data):
            data[pos] ^= x
    if cut is not None:
        del data[cut:]
    path = tmp_path / "model.pt"
    path.write_bytes(bytes(data))
    _check_model(path)


@fuzz(60)
@given(
    blob=st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "model_name": st.sampled_from(["xvector-tiny", "nope", 3, None]),
                "feat_dim": st.one_of(st.integers(-3, 4000), st.just("8"), st.just(8.0)),
                "norm": st.sampled_from(["layer", "batch", "none", "weird", None, 1]),
                "embedding_layer": st.sampled_from([None, "a", "b", "z", 2]),
                "extractor": st.sampled_from(["real", "empty", "junk", None]),
                "weights_sha256": st.text(max_size=3),
            },
        ),
        st.sampled_from([[], 0, "model", None, {"a": 1}]),
    )
)
def test_fuzz_model_file_contents(tmp_path: Path, model_file: Path, blob: Any) -> None:
    if isinstance(blob, dict) and "extractor" in blob:
        real = torch.load(model_file, weights_only=True)["extractor"]
        blob = dict(blob)  # the drawn value is replayed: never mutate it
        blob["extractor"] = {
            "real": real,
            "empty": {},
            "junk": {"x": torch.zeros(2)},
            None: None,
        }[blob["extractor"]]
    path = tmp_path / "model.pt"
    torch.save(blob, path)
    _check_model(path)


@fuzz(40)
@given(ckpt=st.binary(max_size=200), side=st.binary(max_size=70), matching=st.booleans())
def test_fuzz_checkpoint_reader(tmp_path: Path, ckpt: bytes, side: bytes, matching: bool) -> None:
    import hashlib

    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        run = RunFolder(tmp)
        run.checkpoint_dir.mkdir()
        path = run.checkpoint_dir / "ckpt-000000001.pt"
        path.write_bytes(ckpt)
        sidecar = hashlib.sha256(ckpt).hexdigest().encode() + b"\n" if matching else side
        path.with_suffix(".sha256").write_bytes(sidecar)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run.load_latest_checkpoint()  # corrupt ones are skipped, never raised
    assert out is None or out[0] == 1


# ------------------------------------------------------------------ secure aggregation


def _params(n: int = 4, t: int = 2, dim: int = 3) -> ProtocolParams:
    graph = neighbour_graph(n, None, np.random.default_rng(7))
    return ProtocolParams(n, t, dim, 32, graph, b"fuzz-session-id!")


key_bytes = st.one_of(
    st.binary(max_size=40),
    st.binary(min_size=32, max_size=32),
    st.sampled_from([bytes(32), b"\x01" + bytes(31), b"\xe0\xeb\x7a\x7c" + bytes(28)]),
)


@fuzz(60)
@given(
    c_public=st.one_of(st.none(), key_bytes),
    s_public=st.one_of(st.none(), key_bytes),
    masked=st.one_of(st.none(), st.binary(max_size=20)),
    ciphertext=st.one_of(st.none(), st.binary(max_size=300)),
    share=st.one_of(st.none(), st.binary(max_size=140)),
)
def test_fuzz_secagg_hostile_client_messages(
    c_public: bytes | None,
    s_public: bytes | None,
    masked: bytes | None,
    ciphertext: bytes | None,
    share: bytes | None,
) -> None:
    """Client 3 sends arbitrary bytes where the protocol expects keys, shares, vectors."""
    p = _params()
    clients = [SecAggClient(i, p, Entropy(bytes([9, i]) * 16)) for i in range(p.n)]
    server = SecAggServer(p)
    x = np.arange(p.dim, dtype=np.uint32)
    try:
        adverts = [c.advertise_keys() for c in clients]
        a = adverts[3]
        adverts[3] = AdvertiseKeys(3, c_public or a.c_public, s_public or a.s_public)
        broadcasts = server.broadcast_keys(adverts)
        batches = {i: clients[i].share_keys(b) for i, b in broadcasts.items() if i != 3}
        if ciphertext is None:  # shares honestly, under the keys it really holds
            own = KeyBroadcast({**broadcasts[3].keys, 3: _own_keys(clients[3])})
            batches[3] = clients[3].share_keys(own)
        else:
            batches[3] = [EncryptedShare(3, v, ciphertext) for v in range(3)]
        routed = server.route_shares(batches)
        for i in range(3):
            server.receive_masked(clients[i].masked_input(routed[i], x))
        server.receive_masked(MaskedInput(3, masked if masked is not None else x.tobytes()))
        requests = server.unmask_requests()
        responses = [clients[i].unmask(requests[i]) for i in range(3)]
        if share is not None:
            responses.append(UnmaskResponse(3, {0: share}, {}))
        total, survivors = server.unmask(responses)
    except SecAggAbort:
        return
    assert total.shape == (p.dim,) and set(survivors) <= {0, 1, 2, 3}


@fuzz(150)
@given(
    shares=st.dictionaries(st.integers(-2, 2**530), st.binary(max_size=140), max_size=4),
    size=st.integers(-2, 100),
)
def test_fuzz_shamir_combine(shares: dict[int, bytes], size: int) -> None:
    try:
        secret = shamir.combine(shares, size)
    except ValueError:
        return  # shamir's documented error
    assert len(secret) == max(size, 0)


# ------------------------------------------------------------------ regressions
# The minimal examples the fuzzers above found (each failed with the exception named).


def test_raw_suffix_audio_is_a_data_error_not_typeerror(tmp_path: Path) -> None:
    path = tmp_path / "x.raw"  # soundfile: TypeError "samplerate must be specified"
    path.write_bytes(b"")
    for read in (audio_info, read_audio):
        with pytest.raises(DataError, match="headerless") as exc:
            read(path)
        assert exc.value.file == str(path) and "sox" in exc.value.fix


def test_float_wav_with_nan_sample_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "x.wav"  # read back as [nan] before
    sf.write(path, np.array([0.1, np.nan, 0.2], np.float32), 16000, subtype="FLOAT")
    with pytest.raises(DataError, match=r"NaN or infinite samples \(first at sample 1"):
        read_audio(path)
    assert read_audio(path, start=0.0, end=1 / 16000).tolist() == pytest.approx([0.1])


def test_kaldi_line_numbers_count_newlines_only(tmp_path: Path) -> None:
    # '\v' ends a line for str.splitlines(): the bad line 2 was reported as line 3.
    (tmp_path / "wav.scp").write_text("u0 a.wav\nx a.wav\n")
    (tmp_path / "utt2spk").write_text("u0 s1\x0b\nx y z\n")
    with pytest.raises(DataError, match="expected 2 fields") as exc:
        load_kaldi_dir(tmp_path)
    assert exc.value.line == 2


def test_kaldi_files_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    (tmp_path / "wav.scp").write_bytes(b"\xef\xbb\xbfu0 a.wav\n")
    (tmp_path / "utt2spk").write_text("u0 s1\n")
    assert load_kaldi_dir(tmp_path).utt_ids() == ["u0"]  # not '\ufeffu0'


def test_non_utf8_kaldi_file_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "wav.scp").write_bytes(b"u0 a.wav\nu1 \xff.wav\n")
    (tmp_path / "utt2spk").write_text("u0 s1\nu1 s1\n")
    with pytest.raises(DataError, match="not UTF-8") as exc:
        load_kaldi_dir(tmp_path)
    assert exc.value.line == 2


def test_trial_line_numbers_count_newlines_only(tmp_path: Path) -> None:
    path = tmp_path / "trials.txt"
    path.write_text("\x1e 1")  # one line; '\x1e' split it in two, the error said line 2
    with pytest.raises(DataError, match="expected 3 fields") as exc:
        read_trials(path, _trial_corpus(tmp_path))
    assert exc.value.line == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("[" * 1990, "nested too deeply"),  # RecursionError
        ("1" * 5000, "invalid JSON"),  # ValueError: int string conversion limit
        ('{"key": "a", "spk": "s", "wav": "a.wav", "key": "b"}', "field 'key' appears twice"),
    ],
)
def test_raw_list_json_edge_cases_are_data_errors(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "raw.list"
    path.write_text('{"key": "a", "spk": "s", "wav": "a.wav"}\n' + line + "\n")
    with pytest.raises(DataError, match=problem) as exc:
        load_raw_list(path)
    assert exc.value.file == str(path) and exc.value.line == 2


def test_config_not_utf8_is_a_config_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b"seed = 1\nname = '\xff'\n")  # UnicodeDecodeError before
    with pytest.raises(ConfigError, match="line 2 is not UTF-8") as exc:
        load_config(path)
    assert exc.value.source == str(path) and exc.value.field == "(encoding)"


def test_config_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("a = " + "[" * 5000)  # RecursionError before
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path)


def test_config_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xef\xbb\xbfseed = 3\n")
    assert load_config(path).seed == 3


@pytest.mark.parametrize("where", ["seed", "data.synthetic.seed", "data.world.seed"])
def test_negative_seed_is_refused_at_load(tmp_path: Path, where: str) -> None:
    *tables, key = where.split(".")
    text = (f"[{'.'.join(tables)}]\n" if tables else "") + f"{key} = -1\n"
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="greater than or equal to 0") as exc:
        load_config(path)  # accepted before; numpy's SeedSequence failed at run time
    assert exc.value.field == where


def test_checkpoint_sidecar_that_is_not_text_is_skipped(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    run.checkpoint_dir.mkdir()
    (run.checkpoint_dir / "ckpt-000000001.pt").write_bytes(b"")
    (run.checkpoint_dir / "ckpt-000000001.sha256").write_bytes(b"\x80")  # UnicodeDecodeError
    with pytest.warns(UserWarning, match="torn or corrupt"):
        assert run.load_latest_checkpoint() is None


class _NotAModel:
    """A class torch's weights-only loader refuses: loading must not build it."""


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (None, "not a readable model file"),  # empty file: EOFError
        ({}, "no field 'model_name'"),  # KeyError before
        ([], "holds a list"),  # TypeError / AttributeError before
        ({"model_name": "x", "feat_dim": 10**9}, "no field 'norm'"),
        (
            {"model_name": "x", "feat_dim": 10**9, "norm": None, "embedding_layer": None},
            "outside 1..1024",
        ),
        (
            {"model_name": "nope", "feat_dim": 8, "norm": None, "embedding_layer": None},
            "field 'extractor'",
        ),
        (_NotAModel(), "not a readable model file"),
    ],
)
def test_bad_model_files_are_data_errors(tmp_path: Path, blob: Any, problem: str) -> None:
    path = tmp_path / "model.pt"
    if blob is None:
        path.write_bytes(b"")
    else:
        torch.save(blob, path)
    for read in (model_info, load_model):
        with pytest.raises(DataError, match=problem) as exc:
            read(path)
        assert exc.value.file == str(path)


def test_model_weights_that_do_not_fit_the_preset_are_a_data_error(
    tmp_path: Path, model_file: Path
) -> None:
    blob = torch.load(model_file, weights_only=True)
    blob["feat_dim"] = 9  # the weights are for 8 features: RuntimeError before
    path = tmp_path / "model.pt"
    torch.save(blob, path)
    with pytest.raises(DataError, match="weights do not fit model 'xvector-tiny'"):
        load_model(path)
    blob["feat_dim"], blob["model_name"] = 8, "nope"  # ConfigError about `model.name` before
    torch.save(blob, path)
    with pytest.raises(DataError, match=r"cannot rebuild its model: model\.name unknown"):
        load_model(path)


def _own_keys(client: SecAggClient) -> tuple[bytes, bytes]:
    """The public keys a client really holds (a hostile one advertises others)."""
    assert client._c_sk is not None and client._s_sk is not None
    return (
        client._c_sk.public_key().public_bytes_raw(),
        client._s_sk.public_key().public_bytes_raw(),
    )


def _advertised(bad_c: bytes | None = None, bad_s: bytes | None = None) -> tuple[Any, ...]:
    p = _params()
    clients = [SecAggClient(i, p, Entropy(bytes([9, i]) * 16)) for i in range(p.n)]
    adverts = [c.advertise_keys() for c in clients]
    a = adverts[3]
    adverts[3] = AdvertiseKeys(3, bad_c or a.c_public, bad_s or a.s_public)
    return p, clients, SecAggServer(p), adverts


def test_secagg_short_public_key_aborts_at_the_server() -> None:
    _, _, server, adverts = _advertised(bad_s=b"\x00")  # ValueError in a client before
    with pytest.raises(SecAggAbort, match="client 3 advertised a public key that is not 32"):
        server.broadcast_keys(adverts)


def test_secagg_low_order_public_keys_are_refused_by_clients() -> None:
    _, clients, server, adverts = _advertised(bad_s=bytes(32))  # X25519 all-zero output
    broadcasts = server.broadcast_keys(adverts)
    with pytest.raises(SecAggViolation, match="client 3's share-encryption key is not a usable"):
        clients[0].share_keys(broadcasts[0])

    # Client 3 advertises a low-order mask key but shares honestly (it knows its real keys).
    _, clients, server, adverts = _advertised(bad_c=bytes(32))
    broadcasts = server.broadcast_keys(adverts)
    broadcasts[3] = KeyBroadcast({**broadcasts[3].keys, 3: _own_keys(clients[3])})
    batches = {i: clients[i].share_keys(b) for i, b in broadcasts.items()}
    routed = server.route_shares(batches)
    with pytest.raises(SecAggViolation, match="client 3's mask key is not a usable"):
        clients[0].masked_input(routed[0], np.zeros(3, np.uint32))


def test_secagg_masked_input_of_odd_length_aborts() -> None:
    _, clients, server, adverts = _advertised()
    broadcasts = server.broadcast_keys(adverts)
    server.route_shares({i: clients[i].share_keys(b) for i, b in broadcasts.items()})
    with pytest.raises(SecAggAbort, match="has 3 bytes, not 12"):  # numpy ValueError before
        server.receive_masked(MaskedInput(0, b"xyz"))
