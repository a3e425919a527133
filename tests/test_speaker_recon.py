"""Tests for speakers as local parameters (fedvox.tasks.speakers): the prototype and the public
negatives never reach the aggregator, enrollment in closed form, collapse detection (public
negatives keep unseen speakers apart, positive-only training does not), FedAwS, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from fedvox.errors import ConfigError, DataError
from fedvox.fl import (
    ClientConfig,
    FedAvg,
    FedBuff,
    ServerAdam,
    ServerSGD,
    Simulator,
    SimulatorConfig,
)
from fedvox.fl.aggregation import plain_sum
from fedvox.fl.local import ReconConfig, ReconTask, reconstruct, train_clients_recon
from fedvox.models import build_extractor
from fedvox.tasks.speakers import (
    CLASS_VECTORS,
    DOMAIN_CENTRE,
    NEGATIVES,
    PROTOTYPES,
    DomainClusters,
    FedAwSTask,
    PublicStore,
    SpeakerReconTask,
    Spreadout,
    domain_clusters,
    make_speaker_recon_update,
    make_version_broadcast,
    normalised_embeddings,
    public_prototypes,
    public_store_from_features,
    received_broadcast_update,
    speaker_population,
    speaker_separation,
    spreadout,
    spreadout_loss,
    with_negatives,
)

FEAT, FRAMES, CHUNKS = 8, 12, 8
RECON = ReconConfig(steps=0, closed_form=True)


class TinyExtractor(nn.Module):
    """Mean+std pooling → Linear → ReLU → Linear: a speaker embedding in a few hundred weights."""

    def __init__(self, feat: int = FEAT, hidden: int = 32, emb_dim: int = 16) -> None:
        super().__init__()
        self.emb_dim = emb_dim
        self.l1 = nn.Linear(2 * feat, hidden)
        self.l2 = nn.Linear(hidden, emb_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.relu(self.l1(torch.cat([x.mean(1), x.std(1)], -1))))


def toy_chunks(n_speakers: int, chunks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks [N, FRAMES, FEAT]: speaker mean in the first half of the features, a large
    per-chunk channel offset in the second half (to be learned away), unit frame noise."""
    rng = np.random.default_rng(seed)
    half = FEAT // 2
    mu = np.concatenate([rng.normal(size=(n_speakers, half)), np.zeros((n_speakers, half))], 1)
    y = np.repeat(np.arange(n_speakers), chunks)
    chan = np.concatenate([np.zeros((len(y), half)), rng.normal(scale=2.0, size=(len(y), half))], 1)
    x = mu[y][:, None] + chan[:, None] + rng.normal(size=(len(y), FRAMES, FEAT))
    return torch.tensor(x, dtype=torch.float32), torch.from_numpy(y)


def public_store(n_speakers: int = 20, seed: int = 3):
    x, y = toy_chunks(n_speakers, 2, seed)
    feats = {f"u{i:03d}": x[i].numpy() for i in range(len(x))}
    spk = {f"u{i:03d}": f"pub{int(y[i]):03d}" for i in range(len(x))}
    return public_store_from_features(feats, spk, chunks_per_speaker=2, chunk_frames=FRAMES)


def one_speaker_population(n_speakers: int = 40, seed: int = 1):
    x, y = toy_chunks(n_speakers, CHUNKS, seed)
    rows = [np.arange(i * CHUNKS, (i + 1) * CHUNKS) for i in range(n_speakers)]
    return speaker_population({"x": x, "y": y}, rows, seed=0)


def make_task(negatives: str = "public", seed: int = 0, **kw) -> SpeakerReconTask:
    torch.manual_seed(seed)
    kw.setdefault("scale", 10.0)
    kw.setdefault("margin", 0.0)
    return SpeakerReconTask(TinyExtractor(), negatives=negatives, **kw)


def simulator(task, pop, algorithm, update=None, lr=0.03, concurrency=10, **kw) -> Simulator:
    return Simulator(
        task,
        pop,
        algorithm,
        ClientConfig(batch_size=2, lr=lr),
        SimulatorConfig(concurrency=concurrency, seed=0),
        client_update=update,
        **kw,
    )


