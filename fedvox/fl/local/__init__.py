"""The local-training core: what one device (or a chunk of simulated devices) runs per trip.

The simulator calls it now; a Ray worker or a deployed Flower client calls the same
functions. Every function is deterministic in (population seed, client, trip) and runs
clients vectorised (vmap over stacked parameters) or one at a time with identical results.

    train_clients(task, population, jobs, starts, config) -> ClientResults
        plain local SGD of jobs [(client, trip)] from their start params (one per job).
    train_clients_recon(task, population, jobs, starts, config, recon) -> ClientResults
        Federated Reconstruction: split_client -> reconstruct -> train on query.
    split_client(population, client, rng, batch_size, epochs, recon) -> Split
        the one support/query split of training and evaluation.
    reconstruct(task, population, params, recon, clients, client, seed, part) -> Params
        local params of unseen clients (RECONEVAL, enrollment); reconstruct_stacked(task,
        population, support, globals, locals, config, recon) is its step for given batches.
    recon_eval(task, population, params, recon, metric_fn, clients, seed, client) -> dict

ClientResults holds Δ = w_start − w_local [k, ...] over the global names, the weights
(num_examples [k]) and mean losses [k]. Modules: config (settings), task (protocols),
steps (padding, broadcast view, vectorised step, loop step), lowrank (the exact low-rank
path a task may declare), split, reconstruct, train, evaluate, placement (a client update
on a device: copies of the task, store and versions there). ClientConfig.shard trains one
shard of a step's units, as fedvox.scale hands them to workers. Imports only fedvox.fl's
population and aggregation, fedvox.rng, fedvox.types and fedvox.errors.
"""

from fedvox.fl.local.config import GROUP_FIELD, SPLITS, ClientConfig, ClientResults, ReconConfig
from fedvox.fl.local.evaluate import recon_eval
from fedvox.fl.local.reconstruct import reconstruct, reconstruct_stacked
from fedvox.fl.local.split import Split, eval_splits, split_client
from fedvox.fl.local.steps import broadcast_view
from fedvox.fl.local.task import LossFn, LowRankTask, ModuleTask, ReconTask, Task
from fedvox.fl.local.train import make_recon_update, train_clients, train_clients_recon

__all__ = [
    "GROUP_FIELD",
    "SPLITS",
    "ClientConfig",
    "ClientResults",
    "LossFn",
    "LowRankTask",
    "ModuleTask",
    "ReconConfig",
    "ReconTask",
    "Split",
    "Task",
    "broadcast_view",
    "eval_splits",
    "make_recon_update",
    "recon_eval",
    "reconstruct",
    "reconstruct_stacked",
    "split_client",
    "train_clients",
    "train_clients_recon",
]
