"""Real Redis deployments for integration and chaos tests: a Cluster and a Sentinel setup.

Each deployment runs ``redis-server`` processes on free loopback ports, every one in its
own directory under a temporary directory of the deployment's, never touching any other
Redis (such as one on 6379). Every wait is a poll with a deadline; when the deadline
passes, :class:`DeploymentError` names the deployment, what did not happen and what was
last seen. ``close()`` (also the end of a ``with`` block, even on an exception) SIGKILLs
every process and removes the directory; processes still running when the interpreter
exits are killed too.

The API is synchronous (subprocess and the sync redis-py client); each Redis call is
bounded by a 2 s socket timeout, so async tests may call it directly.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import RedisError
from redis.retry import Retry

from tests.helpers.servers import free_port

SERVER = "redis-server"
CLI = "redis-cli"
HOST = "127.0.0.1"
SERVICE = "mymaster"
NODE_TIMEOUT_MS = 1000
START_TIMEOUT = 30.0
FAILOVER_TIMEOUT = 30.0
PROCESS_START_TIMEOUT = 10.0
SOCKET_TIMEOUT = 2.0
POLL_SECONDS = 0.05
MANUAL_FAILOVER_RETRY = 6.0  # a replica gives a manual failover up to 5 s (CLUSTER_MF_TIMEOUT)
FAILING = frozenset({"fail", "fail?", "handshake", "noaddr"})
SENTINEL_DOWN_FLAGS = frozenset({"s_down", "o_down", "disconnected"})

T = TypeVar("T")


class DeploymentError(RuntimeError):
    """A deployment did not reach the state a step waits for, or one of its processes died."""


class NotYet(Exception):
    """What a wait's check saw instead of the state it waits for."""


def missing_binaries() -> list[str]:
    """The Redis executables the deployments need that are not on the PATH."""
    return [name for name in (SERVER, CLI) if shutil.which(name) is None]


def deployment_available() -> bool:
    """Whether real deployments can be started here."""
    return not missing_binaries()


def require_deployment() -> None:
    """Skip the calling test without redis-server and redis-cli; under CI, fail instead."""
    missing = " and ".join(missing_binaries())
    if not missing:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI requires {missing} on the PATH for real Redis deployments")
    pytest.skip(f"real Redis deployments need {missing} on the PATH")


