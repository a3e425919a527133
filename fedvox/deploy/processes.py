"""The processes of a local federation: started, watched and stopped by their PIDs.

Runtime-free. A SuperLink or SuperNode spawns helpers (Flower's SuperExec and app processes,
some in sessions of their own), so stopping a process also stops every descendant it had,
each by its PID; nothing is ever stopped by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fedvox.deploy.grid import DeployError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS just had free on `host` (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None) -> None:
    """Block until something accepts TCP connections on host:port; fail if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DeployError(f"process {proc.pid} exited ({proc.returncode}) before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise DeployError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (Linux)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    """The PIDs below `pid` in the process tree, parents before children."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _started(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None if it is gone or a zombie: with the
    PID it names one process, so a PID the OS reused is never signalled."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _identify(pids: list[int]) -> dict[int, int]:
    return {p: t for p in pids if (t := _started(p)) is not None}


@dataclass
class Managed:
    """One process this federation started: its name, argv, log file and Popen handle."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen
    helpers: dict[int, int]  # descendants seen while it ran (pid → start time)

    @property
    def pid(self) -> int:
        return self.proc.pid


class Processes:
    """The processes one command started; a context manager that stops them all on exit
    (normal end, error or Ctrl-C), newest first."""

    def __init__(self, logs: Path, env: Mapping[str, str] | None = None) -> None:
        self.logs = Path(logs)
        self.env = dict(os.environ if env is None else env)
        self.running: dict[str, Managed] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Managed:
        """Start `argv` in its own session, output to LOGS/<name>.log."""
        if name in self.running and self.running[name].proc.poll() is None:
            raise DeployError(f"process {name!r} is already running (pid {self.running[name].pid})")
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        out: IO[bytes] = open(log, "ab")  # the child keeps its own copy
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})},
                start_new_session=True,  # Ctrl-C reaches fedvox, which stops it by PID
            )
        except FileNotFoundError as err:
            raise DeployError(
                f"cannot start {argv[0]!r}: not found. Fix: install the deploy extra "
                "(pip install 'fedvox[deploy]') in the environment running fedvox"
            ) from err
        finally:
            out.close()
        managed = Managed(name, list(argv), log, proc, {})
        self.running[name] = managed
        return managed

    def watch(self) -> None:
        """Remember every live process's descendants (so they can be stopped after it)."""
        for m in self.running.values():
            if m.proc.poll() is None:
                m.helpers.update(_identify(descendants(m.pid)))

    def kill(self, name: str) -> None:
        """SIGKILL a process at once, as a crash would (its helpers are stopped too)."""
        m = self.running[name]
        m.helpers.update(_identify(descendants(m.pid)))
        _signal(m.pid, signal.SIGKILL)
        m.proc.wait()
        self._stop_helpers(m, grace=0.0)

    def stop(self, name: str, grace: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` s; then its descendants. Returns its exit code."""
        m = self.running[name]
        if m.proc.poll() is None:
            m.helpers.update(_identify(descendants(m.pid)))
            _signal(m.pid, signal.SIGTERM)
            try:
                m.proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal(m.pid, signal.SIGKILL)
                m.proc.wait()
        self._stop_helpers(m, grace)
        return m.proc.returncode

    def _stop_helpers(self, m: Managed, grace: float) -> None:
        """Stop the descendants `m` had, each by its PID (SIGTERM, then SIGKILL)."""
        helpers = {p: t for p, t in m.helpers.items() if _started(p) == t}
        for pid in list(helpers):
            helpers.update(_identify(descendants(pid)))

        def alive() -> list[int]:
            return [p for p, t in helpers.items() if _started(p) == t]

        for pid in alive():
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive():
            _signal(pid, signal.SIGKILL)
        m.helpers.clear()

    def stop_all(self, grace: float = 5.0) -> None:
        """Stop every process this object started, newest first."""
        for name in reversed(list(self.running)):
            self.stop(name, grace)

    def pids(self) -> dict[str, int]:
        """Name → PID of the processes still running."""
        return {n: m.pid for n, m in self.running.items() if m.proc.poll() is None}
