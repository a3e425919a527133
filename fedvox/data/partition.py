"""Client partitioners: which federated client holds which training utterances.

Data path: corpus (utt ids, utt2spk) ──► partition ──► client shards for the simulator.

Schemes (all reproducible from the seed and independent of the input order):

* ``speaker`` — one speaker per device (the cross-device norm). Client i holds every
  utterance of the i-th speaker in sorted speaker-id order. No randomness.
* ``k_speakers`` — speakers are shuffled (seeded) and dealt out k at a time, in order; when k
  does not divide the number of speakers the LAST client holds the remaining r < k speakers
  (a smaller silo rather than a refusal: real corpora rarely have a round speaker count).
* ``dirichlet`` — cross-silo label skew (Hsu et al. 2019 form, speakers as labels): for each
  speaker independently, proportions p ~ Dir(alpha·1) over the n_clients clients; the
  speaker's utterances are shuffled and cut at round(cumsum(p)·n_utts). Large alpha gives
  every client a near-equal share of every speaker; small alpha puts each speaker on ~1
  client. A draw that leaves a client empty or below min_utts is refused, never resampled
  or silently kept.
* ``quantity_skew`` — clients differ in how much data they hold. Weights w_c ~
  LogNormal(0, sigma), c = 1..n_clients; client c receives
  ``min_utts + apportion(N − n_clients·min_utts, w)`` utterances (largest-remainder
  apportionment, so sizes sum exactly to N and log-sizes spread with std ≈ sigma when N is
  large). Speakers are shuffled, their utterances (shuffled within speaker) laid end to end,
  and the sequence cut at the cumulative sizes: every speaker stays whole except at the at
  most n_clients − 1 cuts, each of which splits one speaker over two neighbouring clients.

Evaluation speakers passed in ``exclude_speakers`` never reach a client: any of their
utterances in the input is dropped. Client lists are sorted utt ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedvox.atomic import atomic_write_text
from fedvox.errors import ConfigError, DataError
from fedvox.rng import Purpose, derived_rng

SCHEMES = ("speaker", "k_speakers", "dirichlet", "quantity_skew")
FORMAT = "fedvox.partition/1"
_FIELD = "federated.partition."


@dataclass(frozen=True)
class PartitionConfig:
    """How training data is dealt out to clients (see the module docstring per scheme)."""

    scheme: str = "speaker"
    k: int = 1  # speakers per client (k_speakers)
    n_clients: int | None = None  # clients (dirichlet, quantity_skew)
    alpha: float = 0.5  # Dirichlet concentration
    sigma: float = 1.0  # quantity-skew spread: std of the clients' log sizes
    min_utts: int = 1  # every client must hold at least this many utterances


@dataclass
class Partition:
    """Utterance ids per client (each list sorted); meta records how it was made."""

    clients: list[list[str]]
    meta: dict[str, Any] = field(default_factory=dict)

    def client_of(self) -> dict[str, int]:
        """Map utt id -> client index."""
        return {u: c for c, utts in enumerate(self.clients) for u in utts}

    def speakers_of(self, client: int, speaker_of: Callable[[str], str]) -> list[str]:
        """Sorted distinct speakers among one client's utterances."""
        return sorted({speaker_of(u) for u in self.clients[client]})

    def sizes(self) -> np.ndarray:
        """Number of utterances per client."""
        return np.array([len(c) for c in self.clients], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.clients)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "meta": self.meta, "clients": self.clients}

    @classmethod
    def from_json(cls, d: Any, source: str | Path | None = None) -> Partition:
        """Parse and check a partition dict: list of lists of str, no utterance twice."""
        fix = "regenerate it with fedvox.data.partition.partition_corpus and Partition.save"
        if not isinstance(d, dict) or not isinstance(d.get("clients"), list):
            raise DataError(source, "not a fedvox partition (no 'clients' list)", fix)
        if d.get("format", FORMAT) != FORMAT:
            raise DataError(source, f"unknown partition format {d.get('format')!r}", fix)
        clients: list[list[str]] = []
        seen: dict[str, int] = {}
        for c, utts in enumerate(d["clients"]):
            if not isinstance(utts, list) or not all(isinstance(u, str) for u in utts):
                raise DataError(source, f"client {c} is not a list of utterance ids", fix)
            if not utts:
                raise DataError(source, f"client {c} holds no utterances", fix)
            for u in utts:
                if u in seen:
                    raise DataError(source, f"utterance {u!r} is on clients {seen[u]} and {c}", fix)
                seen[u] = c
            clients.append(sorted(utts))
        meta = d.get("meta", {})
        return cls(clients=clients, meta=meta if isinstance(meta, dict) else {})

    def save(self, path: str | Path) -> Path:
        """Write as JSON, atomically."""
        return atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Partition:
        path = Path(path)
        if not path.is_file():
            raise DataError(path, "partition file not found", "check the path")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(
                path, f"not valid JSON ({e.msg})", "regenerate the partition", line=e.lineno
            ) from None
        return cls.from_json(d, source=path)


