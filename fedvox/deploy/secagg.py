"""Secure aggregation over a grid's messages: fedvox's SecAgg(+) rounds as QUERY requests.

Runtime-free, between the deployed server's step and fedvox.privacy.secagg's parties. Keys
and shares travel as scalar values (a ConfigRecord on Flower), the masked input as a byte
tensor (an ArrayRecord); a node keeps its trained update until it masks it, so the server
process never holds a plaintext update. A node that stops answering in any round is a
dropout the protocol recovers from; below the threshold the step is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from fedvox.deploy.grid import ERROR, QUERY, DeployError, Envelope, Grid, Value
from fedvox.errors import StepSkipped
from fedvox.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    Entropy,
    KeyBroadcast,
    MaskedInput,
    ProtocolParams,
    SecAggAbort,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    SecAggViolation,
    SecureSum,
    UnmaskRequest,
    UnmaskResponse,
    decode,
    encode,
)
from fedvox.types import Params

STAGE = "secagg"  # values key naming the protocol round a QUERY belongs to
ADVERTISE, SHARE, MASKED, UNMASK = "advertise", "share", "masked", "unmask"
MASKED_ARRAY = "masked"


def _ids(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _parse_ids(text: Value) -> tuple[int, ...]:
    return tuple(int(v) for v in str(text).split(",") if v != "")


def _bytes(values: dict[str, Value], prefix: str) -> dict[int, bytes]:
    """The byte values named prefix<id>, by id (anything else under the prefix is refused)."""
    out = {}
    for key, value in values.items():
        if key.startswith(prefix):
            if not isinstance(value, bytes):
                raise SecAggAbort(f"{key} is not bytes")
            out[int(key[len(prefix) :])] = value
    return out


# -- the node side ------------------------------------------------------------------------


@dataclass
class SecAggNode:
    """A node's half of the protocol: the flat update it trained and holds back, and one
    SecAggClient per server step. `entropy` draws its secrets (the OS by default)."""

    config: SecAggConfig
    entropy: Callable[[int], bytes] = field(default_factory=Entropy)
    held: dict[str, np.ndarray] = field(default_factory=dict)  # server step → flat update
    clients: dict[str, tuple[SecAggClient, float]] = field(default_factory=dict)

    def hold(self, group: str, delta: Params) -> None:
        """Keep step `group`'s update on the node (it leaves only masked)."""
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in delta.values()])
        self.held[group] = flat.numpy()

    def handle(self, request: Envelope) -> Envelope:
        """Answer one protocol round of the server step `request.group`."""
        v, group = request.values, request.group
        stage = v.get(STAGE)
        if stage == ADVERTISE:
            params = ProtocolParams(
                n=int(v["n"]),
                threshold=int(v["threshold"]),
                dim=int(v["dim"]),
                modulus_bits=self.config.modulus_bits,
                neighbours=tuple(_parse_ids(g) for g in str(v["neighbours"]).split(";")),
                session=bytes(v["session"]),  # type: ignore[arg-type]
            )
            client = SecAggClient(int(v["cid"]), params, self.entropy)
            self.clients[group] = (client, float(v["weight"]))
            m = client.advertise_keys()
            return self._reply(request, {"c": m.c_public, "s": m.s_public})
        client, weight = self._client(group)
        if stage == SHARE:
            cs, ss = _bytes(v, "c."), _bytes(v, "s.")
            shares = client.share_keys(KeyBroadcast({u: (cs[u], ss[u]) for u in cs}))
            return self._reply(request, {f"to.{m.receiver}": m.ciphertext for m in shares})
        if stage == MASKED:
            routed = [EncryptedShare(u, client.id, c) for u, c in _bytes(v, "from.").items()]
            if group not in self.held:
                raise DeployError(f"no update held for server step {group}")
            rng = np.random.default_rng()  # rounding noise: public, fresh per input
            x = encode(self.held.pop(group), weight, self.config, rng)
            m = client.masked_input(routed, x)
            data = torch.frombuffer(bytearray(m.data), dtype=torch.uint8)
            return self._reply(request, {}, {MASKED_ARRAY: data})
        if stage == UNMASK:
            req = UnmaskRequest(_parse_ids(v["survivors"]), _parse_ids(v["dropped"]))
            r = client.unmask(req)
            del self.clients[group]
            out: dict[str, Value] = {f"b.{u}": s for u, s in r.self_mask_shares.items()}
            out.update({f"sk.{u}": s for u, s in r.key_shares.items()})
            return self._reply(request, out)
        raise DeployError(f"unknown secure aggregation round {stage!r}")

    def state(self) -> tuple[dict[str, Value], Params]:
        """What the node must keep between messages (a runtime may start a fresh process for
        each): the protocol clients as flat values, the held updates as tensors. Secret."""
        values: dict[str, Value] = {}
        for group, (client, weight) in self.clients.items():
            p = client.params
            values[f"{group}|n"], values[f"{group}|t"], values[f"{group}|dim"] = (
                p.n,
                p.threshold,
                p.dim,
            )
            values[f"{group}|neighbours"] = ";".join(_ids(g) for g in p.neighbours)
            values[f"{group}|session"], values[f"{group}|weight"] = p.session, weight
            values.update({f"{group}|c|{k}": v for k, v in client.state_dict().items()})
        arrays = {f"held.{g}": torch.from_numpy(x) for g, x in self.held.items()}
        return values, arrays

    def restore(self, values: dict[str, Value], arrays: Params) -> None:
        """Take back what `state` saved (replacing what this object holds)."""
        self.held = {n.split(".", 1)[1]: t.numpy().copy() for n, t in arrays.items()}
        self.clients = {}
        for group in {k.split("|", 1)[0] for k in values if "|" in k}:
            params = ProtocolParams(
                n=int(values[f"{group}|n"]),
                threshold=int(values[f"{group}|t"]),
                dim=int(values[f"{group}|dim"]),
                modulus_bits=self.config.modulus_bits,
                neighbours=tuple(
                    _parse_ids(g) for g in str(values[f"{group}|neighbours"]).split(";")
                ),
                session=bytes(values[f"{group}|session"]),  # type: ignore[arg-type]
            )
            prefix = f"{group}|c|"
            state = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
            client = SecAggClient.from_state(params, state, self.entropy)  # type: ignore[arg-type]
            self.clients[group] = (client, float(values[f"{group}|weight"]))

    def _client(self, group: str) -> tuple[SecAggClient, float]:
        if group not in self.clients:
            raise DeployError(f"secure aggregation round for step {group} before its keys")
        return self.clients[group]

    def _reply(
        self, request: Envelope, values: dict[str, Value], arrays: Params | None = None
    ) -> Envelope:
        return Envelope(request.node, request.kind, arrays or {}, values, request.group)


