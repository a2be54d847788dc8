"""The real Redis deployments of tests/helpers/deployments.py, tested against real processes.

Each test starts its own deployment and prints how long its start and failovers took
(``pytest -rP`` or ``-s`` shows them).
"""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
from redis import Redis
from redis.cluster import RedisCluster
from redis.exceptions import MovedError
from redis.sentinel import Sentinel

from tests.helpers import deployments
from tests.helpers.deployments import (
    HOST,
    SERVICE,
    Cluster,
    Deployment,
    DeploymentError,
    Node,
    cluster,
    sentinels,
)

pytestmark = pytest.mark.slow  # real deployments; bounded waits, so they share the machine


class Boom(Exception):
    """Raised inside a deployment's block to stand for a failing test."""


def report(deployment: Deployment) -> None:
    timings = ", ".join(f"{operation} {seconds:.2f} s" for operation, seconds in deployment.timings)
    print(f"{deployment.name}: {timings}")


def keys_on_every_master(deployment: Cluster) -> dict[str, Node]:
    """One key per master of ``deployment``, with the master that serves it."""
    found: dict[int, tuple[str, Node]] = {}
    for i in itertools.count():
        key = f"key-{i}"
        master = deployment.master_of_key(key)
        found.setdefault(master.port, (key, master))
        if len(found) == len(deployment.masters):
            return dict(found.values())
    raise AssertionError("unreachable")


def cluster_client(deployment: Cluster) -> RedisCluster:
    return RedisCluster.from_url(deployment.url, decode_responses=True, socket_timeout=5)


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- Cluster ------------------------------------------------------------------------------


def test_cluster_routes_every_key_to_the_master_serving_its_slot() -> None:
    with cluster(masters=3) as deployment:
        masters = deployment.masters
        assert len(masters) == 3
        assert not deployment.replicas
        addresses = [f"{HOST}:{node.port}" for node in masters]
        assert deployment.cluster_url == "redis+cluster://" + ",".join(addresses)
        assert deployment.url == f"redis://{addresses[0]}/0"
        keys = keys_on_every_master(deployment)
        client = cluster_client(deployment)
        try:
            for key in keys:
                assert client.set(key, key)
        finally:
            client.close()
        for key, master in keys.items():
            assert master.client.get(key) == key
            for other in masters:
                if other is not master:
                    with pytest.raises(MovedError):
                        other.client.get(key)
        with pytest.raises(DeploymentError, match=r"cluster 3\+0 .* has no replica"):
            deployment.wait_failover(masters[0], timeout=1)
        report(deployment)


def test_close_kills_every_process_even_when_the_block_fails() -> None:
    with pytest.raises(Boom), cluster(masters=3) as deployment:
        pids = [node.process.pid for node in deployment.nodes if node.process is not None]
        assert len(pids) == 3
        deployment.stop(deployment.nodes[0])
        raise Boom
    assert not [pid for pid in pids if pid_exists(pid)]
    assert not deployment.directory.exists()
    assert not any(node.alive for node in deployment.nodes)


def test_cluster_kill_master_promotes_its_replica_with_the_replicated_writes() -> None:
    with cluster(masters=3, replicas=1) as deployment:
        assert len(deployment.masters) == 3
        assert len(deployment.replicas) == 3
        assert {deployment.replica_of(node).master_port for node in deployment.masters} == {
            node.port for node in deployment.masters
        }
        master = deployment.master_of_key("survivor")
        replica = deployment.replica_of(master)
        assert master.client.set("survivor", "before")
        assert master.client.wait(1, 1000) == 1

        deployment.kill(master)
        assert deployment.wait_failover(master) is replica
        assert replica.role == "master"
        assert deployment.master_of_key("survivor") is replica
        client = cluster_client(deployment)
        try:
            assert client.get("survivor") == "before"
        finally:
            client.close()

        deployment.restart(master)
        assert (master.role, master.master_port) == ("replica", replica.port)
        assert master.client.dbsize() == 1
        report(deployment)


def test_cluster_graceful_failover_and_back_after_a_stopped_master() -> None:
    with cluster(masters=3, replicas=1) as deployment:
        master = deployment.master_of_key("graceful")
        replica = deployment.replica_of(master)
        assert master.client.set("graceful", "kept")

        deployment.failover(replica)
        assert (replica.role, master.role, master.master_port) == (
            "master",
            "replica",
            replica.port,
        )
        assert deployment.master_of_key("graceful") is replica
        assert replica.client.get("graceful") == "kept"

        deployment.stop(replica)
        assert deployment.wait_failover(replica) is master
        deployment.cont(replica)
        deployment.wait_settled()
        assert (master.role, replica.role, replica.master_port) == (
            "master",
            "replica",
            master.port,
        )
        assert master.client.get("graceful") == "kept"
        report(deployment)


