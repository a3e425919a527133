"""Data preparation: augmentation switched on in the config reaches training."""

from pathlib import Path

import numpy as np

from fedvox.data.corpus import load_kaldi_dir
from fedvox.data.synthetic import SyntheticConfig, ensure_corpus
from fedvox.experiment.config import config_from_dict
from fedvox.experiment.prepare import resolve_corpora, training_corpus


def test_speed_perturbation_and_augmented_copies(tmp_path: Path) -> None:
    root = ensure_corpus(
        SyntheticConfig(
            n_train_speakers=3,
            n_test_speakers=2,
            train_utts_per_speaker=2,
            test_utts_per_speaker=2,
            min_duration_s=0.8,
            max_duration_s=1.0,
        ),
        cache_root=tmp_path,
        workers=1,
        progress=False,
    )
    base = load_kaldi_dir(root / "train")
    cfg = config_from_dict(
        {
            "train": {
                "augment": {
                    "copies": 1,
                    "speed_factors": [0.9],
                    "noise_prob": 1.0,
                    "reverb_prob": 0.0,
                }
            }
        }
    )
    corpus = training_corpus(base, cfg)
    utts = corpus.utt_ids()
    assert len(utts) == 4 * len(base)  # (original + speed copy) x (clean + augmented copy)
    speakers = {corpus.speaker_of(u) for u in utts}
    assert len(speakers) == 2 * len(base.speakers())  # speed-perturbed copies are new speakers
    u = base.utt_ids()[0]
    clean, noisy = corpus.load(u), corpus.load(f"aug0-{u}")
    assert clean.shape == noisy.shape and not np.allclose(clean, noisy)
    assert np.array_equal(noisy, training_corpus(base, cfg).load(f"aug0-{u}"))  # deterministic
    slow = corpus.load(f"sp0.9-{u}")
    assert abs(len(slow) - len(clean) / 0.9) <= 2


def test_synthetic_public_trains_on_other_voices_scored_on_the_same_test(tmp_path: Path) -> None:
    """data.train = "synthetic:public": the public seed's voices, the embedded test set."""
    small = {
        "n_train_speakers": 3,
        "n_test_speakers": 2,
        "train_utts_per_speaker": 2,
        "test_utts_per_speaker": 2,
        "min_duration_s": 0.8,
        "max_duration_s": 1.0,
    }

    def corpora(train: str):
        data = {"train": train, "synthetic": small, "cache_dir": str(tmp_path), "workers": 1}
        return resolve_corpora(config_from_dict({"data": data}).data, progress=False)

    dev_train, dev_test, dev_trials = corpora("synthetic")
    pub_train, pub_test, pub_trials = corpora("synthetic:public")
    assert pub_test.root == dev_test.root and pub_trials == dev_trials
    assert len(pub_train.speakers()) == len(dev_train.speakers()) == 3
    assert pub_train.root != dev_train.root
    a, b = dev_train.utt_ids()[0], pub_train.utt_ids()[0]
    assert not np.array_equal(dev_train.load(a)[:8000], pub_train.load(b)[:8000])
