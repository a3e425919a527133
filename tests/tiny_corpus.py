"""The tiny synthetic corpus the end-to-end tests share (8 + 4 speakers, ~1 s utterances).

TOML fragments with a "{cache}" placeholder; test configs add their own name, seed,
[train] and [federated] tables around them. `write_kaldi_dir` makes a small labelled corpus
on disk (e.g. the server's public corpus, data.public).
"""

from pathlib import Path

import numpy as np

TINY_DATA = """[data]
cache_dir = "{cache}"
workers = 1
[data.synthetic]
n_train_speakers = 8
n_test_speakers = 4
train_utts_per_speaker = 5
test_utts_per_speaker = 3
min_duration_s = 1.0
max_duration_s = 1.5
difficulty = "clean"
"""

TINY_EVAL = """[eval]
asnorm_top_n = 4
lda_dim = 6
"""


def write_kaldi_dir(root: Path, speakers: dict[str, int], seconds: float = 1.5) -> Path:
    """A Kaldi data dir of `speakers` {id: utterances}: deterministic tones in noise, one
    pitch per speaker, so energy VAD keeps them and speakers differ."""
    from fedvox.data.audio import write_audio

    sr = 16000
    t = np.arange(int(seconds * sr)) / sr
    scp, u2s = [], []
    for k, (spk, n) in enumerate(sorted(speakers.items())):
        for j in range(n):
            rng = np.random.default_rng([k, j])
            x = 0.3 * np.sin(2 * np.pi * (150 + 40 * k) * t) + 0.05 * rng.standard_normal(len(t))
            utt = f"{spk}-{j:02d}"
            write_audio(root / "wav" / f"{utt}.wav", x.astype(np.float32))
            scp.append(f"{utt} wav/{utt}.wav")
            u2s.append(f"{utt} {spk}")
    (root / "wav.scp").write_text("\n".join(scp) + "\n")
    (root / "utt2spk").write_text("\n".join(u2s) + "\n")
    return root
