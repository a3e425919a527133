"""Client partitioners: invariants of every scheme, determinism, exclusion, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedvox.data.partition import Partition, PartitionConfig, partition_corpus
from fedvox.errors import ConfigError, DataError


def make_corpus(n_spk: int, n_utt: int | list[int]) -> tuple[list[str], dict[str, str]]:
    counts = [n_utt] * n_spk if isinstance(n_utt, int) else n_utt
    utt2spk = {f"s{s:03d}-u{u:03d}": f"s{s:03d}" for s in range(n_spk) for u in range(counts[s])}
    return list(utt2spk), utt2spk


def assert_exact_cover(part: Partition, utts: list[str], utt2spk: dict, excluded=()) -> None:
    """Every utterance of a non-excluded speaker on exactly one client, nothing else."""
    flat = [u for c in part.clients for u in c]
    assert len(flat) == len(set(flat))
    assert set(flat) == {u for u in utts if utt2spk[u] not in set(excluded)}
    assert all(c == sorted(c) and c for c in part.clients)
    assert part.sizes().sum() == len(flat)


def test_speaker_scheme_one_speaker_per_device():
    utts, u2s = make_corpus(7, [3, 1, 4, 1, 5, 9, 2])
    part = partition_corpus(utts, u2s.__getitem__, PartitionConfig(), seed=0)
    assert_exact_cover(part, utts, u2s)
    assert len(part) == 7
    assert [part.speakers_of(c, u2s.__getitem__) for c in range(7)] == [
        [f"s{s:03d}"] for s in range(7)
    ]
    assert part.sizes().tolist() == [3, 1, 4, 1, 5, 9, 2]
    cof = part.client_of()
    assert cof["s005-u008"] == 5 and len(cof) == len(utts)


def test_k_speakers_k_per_client_last_gets_remainder():
    utts, u2s = make_corpus(11, 4)
    part = partition_corpus(utts, u2s.__getitem__, PartitionConfig("k_speakers", k=3), seed=1)
    assert_exact_cover(part, utts, u2s)
    n_spk = [len(part.speakers_of(c, u2s.__getitem__)) for c in range(len(part))]
    assert n_spk == [3, 3, 3, 2]  # 11 = 3+3+3+2: the last client holds the remainder
    # speakers are kept whole
    owners = {}
    for c in range(len(part)):
        for s in part.speakers_of(c, u2s.__getitem__):
            assert s not in owners
            owners[s] = c
    # the grouping is shuffled, not alphabetical runs of speakers
    part2 = partition_corpus(utts, u2s.__getitem__, PartitionConfig("k_speakers", k=3), seed=2)
    assert part.clients != part2.clients


def test_dirichlet_cover_and_alpha_controls_skew():
    utts, u2s = make_corpus(40, 30)

    def skew(alpha: float) -> tuple[float, float]:
        """(mean speakers per client, mean share of a speaker on its main client)."""
        cfg = PartitionConfig("dirichlet", n_clients=5, alpha=alpha)
        part = partition_corpus(utts, u2s.__getitem__, cfg, seed=3)
        assert_exact_cover(part, utts, u2s)
        assert len(part) == 5
        spk_per_client = np.mean([len(part.speakers_of(c, u2s.__getitem__)) for c in range(5)])
        cof = part.client_of()
        counts = np.zeros((40, 5))
        for u in utts:
            counts[int(u2s[u][1:]), cof[u]] += 1
        return float(spk_per_client), float((counts.max(1) / counts.sum(1)).mean())

    # alpha -> inf: every client gets a near-equal share (1/5) of every speaker;
    # alpha -> 0: each speaker sits on ~one client (about 40/5 = 8 speakers per client).
    spc, share = skew(1000.0)
    assert spc == 40.0 and share < 0.25
    spc, share = skew(0.01)
    assert spc < 12.0 and share > 0.9


def test_dirichlet_large_alpha_near_uniform_sizes():
    utts, u2s = make_corpus(40, 30)
    cfg = PartitionConfig("dirichlet", n_clients=4, alpha=1000.0)
    sizes = partition_corpus(utts, u2s.__getitem__, cfg, seed=0).sizes()
    assert np.all(np.abs(sizes - 300) <= 30)


def test_quantity_skew_has_configured_spread_and_keeps_speakers_whole():
    utts, u2s = make_corpus(100, 100)  # 10,000 utterances over 200 clients
    cfg = PartitionConfig("quantity_skew", n_clients=200, sigma=1.0)
    part = partition_corpus(utts, u2s.__getitem__, cfg, seed=4)
    assert_exact_cover(part, utts, u2s)
    sizes = part.sizes()
    assert len(sizes) == 200 and sizes.min() >= 1
    assert abs(np.log(sizes).std() - 1.0) < 0.2  # std of log sizes ~ sigma
    # at most n_clients - 1 cuts, each splitting one speaker over two clients
    n_owners = [
        len({c for c, cl in enumerate(part.clients) for u in cl if u2s[u] == s})
        for s in sorted(set(u2s.values()))
    ]
    assert sum(n - 1 for n in n_owners) <= 199

    flat = partition_corpus(
        utts, u2s.__getitem__, PartitionConfig("quantity_skew", n_clients=200, sigma=0.0), 4
    ).sizes()
    assert flat.tolist() == [50] * 200  # sigma = 0: equal shares


def test_quantity_skew_min_utts_floor():
    utts, u2s = make_corpus(10, 10)
    cfg = PartitionConfig("quantity_skew", n_clients=20, sigma=3.0, min_utts=4)
    sizes = partition_corpus(utts, u2s.__getitem__, cfg, seed=0).sizes()
    assert sizes.min() >= 4 and sizes.sum() == 100


@pytest.mark.parametrize(
    "cfg",
    [
        PartitionConfig("k_speakers", k=3),
        PartitionConfig("dirichlet", n_clients=4, alpha=0.5),
        PartitionConfig("quantity_skew", n_clients=6),
    ],
)
def test_random_schemes_deterministic_and_order_independent(cfg):
    utts, u2s = make_corpus(12, 10)
    a = partition_corpus(utts, u2s.__getitem__, cfg, seed=7)
    b = partition_corpus(list(reversed(utts)), u2s.__getitem__, cfg, seed=7)
    rng = np.random.default_rng(0)
    c = partition_corpus(
        [utts[i] for i in rng.permutation(len(utts))], u2s.__getitem__, cfg, seed=7
    )
    assert a.clients == b.clients == c.clients
    d = partition_corpus(utts, u2s.__getitem__, cfg, seed=8)
    assert d.clients != a.clients


def test_speaker_scheme_order_independent():
    utts, u2s = make_corpus(5, 3)
    a = partition_corpus(utts, u2s.__getitem__, PartitionConfig(), seed=0)
    b = partition_corpus(utts[::-1], u2s.__getitem__, PartitionConfig(), seed=99)
    assert a.clients == b.clients


@pytest.mark.parametrize(
    "cfg",
    [
        PartitionConfig(),
        PartitionConfig("k_speakers", k=2),
        PartitionConfig("dirichlet", n_clients=3, alpha=5.0),
        PartitionConfig("quantity_skew", n_clients=3),
    ],
)
def test_excluded_speakers_never_reach_a_client(cfg):
    utts, u2s = make_corpus(8, 6)
    held_out = {"s002", "s005"}
    part = partition_corpus(utts, u2s.__getitem__, cfg, seed=0, exclude_speakers=held_out)
    assert_exact_cover(part, utts, u2s, excluded=held_out)
    assert not {u2s[u] for c in part.clients for u in c} & held_out
    assert part.meta["n_excluded_utts"] == 12


def test_json_round_trip(tmp_path):
    utts, u2s = make_corpus(9, 5)
    cfg = PartitionConfig("dirichlet", n_clients=3, alpha=2.0)
    part = partition_corpus(utts, u2s.__getitem__, cfg, seed=5)
    path = tmp_path / "sub" / "partition.json"
    part.save(path)
    back = Partition.load(path)
    assert back == part
    assert back.meta["config"]["scheme"] == "dirichlet" and back.meta["seed"] == 5
    assert Partition.from_json(json.loads(path.read_text())).clients == part.clients
    assert not list(path.parent.glob(".*.tmp"))  # atomic write leaves no temp file


def test_load_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"bad\.json:1"):
        Partition.load(bad)
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps({"clients": [["a", "b"], ["b"]]}))
    with pytest.raises(DataError, match="'b' is on clients 0 and 1"):
        Partition.load(dup)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"clients": [["a"], []]}))
    with pytest.raises(DataError, match="client 1 holds no utterances"):
        Partition.load(empty)


def test_dirichlet_small_alpha_empty_client_refused():
    utts, u2s = make_corpus(3, 4)
    cfg = PartitionConfig("dirichlet", n_clients=8, alpha=0.01)
    with pytest.raises(
        ConfigError, match=r"federated\.partition\.n_clients.*alpha=0\.01 left client \d+ empty"
    ):
        partition_corpus(utts, u2s.__getitem__, cfg, seed=0)


def test_refusals():
    utts, u2s = make_corpus(4, 3)
    get = u2s.__getitem__
    with pytest.raises(ConfigError, match=r"n_clients.*exceeds the 12"):
        partition_corpus(utts, get, PartitionConfig("dirichlet", n_clients=13), 0)
    with pytest.raises(ConfigError, match=r"n_clients.*exceeds the 12"):
        partition_corpus(utts, get, PartitionConfig("quantity_skew", n_clients=13), 0)
    with pytest.raises(ConfigError, match=r"n_clients"):
        partition_corpus(utts, get, PartitionConfig("quantity_skew", n_clients=5, min_utts=3), 0)
    with pytest.raises(ConfigError, match=r"n_clients"):
        partition_corpus(utts, get, PartitionConfig("dirichlet"), 0)
    with pytest.raises(ConfigError, match=r"partition\.k.*only 4"):
        partition_corpus(utts, get, PartitionConfig("k_speakers", k=5), 0)
    with pytest.raises(ConfigError, match=r"partition\.scheme"):
        partition_corpus(utts, get, PartitionConfig("iid"), 0)
    with pytest.raises(ConfigError, match=r"min_utts.*'s000' has 3"):
        partition_corpus(utts, get, PartitionConfig(min_utts=4), 0)
    with pytest.raises(ConfigError, match=r"min_utts"):
        partition_corpus(utts, get, PartitionConfig(min_utts=0), 0)
    with pytest.raises(DataError, match="no training utterances"):
        partition_corpus(utts, get, PartitionConfig(), 0, exclude_speakers=set(u2s.values()))
    with pytest.raises(DataError, match="listed twice"):
        partition_corpus([*utts, utts[0]], get, PartitionConfig(), 0)
    with pytest.raises(DataError, match="no speaker for utterance 'ghost'"):
        partition_corpus([*utts, "ghost"], get, PartitionConfig(), 0)
