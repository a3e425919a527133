"""Benchmark of the synthetic corpus generator: speed, and a non-learned baseline EER.

Speed: `python benchmarks/bench_generate.py` prints x real time per core (audio seconds per
CPU second of one in-process worker) and the wall-clock speed of generate_corpus with 2 workers.
Calibration: `python benchmarks/bench_generate.py --baseline` prints, per difficulty, the EER
of per-utterance mean+std of 30 log-mel filterbanks, cosine-scored after subtracting the
training mean (the floor any learned model should beat).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from fedvox.data.synthetic import (
    SyntheticConfig,
    generate_corpus,
    make_trials,
    synthesize_utterance,
)


def eer(target: np.ndarray, nontarget: np.ndarray) -> float:
    """ROC-interpolated EER (the convention of docs/verification.md): where miss rate = false-alarm rate."""
    scores = np.concatenate([target, nontarget])
    labels = np.concatenate([np.ones(target.size), np.zeros(nontarget.size)])
    order = np.argsort(-scores, kind="stable")
    labels, scores = labels[order], scores[order]
    # One ROC point per distinct threshold (ties move together).
    last = np.r_[np.flatnonzero(np.diff(scores)), scores.size - 1]
    tp = np.cumsum(labels)[last]
    fp = np.cumsum(1 - labels)[last]
    fnr = np.r_[1.0, 1.0 - tp / target.size]
    fpr = np.r_[0.0, fp / nontarget.size]
    d = fnr - fpr
    i = int(np.flatnonzero(d <= 0)[0])
    t = d[i - 1] / (d[i - 1] - d[i])
    return float(fpr[i - 1] + t * (fpr[i] - fpr[i - 1]))


def fbank_stats(audio: np.ndarray) -> np.ndarray:
    """Mean and std over frames of 30-bin Kaldi log-mel filterbanks (no dither)."""
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.mel_opts.num_bins = 30
    fb = knf.OnlineFbank(opts)
    fb.accept_waveform(16000, (audio * 32768).tolist())
    fb.input_finished()
    feats = np.array([fb.get_frame(i) for i in range(fb.num_frames_ready)])
    return np.concatenate([feats.mean(0), feats.std(0)])


def _stats_job(cfg: SyntheticConfig, split: str, spk: int, utt: int) -> np.ndarray:
    # Quantise like the written 16-bit wav so the numbers match what loaders read.
    audio = np.round(synthesize_utterance(cfg, split, spk, utt) * 32767) / 32768
    return fbank_stats(audio)


def baseline(difficulty: str, workers: int, n_train: int, n_test: int, seed: int) -> float:
    cfg = SyntheticConfig(
        seed=seed,
        difficulty=difficulty,
        n_train_speakers=n_train,
        n_test_speakers=n_test,
        train_utts_per_speaker=4,
    )
    jobs = [("train", s, u) for s in range(n_train) for u in range(cfg.train_utts_per_speaker)]
    jobs += [("test", s, u) for s in range(n_test) for u in range(cfg.test_utts_per_speaker)]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        feats = list(
            pool.map(_stats_job, *zip(*[(cfg, *j) for j in jobs], strict=True), chunksize=8)
        )
    n_tr = n_train * cfg.train_utts_per_speaker
    train, test = np.array(feats[:n_tr]), np.array(feats[n_tr:])
    emb = test - train.mean(0)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    index = {
        f"syn-test-{s:05d}-{u:04d}": s * cfg.test_utts_per_speaker + u
        for s in range(n_test)
        for u in range(cfg.test_utts_per_speaker)
    }
    trials = make_trials(cfg)
    lab = np.array([t[0] for t in trials])
    sc = np.array([emb[index[a]] @ emb[index[b]] for _, a, b in trials])
    return eer(sc[lab == 1], sc[lab == 0])


def speed(seconds: float, seed: int) -> None:
    cfg = SyntheticConfig(seed=seed)
    t0, audio, utt = time.process_time(), 0.0, 0
    while time.process_time() - t0 < seconds:
        audio += synthesize_utterance(cfg, "train", utt // 4, utt % 4).size / cfg.sample_rate
        utt += 1
    cpu = time.process_time() - t0
    print(
        f"synthesize_utterance, 1 core: {audio:.0f} s audio in {cpu:.2f} CPU s "
        f"= {audio / cpu:.0f}x real time per core ({utt} utterances)"
    )
    small = replace(
        cfg,
        n_train_speakers=20,
        n_test_speakers=4,
        train_utts_per_speaker=8,
        test_utts_per_speaker=8,
    )
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            out = generate_corpus(small, Path(tmp) / "c", workers=workers, progress=False)
            wall = time.perf_counter() - t0
            import soundfile as sf

            total = sum(sf.info(p).duration for p in out.glob("*/wav/*/*.wav"))
        print(
            f"generate_corpus, workers={workers}: {total:.0f} s audio in {wall:.2f} s wall "
            f"= {total / wall:.0f}x real time (incl. process start and wav writing)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", action="store_true", help="print baseline EER per difficulty")
    ap.add_argument("--seconds", type=float, default=10.0, help="CPU seconds for the speed test")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--train-speakers", type=int, default=50)
    ap.add_argument("--test-speakers", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--difficulty", nargs="*", default=["clean", "mild", "hard"])
    args = ap.parse_args()
    assert abs(eer(np.array([0.9, 0.8, 0.3]), np.array([0.7, 0.2, 0.1, 0.05])) - 0.25) < 1e-12
    if args.baseline:
        for d in args.difficulty:
            t0 = time.perf_counter()
            e = baseline(d, args.workers, args.train_speakers, args.test_speakers, args.seed)
            print(
                f"baseline fbank mean+std cosine EER, {d:5s}: {100 * e:5.2f}%  "
                f"({args.test_speakers} test speakers x 8 utts, seed {args.seed}, "
                f"{time.perf_counter() - t0:.0f} s)"
            )
    else:
        speed(args.seconds, args.seed)


if __name__ == "__main__":
    main()
