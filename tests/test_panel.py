"""A held-out panel (federated.reconstruction.panel = "held_out"): the devices whose
embeddings give the domain centre and cluster centroids do not train, and a DP run's
accountant counts only the devices that do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_server_learning import write_config

from fedvox.errors import ConfigError
from fedvox.experiment.config import ReconstructionSection, load_config
from fedvox.experiment.federated import build_setup, panel_split
from fedvox.experiment.prepare import prepare


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("panelcache")


def test_panel_split_holds_out_the_spread_panel() -> None:
    clients = [np.array([i]) for i in range(10)]
    held = ReconstructionSection(device_clusters=2, cluster_panel=4, panel="held_out")
    panel, train = panel_split(clients, held)
    assert [int(c[0]) for c in panel] == [0, 3, 6, 9]
    assert [int(c[0]) for c in train] == [1, 2, 4, 5, 7, 8]
    # no clusters: the centre panel is held out; neither: nothing is
    centre = ReconstructionSection(centre="domain", centre_panel=2, panel="held_out")
    assert [int(c[0]) for c in panel_split(clients, centre)[0]] == [0, 9]
    assert len(panel_split(clients, ReconstructionSection(panel="held_out"))[1]) == 10
    same = ReconstructionSection(device_clusters=2, cluster_panel=4)
    assert panel_split(clients, same) == (clients, clients)  # "training": the panel trains
    with pytest.raises(ConfigError, match="leaves none"):
        panel_split(clients, ReconstructionSection(device_clusters=2, cluster_panel=10,
                                                   panel="held_out"))  # fmt: skip


def test_held_out_panel_devices_do_not_train_and_dp_counts_the_rest(
    tmp_path: Path, cache: Path
) -> None:
    path = write_config(tmp_path / "p.toml", cache, speakers="local", algorithm="fedavg")
    text = path.read_text().replace("[federated]\n", '[federated]\nweighting = "uniform"\n')
    text = text.replace(
        "[federated.reconstruction]\n",
        '[federated.reconstruction]\ncentre = "domain"\ncentre_panel = 2\n'
        "device_clusters = 2\ncluster_panel = 3\ncluster_min_devices = 1\n"
        'panel = "held_out"\n',
    )
    text += '[federated.privacy]\nmechanism = "gaussian"\nnoise_multiplier = 1.0\n'
    text += "clip_norm = 1.0\ndelta = 1e-3\n"
    path.write_text(text)
    cfg = load_config(path)
    setup = build_setup(cfg, prepare(cfg, progress=False))
    n = len(setup.partition.clients)
    assert n == 8 and setup.simulator.population.num_clients == n - 3
    assert setup.privacy.num_clients == n - 3
    trained = load_config(path, {"federated.reconstruction.panel": "training"})
    assert (
        build_setup(trained, prepare(trained, progress=False)).simulator.population.num_clients == n
    )
