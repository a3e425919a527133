"""The Flower runtime's command lines (flwr 1.42): SuperLink, SuperNode, node registration, runs.

The second Flower adapter, beside fedvox.deploy.flower: every Flower command name, flag and
file format fedvox launches is here, and it imports no flwr, so `fedvox deploy keys` and
`print-commands` work without the `deploy` extra.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from fedvox.atomic import atomic_write_text
from fedvox.deploy.grid import DeployError, Value
from fedvox.deploy.keys import KeyLayout

CONNECTION = "fedvox"  # the SuperLink connection's name in FLWR_HOME/config.toml
PUBLISHER = "fedvox"
# no telemetry, no update checks, no `uv sync` of app dependencies (fedvox is installed)
RUNTIME_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
SERVER_APP = "fedvox.experiment.flower_app:server"
CLIENT_APP = "fedvox.experiment.flower_app:client"


def executable(name: str) -> str:
    """A Flower command from the environment running fedvox (its bin folder), else by PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() else name


def runtime_env(flwr_home: Path) -> dict[str, str]:
    """The variables every Flower process fedvox starts gets: telemetry and update checks
    off, its own FLWR_HOME, and the environment's bin first on PATH (SuperLink and SuperNode
    start `flower-superexec` by name)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**RUNTIME_ENV, "FLWR_HOME": str(flwr_home), "PATH": path}


@dataclass(frozen=True)
class Link:
    """Where the SuperLink listens (one HTTPS port for Fleet, Control and Runtime APIs) and
    its keys; `keys` None means no TLS and no node authentication (--insecure)."""

    host: str
    port: int
    keys: KeyLayout | None
    bind: str | None = None  # the address to bind (default `host`; 0.0.0.0 on a server)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def superlink_argv(link: Link, database: Path | None = None) -> list[str]:
    """`flower-superlink` with TLS and node authentication (or --insecure without keys)."""
    argv = [executable("flower-superlink"), "--host", link.bind or link.host]
    argv += ["--port", str(link.port), "--disable-runtime-dependency-installation"]
    if link.keys is None:
        argv.append("--insecure")
    else:
        k = link.keys
        argv += ["--ssl-certfile", str(k.server_cert), "--ssl-keyfile", str(k.server_key)]
        argv += ["--ssl-ca-certfile", str(k.ca_cert), "--enable-supernode-auth"]
    if database is not None:
        argv += ["--database", str(database)]
    return argv


def config_args(values: Mapping[str, Value]) -> str:
    """Flower's `key=value` list (TOML values, strings quoted) for --node-config."""
    parts = []
    for key, value in values.items():
        if isinstance(value, str) and ('"' in value or "\n" in value):
            raise DeployError(f"{key}={value!r}: Flower's config values cannot hold quotes")
        parts.append(f"{key}={tomli_w.dumps({'v': value}).split('=', 1)[1].strip()}")
    return " ".join(parts)


def supernode_argv(
    link: Link,
    private_key: Path | None,
    node_config: Mapping[str, Value],
    runtime_port: int,
    max_wait_s: float | None = None,
) -> list[str]:
    """`flower-supernode` dialling the SuperLink: trusting its CA and signing with the node's
    EC key (or --insecure); `runtime_port` is its own local API for its app processes."""
    argv = [executable("flower-supernode"), "--superlink", link.address]
    if link.keys is None:
        argv.append("--insecure")
    else:
        argv += ["--root-certificates", str(link.keys.ca_cert)]
        if private_key is not None:
            argv += ["--auth-supernode-private-key", str(private_key)]
    argv += ["--node-config", config_args(node_config), "--port", str(runtime_port)]
    if max_wait_s is not None:
        argv += ["--max-wait-time", str(max_wait_s)]
    return argv


def write_connection(flwr_home: Path, link: Link) -> Path:
    """FLWR_HOME/config.toml naming the SuperLink connection `flwr` commands use."""
    conn: dict[str, object] = {"address": link.address}
    if link.keys is None:
        conn["insecure"] = True
    else:
        conn["root-certificates"] = str(link.keys.ca_cert.resolve())  # flwr: absolute only
    doc = {"superlink": {"default": CONNECTION, CONNECTION: conn}}
    return atomic_write_text(Path(flwr_home) / "config.toml", tomli_w.dumps(doc))


def register_argv(public_key: Path) -> list[str]:
    """`flwr supernode register`: the SuperLink accepts a node signing with this key."""
    return [executable("flwr"), "supernode", "register", str(public_key), CONNECTION]


def run_argv(app: Path, overrides: Mapping[str, Value] | None = None) -> list[str]:
    """`flwr run`: submit the app folder (a FAB is built from it) as a new run; `overrides`
    replace run-config values the app folder has (e.g. resume = true)."""
    argv = [executable("flwr"), "run", str(app), CONNECTION, "--format", "json"]
    return argv + (["--run-config", config_args(overrides)] if overrides else [])


def nodes_argv() -> list[str]:
    """`flwr supernode ls`: every registered node's id and status (online, offline, ...)."""
    return [executable("flwr"), "supernode", "ls", CONNECTION, "--format", "json"]


def list_argv(run_id: int) -> list[str]:
    """`flwr ls` of one run: status, and the bytes it moved."""
    return [executable("flwr"), "ls", CONNECTION, "--run-id", str(run_id), "--format", "json"]


def json_output(stdout: str, what: str) -> dict:
    """The JSON object a `flwr ... --format json` printed (other lines may precede it)."""
    start = stdout.find("{")
    try:
        out = json.loads(stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict) or not out.get("success", False):
        raise DeployError(f"{what} failed: {stdout.strip()[-500:]}")
    return out


def write_app(folder: Path, name: str, run_config: Mapping[str, Value]) -> Path:
    """A Flower app folder whose FAB names fedvox's ServerApp and ClientApp (installed with
    fedvox, not shipped in the FAB) and carries `run_config` as the run's config."""
    doc = {
        "project": {
            "name": name,
            "version": "1.0.0",
            "description": "fedvox federated speaker verification",
            "license": "Apache-2.0",
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": PUBLISHER,
                    "components": {"serverapp": SERVER_APP, "clientapp": CLIENT_APP},
                    "config": dict(run_config),
                }
            }
        },
    }
    folder = Path(folder)
    atomic_write_text(folder / "pyproject.toml", tomli_w.dumps(doc))
    atomic_write_text(
        folder / "README.md",
        "A fedvox run for Flower's runtime: `flwr run` this folder. The ServerApp and "
        "ClientApp are fedvox's own (fedvox[deploy] must be installed where they run).\n",
    )
    return folder


def shell(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """One command line a person can paste (environment assignments first)."""
    pre = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(pre + [shlex.quote(a) for a in argv])
