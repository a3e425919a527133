"""Tests of the two-domain world: determinism, subset regeneration, the persistent device
channel, the trial list, quantity skew and the settings' errors."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from fedvox.data.corpus import load_corpus
from fedvox.data.trials import read_trials
from fedvox.data.world import (
    DEVICE_DOMAIN,
    PUBLIC_DOMAIN,
    DeviceChannel,
    Population,
    WorldConfig,
    accent_offsets,
    apcm,
    channel_probe,
    device,
    ensure_world,
    generate_part,
    make_world_trials,
    mulaw,
    n_utterances,
    spectral_coarsening,
    synthesize,
    world_dirs,
    world_speaker,
)
from fedvox.errors import ConfigError, DataError


def _tiny(**kw) -> WorldConfig:
    """A world of short recordings: seconds to generate."""
    pub = replace(
        PUBLIC_DOMAIN,
        style=replace(PUBLIC_DOMAIN.style, duration_s=(0.6, 0.9), utts_per_speaker=(3, 3)),
    )
    dev = replace(
        DEVICE_DOMAIN,
        style=replace(DEVICE_DOMAIN.style, duration_s=(0.6, 0.9), utts_per_speaker=(2, 5)),
        channel=replace(DEVICE_DOMAIN.channel, n_models=3),
    )
    args = {"seed": 5, "public_speakers": 2, "train_devices": 3, "test_devices": 8}
    return WorldConfig(**{**args, "public": pub, "device": dev, **kw})


TINY = _tiny()


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    return ensure_world(TINY, tmp_path_factory.mktemp("w"), workers=1, progress=False)


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


# -- determinism and subset regeneration ------------------------------------------------------


def test_same_seed_same_bits_for_any_worker_count(world, tmp_path: Path):
    again = generate_part(TINY, "test", tmp_path / "t", workers=2, progress=False)
    a, b = _files(world.test), _files(again)
    assert a.keys() == b.keys() and sum(k.endswith(".wav") for k in a) >= 16
    assert all(a[k] == b[k] for k in a)


def test_one_recording_regenerates_like_the_whole_part(world, tmp_path: Path):
    for part, root in (("public", world.public), ("devices", world.devices), ("test", world.test)):
        audio = synthesize(TINY, part, 1, 1)
        sf.write(tmp_path / "one.wav", audio, 16000, subtype="PCM_16", format="WAV")
        spk = _lines(root / "spk2utt")[1][0]
        assert (tmp_path / "one.wav").read_bytes() == (root / "wav" / spk / "0001.wav").read_bytes()


def test_a_smaller_world_is_a_subset_of_a_larger_one(world, tmp_path: Path):
    small = replace(TINY, train_devices=2)
    d = generate_part(small, "devices", tmp_path / "d", workers=1, progress=False)
    big = _files(world.devices)
    for name, data in _files(d).items():
        if name.startswith("wav/"):
            assert big[name] == data
    assert (d / "utt2devmodel").read_text() in (world.devices / "utt2devmodel").read_text()


def test_seed_changes_audio_and_parts_are_cached_separately(tmp_path: Path):
    a = synthesize(TINY, "devices", 0, 0)
    b = synthesize(replace(TINY, seed=6), "devices", 0, 0)
    assert a.shape != b.shape or not np.array_equal(a, b)
    harder = replace(
        TINY, device=replace(TINY.device, channel=replace(TINY.device.channel, snr_db=(0, 5)))
    )
    assert harder.key("public") == TINY.key("public")  # the public part is reused
    assert harder.key("devices") != TINY.key("devices")
    assert harder.key("test") != TINY.key("test")
    assert world_dirs(harder, tmp_path).public == world_dirs(TINY, tmp_path).public


def test_cache_reuses_a_complete_part_and_refuses_a_broken_one(world, tmp_path: Path):
    root = world.public.parent
    stamp = (world.public / "config.json").stat().st_mtime_ns
    assert ensure_world(TINY, root, workers=1, progress=False) == world
    assert (world.public / "config.json").stat().st_mtime_ns == stamp
    broken = world_dirs(TINY, tmp_path).public
    (broken / "wav").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no matching config\.json"):
        ensure_world(TINY, tmp_path, workers=1, progress=False, parts=("public",))


# -- the persistent device channel ------------------------------------------------------------


def _ltas(x: np.ndarray) -> np.ndarray:
    frames = np.lib.stride_tricks.sliding_window_view(x, 512)[::256] * np.hanning(512)
    s = np.log(np.mean(np.abs(np.fft.rfft(frames)) ** 2, axis=0) + 1e-10)
    return s - s.mean()


def test_a_device_channel_is_persistent_and_separates_devices_of_one_model():
    """Channel only (a fixed noise probe, no speaker): sessions of one device agree far
    better than two units of one model, which agree better than two models."""
    cfg = WorldConfig(seed=0)
    devs = range(16)
    spec = {
        (d, u): _ltas(channel_probe(cfg, "devices", d, u, n=16000)) for d in devs for u in (0, 1)
    }
    model = {d: device(cfg, "devices", d).model.index for d in devs}
    dist: dict[str, list[float]] = {"device": [], "model": [], "other": []}
    for (a, u), (b, v) in itertools.combinations(spec, 2):
        kind = "device" if a == b else "model" if model[a] == model[b] else "other"
        dist[kind].append(float(np.mean((spec[a, u] - spec[b, v]) ** 2)))
    assert dist["model"], "the check needs two units of one model"
    within, same_model, other = (np.mean(dist[k]) for k in ("device", "model", "other"))
    assert within < 0.5 * same_model and same_model < 0.2 * other
    # Nearest session identifies the device (chance would be 1/16).
    hits = 0
    for d in devs:
        others = [(np.mean((spec[d, 0] - spec[e, 1]) ** 2), e) for e in devs]
        hits += min(others)[1] == d
    assert hits >= 12


def test_recordings_of_a_device_carry_its_band_limit():
    """A narrowband model's recordings have almost no energy above its low-pass edge."""
    cfg = WorldConfig(seed=0)
    narrow = next(d for d in range(50) if device(cfg, "devices", d).model.lowpass_hz < 4500)
    lp = device(cfg, "devices", narrow).model.lowpass_hz
    f = np.fft.rfftfreq(512, 1 / 16000)
    for u in range(2):
        p = np.exp(_ltas(synthesize(cfg, "devices", narrow, u)))
        assert p[f > lp + 1500].mean() < 0.01 * p[(f > 300) & (f < lp - 300)].mean()


