"""train.device: the field, the error without CUDA, the deterministic settings in the manifest,
the client update placed on a device; the CUDA paths themselves run only where CUDA is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_fl_toys import class_population, mlp_task

from fedvox import device as dev
from fedvox.errors import ConfigError
from fedvox.experiment import config as config_module
from fedvox.experiment.config import ExperimentConfig, config_from_dict
from fedvox.experiment.runfolder import RunFolder
from fedvox.fl import ClientConfig, FedAvg, FedBuff, ServerSGD, Simulator, SimulatorConfig
from fedvox.fl.local.placement import on_device, task_settings
from fedvox.fl.simulator import plain_client_update
from fedvox.models import AAMSoftmax
from fedvox.training.centralised import CentralisedConfig, ModelConfig, TrainConfig

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="no CUDA device: torch.cuda.is_available() is false"
)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_device_field_accepts_cpu_and_cuda_and_names_itself_otherwise() -> None:
    assert config_from_dict({"train": {"device": "cuda:1"}}).train.device == "cuda:1"
    assert ExperimentConfig().train.device == "cpu"
    with pytest.raises(ConfigError, match=r"train\.device"):
        config_from_dict({"train": {"device": "gpu"}})
    with pytest.raises(ConfigError, match=r"train\.device"):
        dev.check_device_name("cuda0")
    # the config repeats the pattern so loading a config imports no torch: keep them equal
    assert config_module.DEVICE_PATTERN == dev.DEVICE_PATTERN


def test_cuda_without_a_gpu_is_a_fedvox_error_naming_the_field_and_the_fix(no_cuda) -> None:
    with pytest.raises(ConfigError) as err:
        dev.resolve_device("cuda")
    text = str(err.value)
    assert "train.device" in text and "torch.cuda.is_available() is false" in text
    assert '"cpu"' in text and "--device cpu" in text
    assert dev.resolve_device("cpu") == torch.device("cpu")


def test_a_run_asking_for_cuda_without_one_fails_before_any_work(no_cuda, tmp_path: Path) -> None:
    from fedvox.experiment.runner import run_experiment

    cfg = config_from_dict({"train": {"device": "cuda"}})
    with pytest.raises(ConfigError, match=r"train\.device"):
        run_experiment(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_manifest_records_the_device_and_the_deterministic_settings(tmp_path: Path) -> None:
    m = RunFolder.create(tmp_path / "cpu", ExperimentConfig()).manifest()
    assert m["device"] == "cpu"
    assert m["determinism"] == {
        "device": "cpu",
        "deterministic_algorithms": True,
        "mixed_precision": False,
    }
    # a GPU run's manifest (written before training starts, so no GPU is needed to write it)
    cfg = config_from_dict({"train": {"device": "cuda"}})
    m = RunFolder.create(tmp_path / "gpu", cfg).manifest()
    assert m["device"] == "cuda"
    d = m["determinism"]
    assert d["cublas_workspace_config"] == ":4096:8"
    assert d["cudnn_deterministic"] is True and d["cudnn_benchmark"] is False
    assert d["allow_tf32"] is False and d["deterministic_algorithms"] is True


def test_set_determinism_applies_what_it_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    threads = torch.get_num_threads()
    try:
        got = dev.set_determinism(1, "cuda")  # switches only: no GPU is touched
        assert got == dev.determinism_settings("cuda")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.get_num_threads() == 1
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_num_threads(threads)


def test_the_config_hash_ignores_the_default_device_workers_packing_and_the_backend() -> None:
    import hashlib
    import json

    cfg = config_from_dict({"federated": {}})
    d = cfg.to_dict()
    del d["train"]["device"]
    del d["train"]["workers"]
    del d["train"]["init_from"]
    d["federated"].pop("backend", None)
    del d["federated"]["pack_clients"]
    del d["federated"]["reconstruction"]["broadcast_every"]
    del d["federated"]["reconstruction"]["panel"]
    old = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    assert cfg.hash() == old  # run folders from before these fields keep their hash
    assert config_from_dict({"federated": {}, "train": {"device": "cuda"}}).hash() != old
    assert config_from_dict({"federated": {"pack_clients": True}}).hash() != old  # other bits
    stale = {"federated": {"reconstruction": {"broadcast_every": 10}}}
    assert config_from_dict(stale).hash() != old
    held = {"federated": {"reconstruction": {"panel": "held_out"}}}
    assert config_from_dict(held).hash() != old  # other devices train
    one = config_from_dict({})
    assert config_from_dict({"train": {"workers": 2}}).hash() != one.hash()  # decides bits
    assert config_from_dict({"train": {"init_from": "public"}}).hash() != one.hash()


def _sim(update=None, algorithm: str = "fedavg", lowrank: bool | None = None) -> Simulator:
    algo = FedAvg(ServerSGD(1.0)) if algorithm == "fedavg" else FedBuff(3, ServerSGD(1.0))
    return Simulator(
        mlp_task(d=6, h=40),
        class_population([6 + (c % 7) for c in range(16)], seed=1),
        algo,
        ClientConfig(batch_size=4, lr=0.2, lowrank=lowrank),
        SimulatorConfig(concurrency=6, seed=2),
        client_update=update,
    )


def test_on_device_cpu_gives_the_plain_bits_and_follows_task_settings() -> None:
    want = _sim().run(max_server_steps=3)
    got = _sim(on_device(plain_client_update, "cpu")).run(max_server_steps=3)
    assert all(torch.equal(want[n], got[n]) for n in want)
    head = AAMSoftmax(4, 3, scale=10.0, margin=0.1)
    before = task_settings(head)
    head.set_margin(0.2)
    assert task_settings(head) != before  # a copy held elsewhere is refreshed


def test_checkpoint_tensors_are_moved_to_the_cpu() -> None:
    state = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), 3)], "c": "x"}
    out = dev.to_cpu(state)
    assert torch.equal(out["a"], state["a"]) and out["b"][1][1] == 3 and out["c"] == "x"


# -- on a GPU ------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("lowrank", [False, True])
def test_simulator_client_training_on_cuda_is_rerun_exact_and_near_the_cpu(lowrank) -> None:
    dev.set_determinism(torch.get_num_threads(), "cuda")
    runs = [
        _sim(on_device(plain_client_update, "cuda"), "fedbuff", lowrank).run(max_server_steps=3)
        for _ in range(2)
    ]
    cpu = _sim(None, "fedbuff", lowrank).run(max_server_steps=3)
    for n in cpu:
        assert runs[0][n].device.type == "cpu"  # the server stays on the CPU
        assert torch.equal(runs[0][n], runs[1][n]), n
        torch.testing.assert_close(runs[0][n], cpu[n], rtol=1e-4, atol=1e-5)


@needs_cuda
def test_centralised_training_and_embedding_on_cuda_are_rerun_exact() -> None:
    from fedvox.eval.extract import embed_utterances
    from fedvox.training.centralised import init_training, train

    rng = np.random.default_rng(0)
    feats = [rng.normal(size=(120, 20)).astype(np.float32) for _ in range(12)]
    labels = np.arange(12) % 4
    cfg = CentralisedConfig(
        seed=0,
        model=ModelConfig("xvector-tiny", None, None, 30.0, 0.2, (0.2, 0.5)),
        train=TrainConfig(3, 4, (50, 60), "adam", 1e-3, 1e-4, 1, 0.0, 10.0, 1, device="cuda"),
    )
    out = []
    for _ in range(2):
        state = train(init_training(cfg, feats, labels, 4), cfg, progress=False)
        assert next(state.extractor.parameters()).device.type == "cuda"
        ckpt = state.to_checkpoint()
        assert all(t.device.type == "cpu" for t in ckpt["extractor"].values())
        out.append(embed_utterances(state.extractor, feats[:3]))
    assert np.array_equal(out[0], out[1])