def wait_for(what: str, check: Callable[[], T], timeout: float) -> T:
    """``check()``'s result once it stops raising NotYet or a Redis error; DeploymentError
    naming ``what`` and the last thing seen if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except (NotYet, RedisError) as error:
            last: Exception = error
        if time.monotonic() >= deadline:
            seen = f"{type(last).__name__}: {last}" if isinstance(last, RedisError) else last
            raise DeploymentError(f"{what}: not within {timeout:g} s (last seen: {seen})")
        time.sleep(POLL_SECONDS)


@dataclass(eq=False)
class Node:
    """One redis-server process of a deployment: a data node or a sentinel.

    ``role`` ("master", "replica" or "sentinel") and ``master_port`` are as the deployment
    last saw them settled; ``process`` is None once the node is killed. ``owner`` (the
    deployment's name) starts the messages of its errors.
    """

    label: str
    port: int
    directory: Path
    command: list[str]
    role: str
    owner: str
    master_port: int | None = None
    process: subprocess.Popen[bytes] | None = None
    stopped: bool = False
    _client: redis.Redis | None = field(default=None, init=False, repr=False)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.label} {self.address}"

    @property
    def alive(self) -> bool:
        """Running and not SIGSTOPped: a node that answers."""
        return self.process is not None and not self.stopped

    @property
    def log(self) -> Path:
        return self.directory / "redis.log"

    @property
    def client(self) -> redis.Redis:
        """A client of this node alone (decoded replies, 2 s timeouts, no retries)."""
        if self._client is None:
            self._client = redis.Redis(
                host=HOST,
                port=self.port,
                decode_responses=True,
                socket_timeout=SOCKET_TIMEOUT,
                socket_connect_timeout=SOCKET_TIMEOUT,
                retry=Retry(NoBackoff(), 0),
            )
        return self._client

    def start(self) -> None:
        """Start the process and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.directory, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self.stopped = False
        wait_for(f"{self.owner}: {self.name} answering PING", self._ping, PROCESS_START_TIMEOUT)

    def _ping(self) -> None:
        """NotYet until this process, not another one that took the port, answers."""
        self.check_running()
        pid = self.client.info("server")["process_id"]
        if self.process is None or pid != self.process.pid:
            raise NotYet(f"{self.name}: port answered by process {pid}")

    def check_running(self) -> None:
        """DeploymentError with the end of its log if the process has exited."""
        if self.process is None or self.process.poll() is None:
            return
        code = self.process.returncode
        self.process = None
        tail = self.log_tail()
        raise DeploymentError(f"{self.owner}: {self.name} exited with {code}; log ends:\n{tail}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL (a stopped process too): without persistence its data is gone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=PROCESS_START_TIMEOUT)
            self.process = None
        self.stopped = False
        self.close_client()

    def stop(self) -> None:
        """SIGSTOP: the process keeps its sockets open and answers nothing."""
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        """SIGCONT after :meth:`stop`."""
        self._signal(signal.SIGCONT)
        self.stopped = False

    def _signal(self, number: int) -> None:
        if self.process is None:
            raise DeploymentError(f"{self.owner}: {self.name} is not running")
        self.process.send_signal(number)

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def replication(self) -> dict[str, Any]:
        return self.client.info("replication")


def check_replicating(replica: Node, master_port: int) -> None:
    """NotYet unless ``replica`` is attached to ``master_port`` and in sync with it."""
    info = replica.replication()
    if info.get("master_port") != master_port or info.get("master_link_status") != "up":
        seen = f"master_port {info.get('master_port')}, link {info.get('master_link_status')}"
        raise NotYet(f"{replica.name} is not in sync with port {master_port} ({seen})")


def cut_off(master: Node, replica: Node) -> None:
    """Make ``master`` refuse ``replica``'s replication and drop its link (see the callers)."""
    master.client.acl_setuser("default", enabled=True, commands=["-psync", "-sync"])
    master.client.client_kill_filter(_type="replica")


def check_cut_off(master: Node, replica: Node) -> None:
    """NotYet while ``replica`` is still linked to ``master``."""
    link = replica.replication().get("master_link_status")
    replicas = master.replication().get("connected_slaves")
    if link != "down" or replicas != 0:
        raise NotYet(f"{replica.name} link {link}, {master.name} has {replicas} replicas")


class Deployment:
    """What both deployments share: the directory, the processes, waits, timings, close."""

    kind = "deployment"

    def __init__(self, parent: Path | None = None) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix=f"chatstream-{self.kind}-", dir=parent))
        self.nodes: list[Node] = []
        self.timings: list[tuple[str, float]] = []  # (operation, seconds), in order
        self._ports: set[int] = set()
        _OPEN.add(self)

    @property
    def name(self) -> str:
        return f"{self.kind} in {self.directory}"

    def start(self) -> None:
        raise NotImplementedError

    def _free_port(self) -> int:
        """A free loopback port no other process of this deployment was given."""
        port = free_port()
        while port in self._ports:
            port = free_port()
        self._ports.add(port)
        return port

    def _wait(self, what: str, check: Callable[[], T], timeout: float) -> T:
        """:func:`wait_for` naming this deployment."""
        return wait_for(f"{self.name}: {what}", check, timeout)

    def _timed(self, operation: str, began: float) -> None:
        """Record in ``timings`` how long ``operation`` (start, failover, ...) took."""
        self.timings.append((operation, time.monotonic() - began))

    def _cut_off(self, master: Node, replica: Node, timeout: float) -> Node:
        """``master`` refuses ``replica``'s replication from now on (see the callers)."""
        began = time.monotonic()
        cut_off(master, replica)
        self._wait(
            f"{replica.name} cut off from {master.name}",
            lambda: check_cut_off(master, replica),
            timeout,
        )
        self._timed("cut_off_replica", began)
        return replica

    def close(self) -> None:
        """SIGKILL every process and remove the directory."""
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.directory, ignore_errors=True)
        _OPEN.discard(self)

    def __enter__(self) -> Self:
        """Start the deployment (closing it again if that fails)."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


_OPEN: set[Deployment] = set()


@atexit.register
def _close_leftovers() -> None:
    """The safety net for deployments nobody closed."""
    for deployment in list(_OPEN):
        deployment.close()


class Cluster(Deployment):
    """A Redis Cluster of ``masters`` masters with ``replicas`` (0 or 1) replicas each.

    Nodes run without persistence, with a short ``cluster-node-timeout`` (failovers take
    about two seconds), ``cluster-replica-validity-factor 0`` (a replica may always be
    promoted) and no replica migration. Each node has its own bus port (``--cluster-port``:
    a free port plus 10000 may be past 65535).
    """

    kind = "cluster"

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        *,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        parent: Path | None = None,
    ) -> None:
        if masters < 3 or replicas not in (0, 1):
            raise ValueError("a Cluster needs at least 3 masters and 0 or 1 replicas each")
        super().__init__(parent)
        self.masters_wanted = masters
        self.replicas_wanted = replicas
        self.node_timeout_ms = node_timeout_ms

    @property
    def name(self) -> str:
        shape = f"{self.masters_wanted}+{self.masters_wanted * self.replicas_wanted}"
        return f"cluster {shape} in {self.directory}"

    @property
    def masters(self) -> list[Node]:
        """The live masters, in node order."""
        return [node for node in self.nodes if node.alive and node.role == "master"]

    @property
    def replicas(self) -> list[Node]:
        """The live replicas, in node order."""
        return [node for node in self.nodes if node.alive and node.role == "replica"]

    @property
    def url(self) -> str:
        """``redis://`` of the first live master (chatstream discovers the cluster from it)."""
        masters = self.masters
        if not masters:
            raise DeploymentError(f"{self.name} has no live master")
        return f"redis://{masters[0].address}/0"

    @property
    def cluster_url(self) -> str:
        """``redis+cluster://`` of the live masters."""
        return "redis+cluster://" + ",".join(node.address for node in self.masters)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the nodes, create the cluster with redis-cli, wait until it is settled."""
        began = time.monotonic()
        for _ in range(self.masters_wanted * (1 + self.replicas_wanted)):
            self.nodes.append(self._new_node())
        for node in self.nodes:
            node.start()
        self._create(timeout)
        self.wait_settled(timeout)
        self._timed("start", began)

    def _new_node(self) -> Node:
        port, bus_port = self._free_port(), self._free_port()
        directory = self.directory / f"node-{port}"
        command = [
            *(SERVER, "--port", str(port), "--cluster-enabled", "yes"),
            *("--cluster-port", str(bus_port), "--cluster-config-file", f"nodes-{port}.conf"),
            *("--cluster-node-timeout", str(self.node_timeout_ms)),
            *("--cluster-replica-validity-factor", "0", "--cluster-allow-replica-migration", "no"),
            *("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"),
            *("--bind", HOST, "--protected-mode", "no", "--dir", str(directory)),
        ]
        return Node("cluster node", port, directory, command, "master", self.name)

    def _create(self, timeout: float) -> None:
        command = [CLI, "--cluster", "create", *(node.address for node in self.nodes)]
        command += ["--cluster-replicas", str(self.replicas_wanted), "--cluster-yes"]
        try:
            done = subprocess.run(
                command, check=False, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as error:
            raise DeploymentError(f"{self.name}: redis-cli --cluster create hung") from error
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-2000:]
            raise DeploymentError(f"{self.name}: redis-cli --cluster create failed:\n{output}")

    def wait_settled(self, timeout: float = START_TIMEOUT) -> None:
        """Until every live node reports ``cluster_state:ok``, all agree on the roles and on
        CLUSTER SLOTS, and every live replica is in sync with its master."""
        view = self._wait("every live node ok and agreeing", self._settled, timeout)
        for node in self.nodes:
            if node.port in view:
                node.role, node.master_port = view[node.port]

    def _settled(self) -> dict[int, tuple[str, int | None]]:
        live = [node for node in self.nodes if node.alive]
        views, slot_maps = [], []
        for node in live:
            node.check_running()
            state = node.client.cluster("INFO")["cluster_state"]
            if state != "ok":
                raise NotYet(f"{node.name}: cluster_state:{state}")
            views.append(self._view(node, {n.port for n in live}))
            slot_maps.append(self._slots(node))
        if any(view != views[0] for view in views):
            raise NotYet(f"the nodes' views of the roles differ: {views}")
        if any(slots != slot_maps[0] for slots in slot_maps):
            raise NotYet(f"CLUSTER SLOTS differs between nodes: {slot_maps}")
        self._check_owners(views[0], slot_maps[0])
        return views[0]

    @staticmethod
    def _view(node: Node, live: set[int]) -> dict[int, tuple[str, int | None]]:
        """{port: (role, its master's port)} of the live nodes as CLUSTER NODES on ``node``
        shows them; NotYet while it sees one of them failing or still handshaking."""
        entries: dict[str, dict[str, Any]] = node.client.cluster("NODES")
        ports = {entry["node_id"]: _port(address) for address, entry in entries.items()}
        view: dict[int, tuple[str, int | None]] = {}
        for address, entry in entries.items():
            flags = set(entry["flags"].split(","))
            if _port(address) not in live:
                continue
            if flags & FAILING:
                raise NotYet(f"{node.name} sees {address} as {entry['flags']}")
            role = "master" if "master" in flags else "replica"
            view[_port(address)] = (role, ports.get(entry["master_id"]))
        if set(view) != live:
            raise NotYet(f"{node.name} knows {sorted(view)} of the live {sorted(live)}")
        return view

    @staticmethod
    def _slots(node: Node) -> list[tuple[int, int, int]]:
        """CLUSTER SLOTS on ``node``: (first slot, last slot, master's port), sorted."""
        rows: list[list[Any]] = node.client.cluster("SLOTS")
        return sorted((int(row[0]), int(row[1]), int(row[2][1])) for row in rows)

    def _check_owners(
        self, view: dict[int, tuple[str, int | None]], slots: list[tuple[int, int, int]]
    ) -> None:
        owners = {port for _, _, port in slots}
        masters = {port for port, (role, _) in view.items() if role == "master"}
        if owners != masters:
            raise NotYet(f"slots are owned by {sorted(owners)}, the masters are {sorted(masters)}")
        for port, (role, master_port) in view.items():
            if role == "replica":
                if master_port not in masters:
                    raise NotYet(f"replica {port} follows {master_port}, not a live master")
                check_replicating(self.node(port), master_port)

    def node(self, port: int) -> Node:
        """The node on ``port``."""
        for node in self.nodes:
            if node.port == port:
                return node
        raise DeploymentError(f"{self.name} has no node on port {port}")

    def replica_of(self, master: Node) -> Node:
        """The (last seen) replica of ``master``."""
        for node in self.nodes:
            if node.role == "replica" and node.master_port == master.port and node is not master:
                return node
        raise DeploymentError(f"{self.name}: {master.name} has no replica")

    def master_of_slot(self, slot: int) -> Node:
        """The master serving ``slot``, asked of a live node."""
        asked = next((node for node in self.nodes if node.alive), None)
        if asked is None:
            raise DeploymentError(f"{self.name} has no live node")
        for first, last, port in self._slots(asked):
            if first <= slot <= last:
                return self.node(port)
        raise DeploymentError(f"{self.name}: no master serves slot {slot}")

    def master_of_key(self, key: str | bytes) -> Node:
        """The master serving ``key``'s slot."""
        return self.master_of_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def kill(self, node: Node) -> None:
        """SIGKILL ``node``; its data is gone (no persistence)."""
        node.kill()

    def stop(self, node: Node) -> None:
        """SIGSTOP ``node``: it keeps its connections and answers nothing."""
        node.stop()

    def cont(self, node: Node) -> None:
        """SIGCONT ``node`` after :meth:`stop`."""
        node.cont()

    def restart(self, node: Node, timeout: float = START_TIMEOUT) -> None:
        """Start ``node`` again on its port with its nodes.conf (killing it first if it still
        runs) and wait until the cluster is settled: it rejoins empty, as a replica of its
        replacement if it was failed over."""
        began = time.monotonic()
        node.kill()
        node.start()
        self.wait_settled(timeout)
        self._timed("restart", began)

    def wait_failover(self, old_master: Node, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """After ``old_master`` is killed or stopped: until its replica is promoted and the
        cluster is settled again. Returns the new master."""
        replica = self.replica_of(old_master)
        began = time.monotonic()

        def promoted() -> None:
            role = replica.client.role()[0]
            if role != "master":
                raise NotYet(f"{replica.name} is still {role}")

        self._wait(f"{replica.name} promoted in place of {old_master.name}", promoted, timeout)
        self.wait_settled(timeout)
        self._timed("wait_failover", began)
        return replica

    def failover(self, replica: Node, timeout: float = FAILOVER_TIMEOUT) -> None:
        """A graceful manual failover (CLUSTER FAILOVER on ``replica``): until ``replica`` is
        master, its old master replicates from it and the cluster is settled."""
        old_master = self.node(self._master_port(replica))
        began = time.monotonic()
        issued = float("-inf")

        def swapped() -> None:
            nonlocal issued
            if time.monotonic() - issued > MANUAL_FAILOVER_RETRY:
                issued = time.monotonic()
                replica.client.cluster("FAILOVER")
            check_replicating(old_master, replica.port)

        self._wait(f"{replica.name} taking over from {old_master.name}", swapped, timeout)
        self.wait_settled(timeout)
        self._timed("failover", began)

    def _master_port(self, replica: Node) -> int:
        if replica.role != "replica" or replica.master_port is None:
            raise DeploymentError(f"{self.name}: {replica.name} is not a replica")
        return replica.master_port

    def cut_off_replica(self, master: Node, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """The first step of a failover that loses acknowledged writes: ``master``'s replica
        stops replicating, while ``master`` goes on acknowledging writes. Returns the replica.

        ``master`` refuses PSYNC and SYNC to the ``default`` user (ACL) and drops its replica
        links (CLIENT KILL TYPE replica); the replica keeps retrying and keeps being refused,
        until :meth:`promote_lagging_replica`. Everything else (clients, the cluster bus) is
        untouched. Unlike SIGSTOPping the replica this cannot leak writes: a stopped
        replica's socket still buffers what the master sends and applies it on SIGCONT.
        """
        return self._cut_off(master, self.replica_of(master), timeout)

    def promote_lagging_replica(self, master: Node, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """The second step: SIGKILL ``master``, make its cut-off replica master at once
        (CLUSTER FAILOVER TAKEOVER: no vote, no sync with the dead master) and wait until the
        cluster is settled. Writes acknowledged after the cut are gone. Returns the replica."""
        replica = self.replica_of(master)
        began = time.monotonic()
        master.kill()
        replica.client.cluster("FAILOVER", "TAKEOVER")
        self.wait_settled(timeout)
        if replica.role != "master":
            raise DeploymentError(f"{self.name}: {replica.name} was not promoted")
        self._timed("promote_lagging_replica", began)
        return replica

    @contextmanager
    def lose_writes_failover(self, master: Node) -> Iterator[Node]:
        """:meth:`cut_off_replica` on entry, :meth:`promote_lagging_replica` on a clean exit;
        yields the replica, which is the new master after the block."""
        replica = self.cut_off_replica(master)
        yield replica
        self.promote_lagging_replica(master)


class Sentinels(Deployment):
    """One master, one replica and three Sentinels monitoring them as ``mymaster`` (quorum
    2, ``down-after-milliseconds`` 1000, ``failover-timeout`` 5000).

    ``master`` and ``replica`` follow failovers: after one, ``master`` is the promoted
    server and ``replica`` the old master (dead after :meth:`kill_master`).
    """

    kind = "sentinels"
    service = SERVICE

    def __init__(self, *, down_after_ms: int = 1000, parent: Path | None = None) -> None:
        super().__init__(parent)
        self.down_after_ms = down_after_ms
        self.master = self._data_node("master", ())
        self.replica = self._data_node("replica", ("--replicaof", HOST, str(self.master.port)))
        self.replica.master_port = self.master.port
        self.sentinels = [self._sentinel_node() for _ in range(3)]
        self.nodes = [self.master, self.replica, *self.sentinels]

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(HOST, node.port) for node in self.sentinels]

    @property
    def url(self) -> str:
        """``redis+sentinel://`` of the three Sentinels, service ``mymaster``, database 0."""
        hosts = ",".join(node.address for node in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def _data_node(self, role: str, extra: tuple[str, ...]) -> Node:
        port = self._free_port()
        directory = self.directory / f"{role}-{port}"
        directory.mkdir()
        (directory / "redis.conf").write_text("")
        command = [SERVER, str(directory / "redis.conf"), "--port", str(port)]
        command += ["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"]
        command += ["--bind", HOST, "--protected-mode", "no", "--dir", str(directory), *extra]
        return Node(role, port, directory, command, role, self.name)

    def _sentinel_node(self) -> Node:
        port = self._free_port()
        directory = self.directory / f"sentinel-{port}"
        directory.mkdir()
        config = directory / "sentinel.conf"
        config.write_text(
            f"port {port}\nbind {HOST}\nprotected-mode no\ndir {directory}\n"
            "sentinel resolve-hostnames no\nsentinel announce-hostnames no\n"
            f"sentinel monitor {self.service} {HOST} {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 5000\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        command = [SERVER, str(config), "--sentinel"]
        return Node("sentinel", port, directory, command, "sentinel", self.name)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start master and replica, wait until the replica is in sync (so the Sentinels'
        first INFO of the master lists it), start the Sentinels, wait until each knows the
        master, the replica and the two other Sentinels."""
        began = time.monotonic()
        self.master.start()
        self.replica.start()
        self._wait(
            f"{self.replica.name} in sync",
            lambda: check_replicating(self.replica, self.master.port),
            timeout,
        )
        for sentinel in self.sentinels:
            sentinel.start()
        self._wait("every Sentinel knows master, replica and peers", self._acquainted, timeout)
        self._timed("start", began)

    def _acquainted(self) -> None:
        for sentinel in self.sentinels:
            sentinel.check_running()
            state: Any = sentinel.client.sentinel_master(self.service)
            seen = (state["port"], state["num-slaves"], state["num-other-sentinels"])
            if seen != (self.master.port, 1, 2):
                raise NotYet(f"{sentinel.name}: (master port, replicas, other sentinels) {seen}")

    def current_master(self) -> tuple[str, int]:
        """The master's address as the first Sentinel that answers names it."""
        errors = []
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            try:
                address: Any = sentinel.client.sentinel_get_master_addr_by_name(self.service)
            except RedisError as error:
                errors.append(f"{sentinel.name}: {error}")
                continue
            if address:
                return str(address[0]), int(address[1])
            errors.append(f"{sentinel.name}: no master")
        raise DeploymentError(f"{self.name}: no Sentinel names the master ({errors})")

    def kill_master(self) -> None:
        """SIGKILL the master; its data is gone (no persistence)."""
        self.master.kill()

    def wait_failover(self, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """After :meth:`kill_master`: until every Sentinel names the replica as master and it
        answers ROLE as master. Returns the new master."""
        began = time.monotonic()
        new = self.replica
        self._wait(f"{new.name} promoted by every Sentinel", lambda: self._promoted(new), timeout)
        self._swap()
        self._timed("wait_failover", began)
        return new

    def _promoted(self, new: Node) -> None:
        for sentinel in self.sentinels:
            address: Any = sentinel.client.sentinel_get_master_addr_by_name(self.service)
            if not address or int(address[1]) != new.port:
                raise NotYet(f"{sentinel.name} names {address} as master")
        role = new.client.role()[0]
        if role != "master":
            raise NotYet(f"{new.name} is still {role}")

    def _swap(self) -> None:
        self.master, self.replica = self.replica, self.master
        self.master.role, self.master.master_port = "master", None
        self.replica.role, self.replica.master_port = "replica", self.master.port

    def failover(self, timeout: float = FAILOVER_TIMEOUT, *, demote: bool = True) -> Node:
        """A graceful failover (SENTINEL FAILOVER): until every Sentinel names the replica as
        master, it answers as master, and the old master is in sync with it and seen by every
        Sentinel as a healthy replica. Returns the new master.

        SENTINEL FAILOVER is asked again while it answers an error (NOGOODSLAVE while the
        Sentinel's view of the replica is stale). Sentinel itself turns the old master into
        a replica only some 10 s after the promotion (it lets a master that should be a
        replica report so for four hello periods first); with ``demote`` the harness sends
        it the same REPLICAOF as soon as every Sentinel names the new master, so the
        failover takes about 1.5 s instead of 11.
        """
        began = time.monotonic()
        old, new = self.master, self.replica
        requested, demoted = False, not demote

        def swapped() -> None:
            nonlocal requested, demoted
            if not requested:
                self.sentinels[0].client.sentinel_failover(self.service)
                requested = True
            self._promoted(new)
            if not demoted:
                old.client.replicaof(HOST, new.port)
                demoted = True
            check_replicating(old, new.port)
            self._check_replica_seen(old)

        self._wait(f"{new.name} taking over from {old.name}", swapped, timeout)
        self._swap()
        self._timed("failover", began)
        return new

    def _check_replica_seen(self, replica: Node) -> None:
        for sentinel in self.sentinels:
            rows: list[dict[str, Any]] = sentinel.client.sentinel_slaves(self.service)
            flags = next((_flags(row) for row in rows if row["port"] == replica.port), None)
            if flags is None or flags & SENTINEL_DOWN_FLAGS:
                raise NotYet(f"{sentinel.name} sees {replica.name} with flags {flags}")

    def rejoin(self, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """After a failover that killed the old master: start it again, empty, as a replica
        of the new master (REPLICAOF at once, as Sentinel itself would some 10 s later) and
        wait until it is in sync and every Sentinel sees it. Returns it."""
        began = time.monotonic()
        old = self.replica
        old.start()
        old.client.replicaof(HOST, self.master.port)

        def rejoined() -> None:
            check_replicating(old, self.master.port)
            self._check_replica_seen(old)

        self._wait(f"{old.name} replicating {self.master.name}", rejoined, timeout)
        self._timed("rejoin", began)
        return old

    def cut_off_replica(self, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """The first step of a failover that loses acknowledged writes, as
        :meth:`Cluster.cut_off_replica` does it. Promote within about 10 s: Sentinel skips a
        replica whose link has been down longer than 10 x down-after-milliseconds (plus the
        time the master has been down). Returns the replica."""
        return self._cut_off(self.master, self.replica, timeout)

    def promote_lagging_replica(self, timeout: float = FAILOVER_TIMEOUT) -> Node:
        """The second step: SIGKILL the master and wait until the Sentinels promote the
        cut-off replica. Writes acknowledged after the cut are gone. Returns the new master."""
        self.kill_master()
        return self.wait_failover(timeout)

    @contextmanager
    def lose_writes_failover(self) -> Iterator[Node]:
        """:meth:`cut_off_replica` on entry, :meth:`promote_lagging_replica` on a clean exit;
        yields the replica, which is the new master after the block."""
        replica = self.cut_off_replica()
        yield replica
        self.promote_lagging_replica()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _flags(state: dict[str, Any]) -> set[str]:
    """A Sentinel state's flags (a string in RESP2 replies, a set in RESP3 ones)."""
    flags = state["flags"]
    return set(flags.split(",")) if isinstance(flags, str) else set(flags)


@contextmanager
def cluster(
    masters: int = 3,
    replicas: int = 0,
    *,
    node_timeout_ms: int = NODE_TIMEOUT_MS,
    parent: Path | None = None,
) -> Iterator[Cluster]:
    """A started :class:`Cluster`, closed after the block; skips without the binaries."""
    require_deployment()
    with Cluster(masters, replicas, node_timeout_ms=node_timeout_ms, parent=parent) as started:
        yield started


@contextmanager
def sentinels(*, down_after_ms: int = 1000, parent: Path | None = None) -> Iterator[Sentinels]:
    """Started :class:`Sentinels`, closed after the block; skips without the binaries."""
    require_deployment()
    with Sentinels(down_after_ms=down_after_ms, parent=parent) as started:
        yield started