# -- the server side ----------------------------------------------------------------------


@dataclass
class RoundLog:
    """Who answered each round of one secure sum (protocol ids), and whether it aborted."""

    answered: dict[str, list[int]] = field(default_factory=dict)
    aborted: str = ""


class SecureRounds:
    """The server's half: runs one secure sum over the nodes that trained in a step. It sees
    public keys, ciphertexts, masked vectors and shares, never an update."""

    def __init__(self, config: SecAggConfig, collect: Callable[..., list[Envelope]]) -> None:
        self.config = config
        self.sums = SecureSum(config)  # public parameters per call, its call counter
        self.collect = collect  # (grid, ids, want) -> replies, as DeployServer._collect
        self.log: list[RoundLog] = []
        self.last: dict[str, float] = {}  # the last successful sum's metrics

    def _round(
        self, grid: Grid, group: str, stage: str, requests: dict[int, dict], arrays=None
    ) -> dict[int, Envelope]:
        """Push one round to `requests` {cid: values}; the replies that came, by cid."""
        order = sorted(requests)
        envs = [
            Envelope(self.nodes[c], QUERY, {}, {STAGE: stage, **requests[c]}, group) for c in order
        ]
        ids = grid.push(envs)
        by_id = dict(zip(ids, order, strict=True))
        replies = self.collect(grid, ids, len(ids), count_errors=True)
        got = {by_id[r.reply_to]: r for r in replies if r.kind != ERROR}
        self.log[-1].answered[stage] = sorted(got)
        return got

    def secure_sum(
        self, grid: Grid, group: str, nodes: list[int], weights: Tensor, shapes: dict
    ) -> tuple[Params, float, int]:
        """Σ w_i Δ_i and Σ w_i over the nodes (held updates of step `group`) that finish the
        protocol; StepSkipped when too few do (with on_abort "skip"), else SecAggAbort."""
        self.log.append(RoundLog())
        call = self.sums.calls
        self.sums.calls += 1
        try:
            return self._run(grid, group, nodes, weights, shapes, call)
        except SecAggViolation:
            raise
        except SecAggAbort as err:
            self.log[-1].aborted = str(err)
            if self.config.on_abort == "stop":
                raise
            raise StepSkipped(
                f"secure aggregation over messages aborted: {err}",
                {"secagg_aborted": 1.0, "secagg_survivors": float(err.alive or 0)},
            ) from err

    def _run(self, grid, group, nodes, weights, shapes, call) -> tuple[Params, float, int]:
        n = len(nodes)
        if n < 2:
            raise SecAggAbort(f"{n} node trained, below the 2 secure aggregation needs", n, 2)
        self.config.check_capacity(n)
        sizes = {k: math.prod(s) for k, s in shapes.items()}
        params = self.sums.protocol_params(n, sum(sizes.values()) + 1, call)
        self.nodes = dict(enumerate(nodes))
        server = SecAggServer(params)
        adv = {
            c: {
                "cid": c,
                "n": n,
                "threshold": params.threshold,
                "dim": params.dim,
                "session": params.session,
                "neighbours": ";".join(_ids(g) for g in params.neighbours),
                "weight": float(weights[c]),
            }
            for c in range(n)
        }
        got = self._round(grid, group, ADVERTISE, adv)
        keys = [
            AdvertiseKeys(c, bytes(r.values["c"]), bytes(r.values["s"])) for c, r in got.items()
        ]  # type: ignore[arg-type]
        broadcasts = server.broadcast_keys(keys)
        share_req = {}
        for c, b in broadcasts.items():
            values: dict[str, Value] = {f"c.{u}": k[0] for u, k in b.keys.items()}
            values.update({f"s.{u}": k[1] for u, k in b.keys.items()})
            share_req[c] = values
        got = self._round(grid, group, SHARE, share_req)
        batches = {
            c: [EncryptedShare(c, to, ct) for to, ct in _bytes(r.values, "to.").items()]
            for c, r in got.items()
        }
        routed = server.route_shares(batches)
        masked_req = {c: {f"from.{m.sender}": m.ciphertext for m in s} for c, s in routed.items()}
        got = self._round(grid, group, MASKED, masked_req)
        for c, r in sorted(got.items()):
            data = r.arrays.get(MASKED_ARRAY)
            if data is None:
                raise SecAggAbort(f"node of client {c} sent no masked input")
            server.receive_masked(MaskedInput(c, data.numpy().tobytes()))
        unmask_req = {
            c: {"survivors": _ids(u.survivors), "dropped": _ids(u.dropped)}
            for c, u in server.unmask_requests().items()
        }
        got = self._round(grid, group, UNMASK, unmask_req)
        responses = [
            UnmaskResponse(c, _bytes(r.values, "b."), _bytes(r.values, "sk."))
            for c, r in got.items()
        ]
        total, survivors = server.unmask(responses)
        self.last = {
            "secagg_aborted": 0.0,
            "secagg_survivors": float(len(survivors)),
            "secagg_threshold": float(params.threshold),
        }
        values_, weight = decode(total, self.config)
        out, offset = {}, 0
        for name, shape in shapes.items():
            part = values_[offset : offset + sizes[name]].astype(np.float32).reshape(shape)
            out[name] = torch.from_numpy(part)
            offset += sizes[name]
        return out, weight, len(survivors)
