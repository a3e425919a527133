"""The federated engine: population, virtual clock, local training (fl.local), aggregation, algorithms.

Generic over models: a Task gives initial parameters and a functional per-example loss; the
engine never imports an execution backend, the experiment layer or the command line.
"""

from fedvox.fl.aggregation import Aggregator, SumStage, broadcast, client_delta, weighted_sum
from fedvox.fl.algorithms import (
    ALGORITHMS,
    Algorithm,
    FedAsync,
    FedAvg,
    FedBuff,
    make_algorithm,
    staleness_weight,
)
from fedvox.fl.clock import DelayModel, EventQueue, diurnal_availability
from fedvox.fl.local import (
    ClientConfig,
    ClientResults,
    ModuleTask,
    ReconConfig,
    Task,
    make_recon_update,
    recon_eval,
    train_clients,
)
from fedvox.fl.population import Population
from fedvox.fl.server_opt import (
    ServerAdagrad,
    ServerAdam,
    ServerOptimizer,
    ServerSGD,
    ServerYogi,
    make_server_optimizer,
)
from fedvox.fl.simulator import Simulator, SimulatorConfig

__all__ = [
    "ALGORITHMS",
    "Aggregator",
    "Algorithm",
    "ClientConfig",
    "ClientResults",
    "DelayModel",
    "EventQueue",
    "FedAsync",
    "FedAvg",
    "FedBuff",
    "ModuleTask",
    "Population",
    "ReconConfig",
    "ServerAdagrad",
    "ServerAdam",
    "ServerOptimizer",
    "ServerSGD",
    "ServerYogi",
    "Simulator",
    "SimulatorConfig",
    "SumStage",
    "Task",
    "broadcast",
    "client_delta",
    "diurnal_availability",
    "make_algorithm",
    "make_recon_update",
    "make_server_optimizer",
    "recon_eval",
    "staleness_weight",
    "train_clients",
    "weighted_sum",
]