def test_cluster_lose_writes_failover_loses_a_write_the_master_acknowledged() -> None:
    with cluster(masters=3, replicas=1) as deployment:
        master = deployment.master_of_key("{lost}kept")
        assert master.client.set("{lost}kept", "1")
        assert master.client.wait(1, 1000) == 1

        replica = deployment.cut_off_replica(master)
        assert master.client.set("{lost}gone", "1")
        assert master.client.wait(1, 300) == 0

        assert deployment.promote_lagging_replica(master) is replica
        assert deployment.master_of_key("{lost}gone") is replica
        client = cluster_client(deployment)
        try:
            assert client.get("{lost}kept") == "1"
            assert client.get("{lost}gone") is None
        finally:
            client.close()
        report(deployment)


# -- Sentinel -----------------------------------------------------------------------------


def sentinel_for(addresses: list[tuple[str, int]]) -> Sentinel:
    options = {"socket_timeout": 2}
    return Sentinel(addresses, sentinel_kwargs=options)  # type: ignore[no-untyped-call, unused-ignore]


def close_sentinel(sentinel: Sentinel) -> None:
    for client in sentinel.sentinels:
        client.close()


def write_through_sentinels(addresses: list[tuple[str, int]], key: str, value: str) -> None:
    """SET through redis-py's Sentinel client: on whichever server it finds as master."""
    sentinel = sentinel_for(addresses)
    master: Redis = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        SERVICE, socket_timeout=2, decode_responses=True
    )
    try:
        assert master.set(key, value)
    finally:
        master.close()
        close_sentinel(sentinel)


def test_sentinels_promote_the_replica_when_the_master_is_killed() -> None:
    with sentinels() as deployment:
        master, replica = deployment.master, deployment.replica
        hosts = ",".join(f"{HOST}:{node.port}" for node in deployment.sentinels)
        assert deployment.url == f"redis+sentinel://{hosts}/mymaster/0"
        assert deployment.service == SERVICE
        assert deployment.current_master() == (HOST, master.port)
        write_through_sentinels(deployment.sentinel_addresses, "before", "1")
        assert master.client.wait(1, 1000) == 1

        deployment.kill_master()
        assert deployment.wait_failover() is replica
        assert (deployment.master, deployment.replica) == (replica, master)
        assert deployment.current_master() == (HOST, replica.port)
        write_through_sentinels(deployment.sentinel_addresses, "after", "2")
        assert replica.client.mget("before", "after") == ["1", "2"]
        report(deployment)


def test_sentinels_graceful_failover_there_and_back() -> None:
    with sentinels() as deployment:
        first, second = deployment.master, deployment.replica
        for new, old in ((second, first), (first, second)):
            write_through_sentinels(deployment.sentinel_addresses, "key", f"on {old.port}")
            assert old.client.wait(1, 1000) == 1
            assert deployment.failover() is new
            assert (deployment.master, deployment.replica) == (new, old)
            assert deployment.current_master() == (HOST, new.port)
            assert old.client.role()[0] == "slave"
            write_through_sentinels(deployment.sentinel_addresses, "key", f"on {new.port}")
            assert new.client.get("key") == f"on {new.port}"
        report(deployment)


def test_sentinels_lose_writes_failover_loses_a_write_the_master_acknowledged() -> None:
    with sentinels() as deployment:
        master = deployment.master
        assert master.client.set("kept", "1")
        assert master.client.wait(1, 1000) == 1
        with deployment.lose_writes_failover() as replica:
            assert master.client.set("gone", "1")
            assert master.client.wait(1, 300) == 0
        assert deployment.master is replica
        assert deployment.current_master() == (HOST, replica.port)
        assert replica.client.mget("kept", "gone") == ["1", None]
        report(deployment)


# -- without the binaries -----------------------------------------------------------------


def test_without_the_binaries_deployments_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    assert not deployments.deployment_available()
    with pytest.raises(pytest.skip.Exception, match="need redis-server and redis-cli"):
        deployments.require_deployment()
    with pytest.raises(pytest.skip.Exception), cluster():
        pass


def test_without_the_binaries_deployments_fail_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI requires redis-server and redis-cli"):
        deployments.require_deployment()
