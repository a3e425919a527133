"""FLOP floor shared by the federated benchmarks (docs/benchmarks.md, "The floor").

Used by bench_w1.py, bench_w2.py and bench_population.py: counts a forward pass with
FlopCounterMode, measures the dense matmul rate in the same process, and prints one line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


def matmul_rate(n: int = 2048, reps: int = 7) -> float:
    """Dense float32 matmul FLOP/s at the current thread count (median of `reps`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def forward_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one call of `fn` (a forward pass), as FlopCounterMode counts them."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def train_flops(forward_per_example: float, examples: int) -> float:
    """Training FLOPs ≈ 3 × forward FLOPs per example × examples trained."""
    return 3.0 * forward_per_example * examples


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def keep_freed_memory() -> bool:
    """Ask glibc malloc to serve big blocks from the heap and keep freed memory (process-wide).

    By default a block over 32 MiB is a fresh mmap, and its first touch page-faults: W2's
    stacked delta (100 x 200 x 784 floats, 63 MB) cost ~15-19 ms of faults per round, about
    half the floor. With mmap off and trimming raised, later rounds reuse the same pages.
    Returns False where glibc's mallopt is not available.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def load_average() -> float:
    """1-minute load average: other processes on the 2-core machine skew absolute times."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def median_rounds(stamps: Sequence[float], first: int = 2, last: int = 6) -> float:
    """Median duration of rounds first..last (1-based) from timestamps t0, end of 1, 2, ..."""
    durations = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(durations[first - 1 : last])


def report(
    name: str,
    seconds: float,
    flops: float,
    rate: float,
    losses: Sequence[float],
    extra: str = "",
) -> str:
    """One line: time, floor measured in this process, ratio, peak RSS, loss trend, load."""
    floor = flops / rate
    trend = "down" if losses[-1] < losses[0] else "NOT down"
    line = (
        f"{name}: {seconds:.4f} s/round (median rounds 2-6), floor {floor:.3g} s "
        f"({flops / 1e9:.2f} GFLOP at {rate / 1e9:.1f} GFLOP/s, {torch.get_num_threads()} "
        f"thread(s)), ratio {seconds / floor:.2f}x, peak RSS {peak_rss_mb():.0f} MB, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} ({trend}), load {load_average():.2f}"
    )
    if extra:
        line += f", {extra}"
    print(line, flush=True)
    return line


def keep_memory_if_asked(enabled: bool) -> None:
    """The benchmarks' --keep-memory flag: apply keep_freed_memory() and say so."""
    if enabled:
        print(f"malloc keeps freed memory: {keep_freed_memory()} (--keep-memory)", flush=True)


def ray_update(population: Any, workers: int) -> Any:
    """The Simulator's client update: None (in process) for `workers` = 0, else fedvox's Ray
    backend of `workers` actors × 1 thread over the plain update (W1/W2 `--ray N`)."""
    if workers <= 0:
        return None
    from fedvox.fl.simulator import plain_client_update
    from fedvox.scale.actors import RayBackend
    from fedvox.scale.config import BackendConfig

    return RayBackend(plain_client_update, population, BackendConfig(kind="ray", workers=workers))
