"""Process helpers shared by the tests: a throwaway valkey-server, a Valkey Cluster and a
Sentinel-watched pair made of it, the "SIGTERM, wait, kill" stop of a consumer or any other
child process, the `teacherq` CLI in a child process, and a child's output read through a
pseudo-terminal."""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import redis
from redis.crc import key_slot

from shared.redis_server import free_port, server_args, server_binary, wait_ready
from shared.settings import Settings, to_env
from tests.timing import scaled

REPO = Path(__file__).resolve().parents[1]


def launch_consumer(
    settings: Settings,
    cwd: Path,
    log_path: Path,
    *,
    extra_env: dict[str, str] | None = None,
    nproc: int = 1,
) -> subprocess.Popen:
    """A real consumer process (`python -m consumer`; under torchrun with `nproc` ranks, as a
    user launches one replica of several ranks) on `settings`, its output in `log_path`
    (also set as the process's `log_path`, for failure messages). Not waited for."""
    env = {**os.environ, **to_env(settings), **(extra_env or {}), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "consumer"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", "-m", "consumer"]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def run_cli(
    settings: Settings | None,
    *args: str,
    stdin: str | None = None,
    env: dict[str, str | None] | None = None,
    cwd: Path = REPO,
    timeout: float = scaled(120),
) -> subprocess.CompletedProcess:
    """Run `teacherq ARGS` (this checkout's code) with the test's settings and capture
    everything as text. TEACHERQ_* variables of the test process are left out; an `env`
    value of None unsets that variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")}
    full = {**base, **(to_env(settings) if settings else {}), **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}
    full["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        env=full,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_with_terminal_stderr(
    cmd: list[str], *, env: dict[str, str], cwd: Path = REPO, timeout: float = scaled(60)
) -> tuple[int, bytes, bytes]:
    """Run `cmd` with stderr on a pseudo-terminal (as a user's shell) and stdout on a pipe;
    return (exit code, what reached the terminal, stdout)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while select.select([master], [], [], timeout)[0]:  # until the process closes it
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, seen, out


def terminate(proc: subprocess.Popen, *, timeout: float = scaled(30.0)) -> int:
    """Ask `proc` to stop (SIGTERM, as a supervisor does) and return its exit code. If it has
    not exited within `timeout` seconds, raises subprocess.TimeoutExpired; for a consumer
    (`log_path` set, as `start_consumer` does) an AssertionError instead, after asking it for
    its threads' stacks (SIGUSR1), with the end of its log, stacks included."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log_path = getattr(proc, "log_path", None)
        if log_path is None:
            raise
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        tail = Path(log_path).read_text(errors="replace")[-12000:]
        raise AssertionError(
            f"still running {timeout:g} s after SIGTERM; its log ends:\n{tail}"
        ) from None


def stop_all(procs: Iterable[subprocess.Popen], *, timeout: float = scaled(30.0)) -> None:
    """Fixture teardown: SIGTERM every live process, wait for each, SIGKILL what is left."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=scaled(10))


class Valkey:
    """A real valkey-server in `data_dir` on a loopback port (free unless given), started at
    construction and ready to serve; `extra` flags go after the defaults (later flags win)."""

    def __init__(self, data_dir: Path, *extra: str, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        args = server_args(data_dir=self.data_dir, port=self.port, daemonize=False)
        proc = subprocess.Popen([*args, *self.extra])
        wait_ready(self.url, timeout=scaled(30))
        return proc

    def restart(self) -> None:
        """Start the server again on the same port and data (after `kill`)."""
        self.proc = self._start()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed beyond what the server had written."""
        self.proc.kill()
        self.proc.wait(timeout=scaled(10))

    def stop(self) -> None:
        """Stop the server if it still runs (SIGTERM, then SIGKILL)."""
        stop_all([self.proc], timeout=scaled(10))


def _wait(what: str, check: Callable[[], bool], *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f}s")
        time.sleep(0.1)


class ValkeyCluster:
    """A real Valkey Cluster on loopback: `masters` primaries, each with `replicas` replicas,
    formed by hand (CLUSTER ADDSLOTSRANGE, CLUSTER MEET, CLUSTER REPLICATE) from the same
    valkey-server the other tests run. `node_timeout_ms` is short so that a killed primary
    is replaced by its replica within seconds (automatic failover)."""

    def __init__(
        self, root: Path, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
    ) -> None:
        flags = (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-replica-validity-factor", "0",  # a replica may always take over
        )  # fmt: skip
        self.nodes: list[Valkey] = []
        self.masters = masters
        try:
            for i in range((1 + replicas) * masters):
                d = root / f"node{i}"
                d.mkdir(parents=True)
                self.nodes.append(Valkey(d, *flags, port=_cluster_port()))
            self._form(masters)
        except BaseException:
            self.stop()
            raise
        self.url = self.nodes[0].url

    def client(self, node: Valkey) -> redis.Redis:
        """A plain (non-cluster) client of one node, for CLUSTER commands."""
        return redis.Redis.from_url(node.url, socket_timeout=5.0)

    def _form(self, masters: int) -> None:
        step = 16384 // masters
        for i in range(masters):
            last = 16383 if i == masters - 1 else (i + 1) * step - 1
            self.client(self.nodes[i]).execute_command("CLUSTER ADDSLOTSRANGE", i * step, last)
        first = self.client(self.nodes[0])
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port)
        n = len(self.nodes)

        def all_known() -> bool:
            return all(
                int(self.client(x).execute_command("CLUSTER INFO")["cluster_known_nodes"]) == n
                for x in self.nodes
            )

        _wait("every node knowing every other", all_known, timeout=scaled(30))
        for i, replica in enumerate(self.nodes[masters:]):
            node_id = self.client(self.nodes[i % masters]).execute_command("CLUSTER MYID")
            self.client(replica).execute_command("CLUSTER REPLICATE", node_id)
        self.wait_ok()
        self.wait_replicas((len(self.nodes) - masters) // masters)

    def replicas_of(self, primary: Valkey) -> int:
        """Replicas in sync with `primary` (INFO replication, state online)."""
        info = self.client(primary).info("replication")
        return sum(
            1
            for k, v in info.items()
            if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
        )

    def wait_replicas(self, n: int, *, timeout: float = scaled(60.0)) -> None:
        """Block until every live primary has `n` replicas in sync."""

        def synced() -> bool:
            step = 16384 // self.masters
            primaries = [self.primary_of_slot(i * step) for i in range(self.masters)]
            return all(self.replicas_of(p) >= n for p in primaries)

        _wait(f"{n} replicas per primary", synced, timeout=timeout)

    def wait_ok(self, *, timeout: float = scaled(30.0)) -> None:
        """Block until every live node reports cluster_state:ok and every slot is served."""

        def ok() -> bool:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    continue
                info = self.client(node).execute_command("CLUSTER INFO")
                if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != 16384:
                    return False
            return True

        _wait("cluster_state:ok", ok, timeout=timeout)

    def primary_of(self, key: str) -> Valkey:
        """The live node serving `key`'s slot as primary now."""
        return self.primary_of_slot(key_slot(key.encode()))

    def primary_of_slot(self, slot: int) -> Valkey:
        """The live node serving `slot` as primary now."""
        for node in self.nodes:
            if node.proc.poll() is not None:
                continue
            for start, end, *_ in self.client(node).execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    port = int(_[0][1])
                    return next(x for x in self.nodes if x.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def stop(self) -> None:
        """Stop every node that still runs."""
        stop_all([n.proc for n in self.nodes], timeout=scaled(10))


class ValkeySentinel:
    """A real primary with one replica, watched by three sentinels (valkey-server
    --sentinel, quorum 2) under the service name `service`; a dead primary is replaced by
    its replica after `down_after_ms`."""

    def __init__(self, root: Path, *, service: str = "tq", down_after_ms: int = 1000) -> None:
        self.service = service
        self.sentinels: list[subprocess.Popen] = []
        self.primary = Valkey(_mkdir(root / "primary"))
        self.replica = Valkey(
            _mkdir(root / "replica"), "--replicaof", "127.0.0.1", str(self.primary.port)
        )
        self.ports: list[int] = []
        try:
            _wait("replica in sync", self._synced, timeout=scaled(30))
            for i in range(3):
                self._start_sentinel(_mkdir(root / f"sentinel{i}"), down_after_ms)
        except BaseException:
            self.stop()
            raise
        self.url = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.url = f"redis://{self.url}/0"

    def _synced(self) -> bool:
        info = redis.Redis.from_url(self.replica.url).info("replication")
        return bool(info.get("master_link_status") == "up")

    def _start_sentinel(self, d: Path, down_after_ms: int) -> None:
        port = free_port()
        conf = d / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {d}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 10000\n"
        )
        log = d / "sentinel.log"
        self.sentinels.append(
            subprocess.Popen([str(server_binary()), str(conf), "--sentinel", "--logfile", str(log)])
        )
        self.ports.append(port)
        wait_ready(f"redis://127.0.0.1:{port}", timeout=scaled(30))

    def master_port(self) -> int:
        """The primary's port as the sentinels see it now."""
        for port in self.ports:
            try:
                s = redis.Redis(port=port, socket_timeout=2.0)
                return int(s.sentinel_get_master_addr_by_name(self.service)[1])
            except redis.RedisError:
                continue
        raise LookupError("no sentinel answered")

    def wait_replicated(self, *, timeout: float = scaled(60.0)) -> None:
        """Block until the primary the sentinels name has a replica in sync (after a
        failover, the restarted old primary is turned into one; sentinels look every few s)."""

        def synced() -> bool:
            info = redis.Redis(port=self.master_port(), socket_timeout=2.0).info("replication")
            return any(
                isinstance(v, dict) and v.get("state") == "online"
                for k, v in info.items()
                if k.startswith("slave")
            )

        _wait("a replica of the primary in sync", synced, timeout=timeout)

    def stop(self) -> None:
        """Stop the sentinels and both servers."""
        stop_all(self.sentinels, timeout=scaled(10))
        self.primary.stop()
        self.replica.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = random.randint(20000, 45000)
        if all(_free(p) for p in (port, port + 10000)):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d