def _refuse(name: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(_FIELD + name, problem, fix)


def _check_config(cfg: PartitionConfig) -> None:
    if cfg.scheme not in SCHEMES:
        raise _refuse("scheme", f"unknown scheme {cfg.scheme!r}", f"use one of {SCHEMES}")
    if cfg.min_utts < 1:
        raise _refuse("min_utts", f"min_utts={cfg.min_utts} would allow empty clients", "use >= 1")
    if cfg.scheme == "k_speakers" and cfg.k < 1:
        raise _refuse("k", f"k={cfg.k} speakers per client", "use k >= 1")
    if cfg.scheme in ("dirichlet", "quantity_skew"):
        if cfg.n_clients is None or cfg.n_clients < 1:
            raise _refuse(
                "n_clients",
                f"scheme {cfg.scheme!r} needs n_clients >= 1 (got {cfg.n_clients})",
                "set federated.partition.n_clients",
            )
    if cfg.scheme == "dirichlet" and not cfg.alpha > 0:
        raise _refuse("alpha", f"alpha={cfg.alpha} must be > 0", "use e.g. alpha = 0.5")
    if cfg.scheme == "quantity_skew" and not cfg.sigma >= 0:
        raise _refuse("sigma", f"sigma={cfg.sigma} must be >= 0", "use e.g. sigma = 1.0")


def _group_by_speaker(
    utt_ids: Sequence[str], speaker_of: Callable[[str], str], exclude: Collection[str]
) -> tuple[dict[str, list[str]], int]:
    """Sorted utts per kept speaker (speakers in sorted order) and the count dropped."""
    excluded = set(exclude)
    by_spk: dict[str, list[str]] = {}
    dropped = 0
    seen: set[str] = set()
    for u in sorted(utt_ids):
        if u in seen:
            raise DataError(
                None, f"utterance id {u!r} is listed twice", "deduplicate the corpus's utt ids"
            )
        seen.add(u)
        try:
            s = speaker_of(u)
        except KeyError:
            raise DataError(
                None, f"no speaker for utterance {u!r}", "check utt2spk covers every utterance"
            ) from None
        if s in excluded:
            dropped += 1
            continue
        by_spk.setdefault(s, []).append(u)
    return dict(sorted(by_spk.items())), dropped


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers >= 0 summing to `total`, proportional to `weights` (largest remainder)."""
    quota = total * weights / weights.sum()
    base = np.floor(quota).astype(np.int64)
    short = total - int(base.sum())
    # stable sort: ties go to the lower index, so the result is a pure function of the inputs
    order = np.argsort(-(quota - base), kind="stable")
    base[order[:short]] += 1
    return base


def _speaker_scheme(by_spk: dict[str, list[str]], cfg: PartitionConfig) -> list[list[str]]:
    for s, utts in by_spk.items():
        if len(utts) < cfg.min_utts:
            raise _refuse(
                "min_utts",
                f"speaker {s!r} has {len(utts)} utterance(s), fewer than min_utts={cfg.min_utts}",
                "lower min_utts or drop speakers with too little data from the corpus",
            )
    return [list(u) for u in by_spk.values()]


def _k_speakers(
    by_spk: dict[str, list[str]], cfg: PartitionConfig, rng: np.random.Generator
) -> list[list[str]]:
    speakers = list(by_spk)
    if cfg.k > len(speakers):
        raise _refuse(
            "k",
            f"k={cfg.k} speakers per client but only {len(speakers)} training speakers",
            f"use k <= {len(speakers)}",
        )
    order = rng.permutation(len(speakers))
    clients = []
    for start in range(0, len(speakers), cfg.k):
        group = [speakers[i] for i in order[start : start + cfg.k]]
        clients.append(sorted(u for s in group for u in by_spk[s]))
    for c, utts in enumerate(clients):
        if len(utts) < cfg.min_utts:
            raise _refuse(
                "min_utts",
                f"k_speakers left client {c} with {len(utts)} utterance(s) < min_utts={cfg.min_utts}",
                "raise k, lower min_utts, or drop speakers with too little data",
            )
    return clients


def _dirichlet(
    by_spk: dict[str, list[str]], cfg: PartitionConfig, rng: np.random.Generator
) -> list[list[str]]:
    n = int(cfg.n_clients or 0)
    clients: list[list[str]] = [[] for _ in range(n)]
    for utts in by_spk.values():
        p = rng.dirichlet(np.full(n, cfg.alpha))
        if not np.all(np.isfinite(p)):  # guard: tiny alpha can underflow in older numpy
            raise _refuse(
                "alpha", f"Dirichlet with alpha={cfg.alpha} underflowed", "use alpha >= 1e-3"
            )
        shuffled = [utts[i] for i in rng.permutation(len(utts))]
        cuts = np.rint(np.cumsum(p)[:-1] * len(utts)).astype(np.int64)
        for c, part in enumerate(np.split(np.arange(len(utts)), cuts)):
            clients[c].extend(shuffled[i] for i in part)
    for c, utts in enumerate(clients):
        if len(utts) < cfg.min_utts:
            what = "empty" if not utts else f"with {len(utts)} utterance(s)"
            raise _refuse(
                "n_clients",
                f"Dirichlet with alpha={cfg.alpha} left client {c} {what} "
                f"(min_utts={cfg.min_utts}, {n} clients, {len(by_spk)} speakers)",
                "raise alpha, lower n_clients, or try another seed",
            )
    return [sorted(u) for u in clients]


def _quantity_skew(
    by_spk: dict[str, list[str]], cfg: PartitionConfig, rng: np.random.Generator
) -> list[list[str]]:
    n = int(cfg.n_clients or 0)
    total = sum(len(u) for u in by_spk.values())
    spare = total - n * cfg.min_utts
    if spare < 0:
        raise _refuse(
            "n_clients",
            f"{n} clients x min_utts={cfg.min_utts} needs {n * cfg.min_utts} utterances, "
            f"the corpus has {total}",
            f"use n_clients <= {total // cfg.min_utts}",
        )
    weights = np.exp(rng.normal(0.0, cfg.sigma, size=n))
    sizes = cfg.min_utts + _apportion(spare, weights)
    speakers = list(by_spk)
    sequence: list[str] = []
    for i in rng.permutation(len(speakers)):
        utts = by_spk[speakers[i]]
        sequence.extend(utts[j] for j in rng.permutation(len(utts)))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [sorted(sequence[bounds[c] : bounds[c + 1]]) for c in range(n)]


def partition_corpus(
    utt_ids: Sequence[str],
    speaker_of: Callable[[str], str],
    cfg: PartitionConfig,
    seed: int,
    exclude_speakers: Collection[str] = (),
) -> Partition:
    """Deal the utterances of non-excluded speakers out to clients per `cfg.scheme`.

    Refuses (ConfigError naming the field) any partition with a client below min_utts.
    """
    _check_config(cfg)
    by_spk, dropped = _group_by_speaker(utt_ids, speaker_of, exclude_speakers)
    total = sum(len(u) for u in by_spk.values())
    if total == 0:
        raise DataError(
            None,
            f"no training utterances left to partition ({dropped} dropped as excluded speakers)",
            "check the training data and that evaluation speakers are not the whole corpus",
        )
    if cfg.scheme in ("dirichlet", "quantity_skew") and int(cfg.n_clients or 0) > total:
        raise _refuse(
            "n_clients",
            f"n_clients={cfg.n_clients} exceeds the {total} training utterances",
            f"use n_clients <= {total}",
        )
    rng = derived_rng(seed, Purpose.PARTITION)
    if cfg.scheme == "speaker":
        clients = _speaker_scheme(by_spk, cfg)
    elif cfg.scheme == "k_speakers":
        clients = _k_speakers(by_spk, cfg, rng)
    elif cfg.scheme == "dirichlet":
        clients = _dirichlet(by_spk, cfg, rng)
    else:
        clients = _quantity_skew(by_spk, cfg, rng)
    meta = {
        "config": asdict(cfg),
        "seed": seed,
        "n_speakers": len(by_spk),
        "n_utts": total,
        "n_excluded_utts": dropped,
    }
    return Partition(clients=clients, meta=meta)