# -- the trial list and the layout ------------------------------------------------------------


def test_trials_have_same_model_nontargets_and_right_labels(world):
    utt2spk = dict(_lines(world.test / "utt2spk"))
    utt2model = dict(_lines(world.test / "utt2devmodel"))
    kaldi = _lines(world.test / "trials_kaldi.txt")
    vox = _lines(world.test / "trials.txt")
    assert len(kaldi) == len(vox) and kaldi == sorted(kaldi)
    kinds = Counter()
    for (a, b, lab), (v, pa, pb) in zip(kaldi, vox, strict=True):
        assert (lab == "target") == (utt2spk[a] == utt2spk[b]) == (v == "1")
        assert (pa, pb) == (f"{utt2spk[a]}/{a[-4:]}.wav", f"{utt2spk[b]}/{b[-4:]}.wav")
        assert (world.test / "wav" / pa).is_file()
        if lab == "nontarget":
            kinds[utt2model[a] == utt2model[b]] += 1
    n_target = sum(r[2] == "target" for r in kaldi)
    assert kinds[True] > 0 and kinds[False] > 0
    assert kinds[True] + kinds[False] == TINY.nontarget_ratio * n_target
    per_device = Counter(utt2spk[a] for a, _, lab in kaldi if lab == "target")
    assert max(per_device.values()) <= TINY.targets_per_test_device
    assert len({frozenset(r[:2]) for r in kaldi}) == len(kaldi)
    corpus = load_corpus(world.test)
    corpus.validate()
    assert len(read_trials(world.trials, corpus)) == len(kaldi)


def test_train_and_test_devices_do_not_overlap(world):
    train = {r[1] for r in _lines(world.devices / "utt2spk")}
    test = {r[1] for r in _lines(world.test / "utt2spk")}
    public = {r[1] for r in _lines(world.public / "utt2spk")}
    assert train and test and public
    assert not (train & test) and not (public & train) and not (public & test)
    # Different identity streams, not just different names.
    assert world_speaker(TINY, "devices", 0).f0_mean_hz != world_speaker(TINY, "test", 0).f0_mean_hz
    models = dict(_lines(world.devices / "spk2devmodel"))
    assert set(models) == train and all(m == device(TINY, "devices", int(s[4:])).model.name
                                        for s, m in models.items())  # fmt: skip


def test_all_same_model_nontargets_when_asked():
    trials = make_world_trials(replace(TINY, same_model_fraction=1.0, nontarget_ratio=1))
    models = {d: device(TINY, "test", d).model.index for d in range(TINY.test_devices)}
    nontargets = [(a, b) for lab, a, b in trials if lab == 0]
    assert nontargets and all(models[int(a[4:9])] == models[int(b[4:9])] for a, b in nontargets)


# -- domains: skew, accent, durations ---------------------------------------------------------