class SpySummer:
    """plain_sum that keeps what the server would see."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, deltas, weights):
        self.seen.append({n: t.clone() for n, t in deltas.items()})
        return plain_sum(deltas, weights)


# -- locality ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["fedavg", "fedbuff"])
def test_aggregator_never_sees_prototype_or_negatives(algo: str) -> None:
    pop, public, task = one_speaker_population(12), public_store(), make_task()
    assert isinstance(task, ReconTask)
    names = {"extractor." + n for n, _ in task.extractor.named_parameters()}
    assert set(task.init_params()) == names
    spy = SpySummer()
    algorithm = FedAvg(ServerSGD(1.0)) if algo == "fedavg" else FedBuff(3, ServerSGD(1.0))
    update = make_speaker_recon_update(public, RECON)
    sim = simulator(task, pop, algorithm, update, concurrency=6, summer=spy)
    params = sim.run(max_server_steps=4)
    assert set(params) == names and len(spy.seen) == 4
    for deltas in spy.seen:
        assert set(deltas) == names  # no PROTOTYPES, no NEGATIVES
        assert all(torch.isfinite(t).all() for t in deltas.values())
    assert sim.bytes_per_trip == 4 * sum(p.numel() for p in task.extractor.parameters())
    with pytest.raises(ValueError, match=PROTOTYPES):
        sim.aggregator.accumulate({**spy.seen[0], PROTOTYPES: torch.zeros(1, 1, 16)}, torch.ones(1))
    with pytest.raises(ValueError, match=NEGATIVES):
        sim.aggregator.accumulate({**spy.seen[0], NEGATIVES: torch.zeros(1, 20, 16)}, torch.ones(1))


def test_negatives_are_the_start_versions_public_prototypes_and_stay_fixed() -> None:
    pop, public, task = one_speaker_population(6), public_store(), make_task()
    v0 = task.init_params()
    v1 = {n: t + 0.05 for n, t in v0.items()}  # a later version (FedBuff: mixed start versions)
    starts = [v0, v1, v0, v1, v1, v0]
    jobs, cfg = [(c, 0) for c in range(6)], ClientConfig(batch_size=2, lr=0.03)
    update = make_speaker_recon_update(public, RECON, cache_size=1)
    got = update(task, pop, jobs, starts, cfg)
    sent = {id(v): {**v, NEGATIVES: public_prototypes(task, v, public)} for v in (v0, v1)}
    assert not torch.equal(sent[id(v0)][NEGATIVES], sent[id(v1)][NEGATIVES])
    ref = train_clients_recon(task, pop, jobs, [sent[id(v)] for v in starts], cfg, RECON)
    assert set(got.delta) == set(v0)
    assert torch.equal(ref.delta.pop(NEGATIVES), torch.zeros(6, 20, 16))  # detached: not trained
    for n in v0:
        assert torch.equal(got.delta[n], ref.delta[n])
    again = update(task, pop, jobs, starts, cfg)  # memoised negatives give the same bits
    assert all(torch.equal(again.delta[n], got.delta[n]) for n in v0)
    # the negatives matter: other (wrong) negatives give other updates
    gen = torch.Generator().manual_seed(1)
    other = {**v0, NEGATIVES: torch.randn(20, 16, generator=gen)}
    diff = train_clients_recon(task, pop, jobs, [other] * 6, cfg, RECON)
    assert not torch.equal(diff.delta["extractor.l1.weight"], ref.delta["extractor.l1.weight"])


def test_negatives_are_computed_once_per_version_across_interleaved_completions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FedBuff completes clients of ~C/K versions interleaved: each version's negatives must
    # be computed once, however the completions interleave (a small cache recomputed them).
    import fedvox.tasks.speakers.update as speakers

    calls: list[int] = []
    real = speakers.public_prototypes

    def counting(task, params, store, batch=256):
        calls.append(id(params))
        return real(task, params, store, batch)

    monkeypatch.setattr(speakers, "public_prototypes", counting)
    pop, public, task = one_speaker_population(6), public_store(), make_task()
    v0 = task.init_params()
    versions = [v0] + [{n: t + 0.01 * k for n, t in v0.items()} for k in (1, 2, 3, 4, 5)]
    update = make_speaker_recon_update(public, RECON)  # the default cache
    cfg = ClientConfig(batch_size=2, lr=0.03)
    first = None
    for rnd in range(3):  # every version completes again in each of three interleaved waves
        for k in (0, 3, 1, 5, 2, 4):
            got = update(task, pop, [(k, rnd)], [versions[k]], cfg)
            if rnd == 0 and k == 0:
                first = got
    assert sorted(calls) == sorted(id(v) for v in versions)  # once each
    again = update(task, pop, [(0, 0)], [versions[0]], cfg)
    assert all(torch.equal(again.delta[n], first.delta[n]) for n in v0)


# -- enrollment -------------------------------------------------------------------------------


def test_closed_form_is_normalised_mean_embedding_and_vmaps() -> None:
    task = make_task(max_local=3)
    g = task.init_params()
    x, _ = toy_chunks(2, 5, seed=7)
    slot = torch.tensor([0, 0, 2, 0, 2, 1, 1, 1, 0, 0])
    mask = torch.tensor([1, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.float32)
    batches = {"x": x.view(2, 5, FRAMES, FEAT), "slot": slot.view(2, 5)}
    stacked = vmap(task.closed_form_local, in_dims=(None, 0, 0))(g, batches, mask.view(2, 5))
    with torch.no_grad():
        e = F.normalize(task.extractor(x), dim=-1)
    for c in range(2):
        for j in range(3):
            rows = [i for i in range(5 * c, 5 * c + 5) if slot[i] == j and mask[i] == 1]
            want = F.normalize(e[rows].sum(0), dim=0) if rows else torch.zeros(16)
            torch.testing.assert_close(stacked[PROTOTYPES][c, j], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(stacked[PROTOTYPES][0, 1], torch.zeros(16))  # client 0: no slot-1 chunk


def test_reconstruct_is_enrollment_on_unseen_clients() -> None:
    pop, task = one_speaker_population(5, seed=9), make_task()
    params = task.init_params()
    protos = reconstruct(task, pop, params, RECON, part="all")[PROTOTYPES]
    with torch.no_grad():
        e = F.normalize(task.extractor(pop.store["x"]), dim=-1)
    want = F.normalize(e.view(5, CHUNKS, -1).mean(1), dim=-1)
    torch.testing.assert_close(protos[:, 0], want, rtol=1e-5, atol=1e-6)


def test_loss_at_collapse_is_chance_level_and_positive_only_is_zero() -> None:
    """The module docstring's argument: a constant extractor gives log(1 + P e^{s(1−cos m)})
    with public negatives, but 0 (its minimum) for the positive-only loss."""
    public = public_store(20)
    batch = {"x": toy_chunks(1, 4, seed=5)[0], "slot": torch.zeros(4, dtype=torch.long)}
    for margin in (0.0, 0.2):
        task = make_task(scale=30.0, margin=margin)
        with torch.no_grad():
            task.extractor.l2.weight.zero_()  # every input → the bias: total collapse
        g = task.init_params()
        local = task.closed_form_local(g, batch, torch.ones(4))
        per = task.loss({**with_negatives(task, g, public), **local}, batch)
        want = math.log(1 + 20 * math.exp(30.0 * (1 - math.cos(margin))))
        # atol: AAM's sin² floor (as heads.AAMSoftmax) shifts cos(θ+m) by ~3e-4·sin m at θ = 0
        torch.testing.assert_close(per, torch.full((4,), want), rtol=0, atol=3e-3)
    pos = make_task("none")
    with torch.no_grad():
        pos.extractor.l2.weight.zero_()
    g = pos.init_params()
    per = pos.loss({**g, **pos.closed_form_local(g, batch, torch.ones(4))}, batch)
    torch.testing.assert_close(per, torch.zeros(4), rtol=0, atol=1e-6)


# -- collapse detection -----------------------------------------------------------------------


def _train(negatives: str, rounds: int = 30) -> tuple[dict, dict]:
    pop, public, task = one_speaker_population(), public_store(), make_task(negatives)
    unseen_x, unseen_y = toy_chunks(12, CHUNKS, seed=2)
    sim = simulator(task, pop, FedAvg(ServerSGD(1.0)), make_speaker_recon_update(public, RECON))
    before = speaker_separation(task, sim.params, unseen_x, unseen_y)
    after = speaker_separation(task, sim.run(max_server_steps=rounds), unseen_x, unseen_y)
    return before, after


def test_public_negatives_keep_unseen_speakers_apart() -> None:
    """Margin 0 (make_task): an AAM margin from the first round narrows the cone of all
    embeddings (spread falls) even though unseen speakers stay separable."""
    before, after = _train("public")
    assert after["spread"] >= before["spread"]  # no collapse: prototypes at least as far apart
    assert after["eer"] < before["eer"] - 0.1
    assert after["accuracy"] > before["accuracy"] + 0.2


def test_positive_only_collapses_and_the_test_sees_it() -> None:
    before, after = _train("none")
    assert after["spread"] < 0.3 * before["spread"]


# -- cross-silo (several speakers per client) and refusals ------------------------------------


@pytest.mark.parametrize("negatives", ["local", "public"])
def test_several_speakers_per_client(negatives: str) -> None:
    x, y = toy_chunks(12, 6, seed=4)
    rows = [np.arange(i * 18, (i + 1) * 18) for i in range(4)]  # 3 speakers per silo
    pop = speaker_population({"x": x, "y": y}, rows, max_local=3)
    assert pop.store["slot"][:18].tolist() == [0] * 6 + [1] * 6 + [2] * 6
    task = make_task(negatives, max_local=3)
    sim = simulator(
        task,
        pop,
        FedAvg(ServerSGD(1.0)),
        make_speaker_recon_update(public_store(), RECON),
        concurrency=4,
    )
    params = sim.run(max_server_steps=3)
    assert set(params) == set(task.init_params())
    assert all(torch.isfinite(t).all() for t in params.values())
    assert not torch.equal(params["extractor.l1.weight"], task.init_params()["extractor.l1.weight"])


def test_refusals() -> None:
    x, y = toy_chunks(4, 2, seed=0)
    with pytest.raises(ConfigError, match="max_local"):
        speaker_population({"x": x, "y": y}, [np.arange(4), np.arange(4, 8)])
    with pytest.raises(ConfigError, match="several speakers"):
        make_task("local")
    with pytest.raises(ConfigError, match="closed_form"):
        make_speaker_recon_update(public_store(), ReconConfig(steps=1))
    task = make_task()
    g = task.init_params()
    batch = {"x": x[:2], "slot": torch.zeros(2, dtype=torch.long)}
    with pytest.raises(ConfigError, match="public negatives"):
        task.loss({**g, **task.closed_form_local(g, batch, torch.ones(2))}, batch)
    with pytest.raises(DataError, match="chunks"):
        public_store_from_features(
            {"a": np.zeros((5, FEAT))}, {"a": "s"}, chunks_per_speaker=2, chunk_frames=5
        )


def test_public_store_takes_first_chunks_in_order() -> None:
    feats = {
        "s1-b": np.full((4, 2), 2.0),  # one chunk, its last frame dropped
        "s1-a": np.full((2, 2), 1.0),  # shorter than a chunk: tiled
        "s0-a": np.full((6, 2), 0.0),  # two chunks
        "s2-a": np.full((6, 2), 3.0),  # beyond n_speakers
    }
    store = public_store_from_features(
        feats, lambda u: u[:2], n_speakers=2, chunks_per_speaker=2, chunk_frames=3
    )
    assert store.speakers == ("s0", "s1") and store.x.shape == (4, 3, 2)
    assert store.y.tolist() == [0, 0, 1, 1]
    assert store.x[:, :, 0].tolist() == [[0.0] * 3, [0.0] * 3, [1.0] * 3, [2.0] * 3]
    assert store.broadcast_bytes(256) == 2 * 256 * 4


def test_real_xvector_extractor_trains_under_vmap() -> None:
    torch.manual_seed(0)
    ext = build_extractor(
        "xvector-small", FEAT, norm="layer", widths=(16, 16, 16, 16, 32), emb_dim=16
    )
    x, y = toy_chunks(6, 4, seed=1)
    x = x.repeat(1, 2, 1)  # 24 frames: the x-vector consumes 14
    pop = speaker_population({"x": x, "y": y}, [np.arange(i * 4, (i + 1) * 4) for i in range(6)])
    px, py = toy_chunks(5, 2, seed=3)
    public = public_store_from_features(
        {f"u{i}": px[i].repeat(2, 1).numpy() for i in range(10)},
        {f"u{i}": str(int(py[i])) for i in range(10)},
        chunk_frames=24,
    )
    task = SpeakerReconTask(ext, scale=10.0, margin=0.0)
    sim = simulator(
        task, pop, FedAvg(ServerSGD(1.0)), make_speaker_recon_update(public, RECON), concurrency=3
    )
    params = sim.run(max_server_steps=2)
    assert all(torch.isfinite(t).all() for t in params.values())


# -- determinism ------------------------------------------------------------------------------


def test_same_seed_same_bits_and_resume_is_bit_identical() -> None:
    pop, public = one_speaker_population(16), public_store()

    def fresh() -> Simulator:
        task = make_task(margin=0.1)
        algorithm = FedBuff(3, ServerSGD(1.0, momentum=0.9))
        return simulator(
            task, pop, algorithm, make_speaker_recon_update(public, RECON), concurrency=6
        )

    a, b = fresh(), fresh()
    pa, pb = a.run(max_server_steps=6), b.run(max_server_steps=6)
    c = fresh()
    c.run(max_server_steps=3)
    state = c.state_dict()
    d = fresh()  # a new process: fresh negatives cache, versions as loaded
    d.load_state_dict(state)
    pd = d.run(max_server_steps=6)
    for n in pa:
        assert torch.equal(pa[n], pb[n]) and torch.equal(pa[n], pd[n])


def _broadcasting(pop, public, every: int, record: list[int] | None = None) -> Simulator:
    """FedBuff with the simulator computing each version's broadcast (every `every`
    versions); `record` counts the broadcasts computed."""
    task = make_task()
    make = make_version_broadcast(task, public)

    def broadcast(params):
        if record is not None:
            record.append(len(record))
        return make(params)

    return simulator(
        task,
        pop,
        FedBuff(3, ServerSGD(1.0)),
        received_broadcast_update(RECON),
        concurrency=6,
        broadcast=broadcast,
        broadcast_every=every,
    )


def test_simulator_broadcast_is_the_memoised_update_bit_for_bit() -> None:
    # the server's broadcast per version + the device half = the one-piece client update
    pop, public = one_speaker_population(16), public_store()
    task = make_task()
    alg = FedBuff(3, ServerSGD(1.0))
    ref = simulator(task, pop, alg, make_speaker_recon_update(public, RECON), concurrency=6)
    want = ref.run(max_server_steps=6)
    got = _broadcasting(pop, public, every=1).run(max_server_steps=6)
    for n in want:
        assert torch.equal(want[n], got[n])


def test_broadcast_every_reuses_the_last_refresh_and_resumes_bit_identically() -> None:
    pop, public = one_speaker_population(16), public_store()
    computed_1: list[int] = []
    computed_3: list[int] = []
    p1 = _broadcasting(pop, public, 1, computed_1).run(max_server_steps=9)
    sim = _broadcasting(pop, public, 3, computed_3)
    p3 = sim.run(max_server_steps=9)
    # one broadcast per version that trips started from vs one per three versions
    assert len(computed_1) >= 9 and len(computed_3) == math.ceil(len(computed_1) / 3)
    assert any(not torch.equal(p1[n], p3[n]) for n in p1)  # stale negatives train otherwise
    # only the refreshes still in use are held
    assert set(sim._broadcasts) <= set(sim._broadcast_of.values()) | {sim._refreshed}
    assert all(r <= v < r + 3 for v, r in sim._broadcast_of.items())
    half = _broadcasting(pop, public, 3)
    half.run(max_server_steps=4)
    resumed = _broadcasting(pop, public, 3)
    resumed.load_state_dict(half.state_dict())
    pr = resumed.run(max_server_steps=9)
    for n in p3:
        assert torch.equal(p3[n], pr[n])


def test_broadcast_every_below_one_is_refused() -> None:
    pop, public = one_speaker_population(8), public_store()
    with pytest.raises(ConfigError, match="broadcast_every"):
        _broadcasting(pop, public, 0)


# -- FedAwS -----------------------------------------------------------------------------------


def test_spreadout_pushes_close_class_vectors_apart() -> None:
    gen = torch.Generator().manual_seed(0)
    w = F.normalize(torch.ones(10, 16) + 0.1 * torch.randn(10, 16, generator=gen), dim=-1)

    def min_dist(v: torch.Tensor) -> float:
        vn = F.normalize(v, dim=-1)
        d = torch.cdist(vn, vn) + 10 * torch.eye(len(v))
        return float(d.min())

    new = spreadout(w, nu=1.0, lr=0.1, steps=20)
    assert min_dist(new) > 2 * min_dist(w)
    assert float(spreadout_loss(new, 1.0)) < float(spreadout_loss(w, 1.0))
    assert torch.equal(spreadout(w, 1.0, 0.1, 20), new)  # deterministic


@pytest.mark.parametrize("opt", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("inner", ["fedavg", "fedbuff"])
def test_spreadout_wraps_any_algorithm_step_then_spreadout(opt: str, inner: str) -> None:
    def make():
        server = ServerSGD(1.0, momentum=0.9) if opt == "sgd-momentum" else ServerAdam(lr=0.01)
        return FedAvg(server) if inner == "fedavg" else FedBuff(2, server, staleness="sqrt")

    algo, ref = Spreadout(make(), nu=1.5, spread_lr=0.2, spread_steps=3), make()
    # weights, barrier, buffer size and refusals are the inner algorithm's
    assert algo.barrier == ref.barrier and algo.updates_per_step(8) == ref.updates_per_step(8)
    n, tau = torch.tensor([3, 5]), torch.tensor([0, 4])
    assert torch.equal(algo.client_weights(n, tau), ref.client_weights(n, tau))
    if inner == "fedbuff":
        with pytest.raises(ConfigError, match="buffer_size"):
            algo.validate(1)
    gen = torch.Generator().manual_seed(0)
    params = {CLASS_VECTORS: torch.randn(6, 4, generator=gen), "b": torch.randn(3, generator=gen)}
    total = {n: torch.randn(t.shape, generator=gen) for n, t in params.items()}
    for _ in range(2):  # twice: the optimiser's state carries over as usual
        new = algo.apply(params, total, 2.0, 2, [params], tau)
        want = ref.apply(params, total, 2.0, 2, [params], tau)
        assert torch.equal(new["b"], want["b"])
        assert torch.equal(new[CLASS_VECTORS], spreadout(want[CLASS_VECTORS], 1.5, 0.2, 3))
        params = new
    # a checkpoint is the inner algorithm's: a restored wrapper continues identically
    again = Spreadout(make(), nu=1.5, spread_lr=0.2, spread_steps=3)
    again.load_state_dict(algo.state_dict())
    a = algo.apply(params, total, 2.0, 2, [params], tau)
    b = again.apply(params, total, 2.0, 2, [params], tau)
    assert all(torch.equal(a[n], b[n]) for n in a)
    if inner == "fedavg":
        same = algo.apply(params, total, 0.0, 0, [params], torch.zeros(0))  # nothing aggregated
        assert all(torch.equal(same[n], params[n]) for n in params)
    with pytest.raises(ConfigError, match="class_key"):
        Spreadout(make(), class_key="nope").apply(params, total, 2.0, 2, [params], tau)


@pytest.mark.parametrize("algo", ["fedavg", "fedbuff"])
def test_fedaws_simulator_spreads_class_vectors(algo: str) -> None:
    pop = one_speaker_population(20)

    def run(spread: bool) -> float:
        torch.manual_seed(0)
        task = FedAwSTask(TinyExtractor(), 20, seed=0)
        kw = {"nu": 1.2, "spread_lr": 0.5}
        if algo == "fedavg":
            alg = FedAvg(ServerSGD(1.0))
        else:
            alg = FedBuff(5, ServerSGD(1.0))
        if spread:
            alg = Spreadout(alg, **kw)
        w = F.normalize(
            simulator(task, pop, alg, lr=0.1).run(max_server_steps=15)[CLASS_VECTORS], dim=-1
        )
        return float((torch.cdist(w, w) + 10 * torch.eye(20)).min())

    assert run(spread=True) > run(spread=False) + 0.1


# -- domain centring --------------------------------------------------------------------------


class OffsetEmbedder:
    """Embeddings = a per-speaker direction plus one large direction shared by everyone."""

    def __init__(self, dim: int = 16, shared: float = 10.0) -> None:
        self.shared = torch.zeros(dim)
        self.shared[0] = shared

    def embed(self, params, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)[:, : self.shared.numel()] + self.shared


def test_centred_public_prototypes_remove_the_domain_direction() -> None:
    torch.manual_seed(0)
    dim, speakers = 16, 12
    y = torch.arange(speakers).repeat_interleave(2)
    x = torch.randn(speakers, 1, dim)[y] + 0.05 * torch.randn(len(y), 3, dim)
    store = PublicStore(x, y, tuple(f"p{i}" for i in range(speakers)))
    emb = OffsetEmbedder(dim)

    def mean_cos(p: torch.Tensor) -> float:
        c = p @ p.T
        return float((c.sum() - c.trace()) / (speakers * (speakers - 1)))

    assert mean_cos(public_prototypes(emb, {}, store)) > 0.8  # the shared direction dominates
    assert abs(mean_cos(public_prototypes(emb, {}, store, centred=True))) < 0.15


def test_domain_centre_is_broadcast_per_version_and_changes_training() -> None:
    pop, public, task = one_speaker_population(6), public_store(), make_task()
    v0 = task.init_params()
    jobs, cfg = [(c, 0) for c in range(6)], ClientConfig(batch_size=2, lr=0.03)
    panel = pop.store["x"][::CHUNKS]  # the first chunk of every device
    centred = make_speaker_recon_update(public, RECON, centre_panel=panel)
    got = centred(task, pop, jobs, [v0] * 6, cfg)
    assert set(got.delta) == set(v0)  # neither the centre nor the negatives go up
    centre = normalised_embeddings(task, v0, panel).mean(0)
    sent = {
        **v0,
        NEGATIVES: public_prototypes(task, v0, public, centred=True),
        DOMAIN_CENTRE: centre,
    }
    ref = train_clients_recon(task, pop, jobs, [sent] * 6, cfg, RECON)
    assert all(torch.equal(got.delta[n], ref.delta[n]) for n in v0)
    plain = make_speaker_recon_update(public, RECON)(task, pop, jobs, [v0] * 6, cfg)
    assert not torch.equal(plain.delta["extractor.l1.weight"], got.delta["extractor.l1.weight"])
    # enrollment under the centre: the normalised mean of centred, normalised embeddings
    batch = pop.gather(np.arange(CHUNKS))
    proto = task.closed_form_local(sent, batch, torch.ones(CHUNKS))[PROTOTYPES][0]
    e = F.normalize(F.normalize(task.embed(v0, batch["x"]), dim=-1) - centre, dim=-1)
    assert torch.allclose(proto, F.normalize(e.mean(0), dim=0), atol=1e-6)


def test_domain_clusters_find_the_groups_and_drop_small_ones() -> None:
    torch.manual_seed(0)
    dim = 16
    centres = F.normalize(torch.randn(3, dim), dim=-1)
    sizes = (40, 25, 4)  # the third group is below min_size: never revealed
    e = F.normalize(
        torch.cat([c + 0.1 * torch.randn(n, dim) for c, n in zip(centres, sizes, strict=True)]),
        dim=-1,
    )
    seeds = F.normalize(torch.randn(20, dim), dim=-1)  # the server's own vectors
    full = domain_clusters(e, seeds, k=3, min_size=10)
    assert full.shape == (3, dim)  # always k rows: the same broadcast shape every version
    kept = full.abs().sum(-1) > 0
    assert int(kept.sum()) == 2  # the small cluster is an all-zero (absent) row
    got = full[kept]
    # each kept centroid is the normalised mean of one big group, found from the seeds alone
    want = [F.normalize(g.mean(0), dim=0) for g in (e[:40], e[40:65])]
    for w in want:
        assert max(float(c @ w) for c in got) > 0.999
    assert torch.equal(full, domain_clusters(e, seeds, k=3, min_size=10))  # deterministic
    with pytest.raises(ConfigError, match="panel"):
        DomainClusters(torch.zeros(9, 1, dim), k=4, min_size=10)


def test_device_clusters_are_appended_to_the_negatives() -> None:
    pop, public, task = one_speaker_population(6), public_store(), make_task()
    v0 = task.init_params()
    jobs, cfg = [(c, 0) for c in range(6)], ClientConfig(batch_size=2, lr=0.03)
    panel = pop.store["x"][::CHUNKS]
    clusters = DomainClusters(panel, k=2, min_size=1)
    got = make_speaker_recon_update(public, RECON, clusters=clusters)(
        task, pop, jobs, [v0] * 6, cfg
    )
    assert set(got.delta) == set(v0)
    pub = public_prototypes(task, v0, public)
    cent = domain_clusters(normalised_embeddings(task, v0, panel), pub, k=2, min_size=1)
    assert cent.shape[0] == 2
    sent = {**v0, NEGATIVES: torch.cat([pub, cent])}
    ref = train_clients_recon(task, pop, jobs, [sent] * 6, cfg, RECON)
    assert all(torch.equal(got.delta[n], ref.delta[n]) for n in v0)
    plain = make_speaker_recon_update(public, RECON)(task, pop, jobs, [v0] * 6, cfg)
    assert not torch.equal(plain.delta["extractor.l1.weight"], got.delta["extractor.l1.weight"])


def test_absent_cluster_rows_are_skipped_and_versions_batch_together() -> None:
    pop, public, task = one_speaker_population(6), public_store(), make_task()
    v0 = task.init_params()
    v1 = {n: t + 0.01 for n, t in v0.items()}
    jobs, cfg = [(c, 0) for c in range(6)], ClientConfig(batch_size=2, lr=0.03)
    pub = public_prototypes(task, v0, public)
    cent = F.normalize(torch.randn(2, pub.shape[1], generator=torch.Generator().manual_seed(1)))
    # one version with two clusters, the other with one present and one absent (zero) row
    a = {**v0, NEGATIVES: torch.cat([pub, cent])}
    b = {**v1, NEGATIVES: torch.cat([pub, cent[:1], torch.zeros_like(cent[:1])])}
    got = train_clients_recon(task, pop, jobs, [a, a, a, b, b, b], cfg, RECON)
    # an absent row changes nothing: the same as sending only the present rows
    b_short = {**v1, NEGATIVES: torch.cat([pub, cent[:1]])}
    ref = train_clients_recon(task, pop, jobs[3:], [b_short] * 3, cfg, RECON)
    for n in v0:
        assert torch.allclose(got.delta[n][3:], ref.delta[n], atol=1e-6)
