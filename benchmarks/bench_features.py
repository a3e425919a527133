"""Feature extraction speed: fedvox fbank / full front end against kaldi-native-fbank.

Prints x real time on one thread in one process; compare ratios measured in the same run.
"""

from __future__ import annotations

import os

# One BLAS/OpenMP thread: set before numpy is imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

from fedvox.data.features import FbankConfig, FeatureConfig, compute_fbank, extract_features  # noqa: E402


def speech_like(seconds: float, sr: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    phase = 2 * np.pi * np.cumsum(120 + 20 * np.sin(2 * np.pi * 3 * t)) / sr
    source = sum(np.sin(k * phase) / k for k in range(1, 30))
    env = np.clip(np.sin(2 * np.pi * 2.5 * t), 0, None)
    return (0.3 * source * env + 0.01 * rng.standard_normal(n)).astype(np.float32)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (caches, FFT plans)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def knf_fbank(wave: np.ndarray, bins: int) -> np.ndarray:
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = bins
    fb = knf.OnlineFbank(opts)
    fb.accept_waveform(16000, wave * 32768.0)
    fb.input_finished()
    return np.array([fb.get_frame(i) for i in range(fb.num_frames_ready)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="audio length")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    wave = speech_like(args.seconds)
    try:
        import kaldi_native_fbank  # noqa: F401

        have_knf = True
    except ImportError:
        have_knf = False
    print(
        f"audio: {args.seconds:.0f} s speech-like at 16 kHz; 1 thread, 1 process; "
        f"median of {args.repeats}"
    )
    print(
        f"{'bins':>4}  {'fedvox fbank':>14}  {'fedvox front end':>17}  "
        f"{'kaldi-native-fbank':>19}  {'fbank speed vs knf':>18}"
    )
    for bins in (80, 30):
        fcfg = FbankConfig(num_mel_bins=bins)
        t_fb = median_time(lambda fcfg=fcfg: compute_fbank(wave, fcfg), args.repeats)
        cfg = FeatureConfig(fbank=fcfg)
        t_fe = median_time(lambda cfg=cfg: extract_features(wave, cfg), args.repeats)
        if have_knf:
            t_knf = median_time(lambda bins=bins: knf_fbank(wave, bins), args.repeats)
            knf_col = f"{args.seconds / t_knf:>15.0f} xRT"
            ratio = f"{t_knf / t_fb:>17.2f}x"
        else:
            knf_col, ratio = f"{'not installed':>19}", f"{'-':>18}"
        print(
            f"{bins:>4}  {args.seconds / t_fb:>10.0f} xRT  {args.seconds / t_fe:>13.0f} xRT  "
            f"{knf_col}  {ratio}"
        )


if __name__ == "__main__":
    main()