def test_quantity_skew_stays_in_bounds_and_is_skewed():
    cfg = WorldConfig(seed=0)
    counts = [n_utterances(cfg, "devices", d) for d in range(400)]
    lo, hi = DEVICE_DOMAIN.style.utts_per_speaker
    assert lo <= min(counts) and max(counts) <= hi
    assert min(counts) <= lo + 1 and max(counts) >= hi - 4
    assert np.median(counts) < (lo + hi) / 2  # log-uniform: most devices hold few recordings
    assert {n_utterances(cfg, "public", s) for s in range(20)} == {24}


def test_recording_lengths_follow_the_domain(world):
    for root, (lo, hi) in (
        (world.public, TINY.public.style.duration_s),
        (world.devices, TINY.device.style.duration_s),
    ):
        for p in root.glob("wav/*/*.wav"):
            info = sf.info(p)
            assert (info.samplerate, info.subtype) == (16000, "PCM_16")
            assert lo - 1e-3 <= info.duration <= hi + 1e-3


def test_an_accent_is_shared_within_a_domain_and_differs_between_domains():
    cfg = WorldConfig(seed=0)
    a1, a2 = accent_offsets(0, 1, 0.08), accent_offsets(0, 2, 0.08)
    assert np.abs(a1 - a2).max() > 0.05 and np.array_equal(a1, accent_offsets(0, 1, 0.08))
    pub = np.mean([world_speaker(cfg, "public", s).formant_offsets for s in range(60)], 0)
    dev = np.mean([world_speaker(cfg, "devices", s).formant_offsets for s in range(60)], 0)
    # The population means sit on their accents (speaker idiosyncrasies average out).
    assert np.corrcoef((pub - dev).ravel(), (a1 - a2).ravel())[0, 1] > 0.9


def test_codecs_quantise():
    x = np.sin(np.linspace(0, 200, 8000)) * np.linspace(0.01, 0.5, 8000)
    assert np.unique(mulaw(x, 4)).size <= 16 and np.abs(mulaw(x, 8) - x).max() < 0.02
    blocks = apcm(x, 3).reshape(-1, 160)
    assert max(np.unique(b).size for b in blocks) <= 8
    assert np.abs(apcm(x, 8) - x).max() < 0.01
    y = spectral_coarsening(x, 3.0, 35.0)
    assert y.shape == x.shape and 0.1 < np.std(y) / np.std(x) < 10


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"train_devices": 0}, "train_devices"),
        ({"test_devices": 1}, "test_devices"),
        ({"same_model_fraction": 1.5}, "same_model_fraction"),
        (
            {
                "device": replace(
                    DEVICE_DOMAIN, style=replace(DEVICE_DOMAIN.style, utts_per_speaker=(1, 4))
                )
            },
            "device.style.utts_per_speaker",
        ),
        (
            {"device": replace(DEVICE_DOMAIN, population=Population(age_years=(50.0, 20.0)))},
            "device.population.age_years",
        ),
        (
            {"device": replace(DEVICE_DOMAIN, channel=DeviceChannel(n_models=0))},
            "device.channel.n_models",
        ),
        ({"public": DEVICE_DOMAIN}, "public.channel"),
    ],
)
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        WorldConfig(**kw)


def test_too_few_test_devices_for_same_model_pairs_is_a_clear_error():
    cfg = _tiny(test_devices=2, device=replace(TINY.device, channel=DeviceChannel(n_models=200)))
    assert len({device(cfg, "test", d).model.index for d in range(2)}) == 2  # precondition
    with pytest.raises(ConfigError, match="test_devices"):
        make_world_trials(cfg)


def test_bad_index_and_part_are_config_errors():
    with pytest.raises(ConfigError, match="part"):
        synthesize(TINY, "server", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="index"):
        world_speaker(TINY, "devices", -1)
    with pytest.raises(ConfigError, match="part"):
        device(TINY, "public", 0)


def test_world_command_prints_the_cached_dirs(tmp_path: Path):
    from typer.testing import CliRunner

    from fedvox.cli import app

    args = ["world", "--public-speakers", "1", "--train-devices", "1", "--test-devices", "4"]
    args += ["--cache-dir", str(tmp_path), "--workers", "1", "-q"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    printed = dict(line.split() for line in res.output.splitlines())
    want = world_dirs(
        WorldConfig(public_speakers=1, train_devices=1, test_devices=4), tmp_path / "corpora"
    )
    assert printed == {
        "public": str(want.public),
        "devices": str(want.devices),
        "test": str(want.test),
        "trials": str(want.trials),
    }
    assert want.trials.is_file() and (want.devices / "utt2devmodel").is_file()
    bad = CliRunner().invoke(app, ["world", "--train-devices", "0", "--cache-dir", str(tmp_path)])
    assert isinstance(bad.exception, ConfigError) and "train_devices" in str(bad.exception)
