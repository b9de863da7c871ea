"""Failures: a node that stops is declared dead within the stated bound and its running
sandboxes are reported lost (never dropped), new creates go elsewhere; the scheduler and
the gateway hold no state (restarted, routing comes back); a Redis that lost everything
is rebuilt from the heartbeats within one heartbeat period."""

from __future__ import annotations

import time

import httpx
import redis

from host.cluster.store import Keys
from host.orchestrator.errors import SandboxNotFound

from .harness import HEARTBEAT_S, MISSES, SWEEP_S, USER_PORT, Cluster
from .test_gateway import api, create, where

DEAD_BOUND_S = HEARTBEAT_S * MISSES + SWEEP_S   # documented: misses x interval + one sweep


def wait_for(what, check, timeout_s: float) -> float:
    """Poll `check()` until true; returns the seconds it took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - start


def forgotten(node, sandbox_id: str) -> bool:
    """Whether `node`'s orchestrator no longer knows the sandbox."""
    try:
        node.run(node.orch.get(sandbox_id))
    except SandboxNotFound:
        return True
    return False


def node_state(c: httpx.Client, node_id: str) -> str:
    return str(c.get(f"/nodes/{node_id}").json()["state"])


def test_dead_node_is_detected_and_its_sandboxes_lost(cluster: Cluster) -> None:
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(6)]
        placed = where(cluster, c)
        victim = placed[ids[0]]
        mine = [i for i in ids if placed[i] == victim]
        running, paused = mine[0], mine[1]
        assert c.post(f"/sandboxes/{paused}/pause", json={}).status_code == 204
        stopped_at = time.monotonic()
        cluster.node(victim).stop()
        took = wait_for("dead", lambda: node_state(c, victim) == "dead",
                        DEAD_BOUND_S + 1.0)
        # the node stopped heartbeating at most one interval before it stopped
        assert time.monotonic() - stopped_at <= DEAD_BOUND_S + 1.0, took
        wait_for("swept", lambda: c.get(f"/nodes/{victim}").json().get("deadSince"),
                 SWEEP_S * 5 + 1)
        node = c.get(f"/nodes/{victim}").json()
        assert node["lostSandboxes"] == [running]
        assert node["sandboxStates"] == {"lost": 1, "paused": 1}

        r = c.get(f"/sandboxes/{running}")
        assert r.status_code == 410
        assert r.json()["error_code"] == "sandbox_lost" and victim in r.json()["message"]
        assert c.post(f"/sandboxes/{running}/timeout", json={"timeout": 9}).status_code == 410
        r = c.delete(f"/sandboxes/{running}")
        assert r.status_code == 404 and "lost" in r.json()["message"]
        assert c.get(f"/sandboxes/{running}").status_code == 410     # still reported
        r = httpx.get(f"{cluster.url}/", headers={"E2b-Sandbox-Id": running,
                                                  "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 502 and "was not found" in r.json()["message"]

        # paused on the dead node: until a connect, it waits there (not resumed for a GET)
        r = c.get(f"/sandboxes/{paused}")
        assert r.status_code == 503 and r.json()["error_code"] == "sandbox_node_dead"
        assert r.headers["should-retry"] == "false"

        # the listing leaves the dead node out; new creates go to the others
        listed = {s["sandboxID"] for s in c.get("/v2/sandboxes").json()}
        assert listed == {i for i in ids if placed[i] != victim}
        new = [create(c)["sandboxID"] for _ in range(4)]
        assert victim not in {where(cluster, c)[i] for i in new}

        # a connect resumes it on another node, from the handoff its node left at the pause
        r = c.post(f"/v2/sandboxes/{paused}/connect", json={"timeout": 120})
        assert r.status_code == 201, r.text
        assert r.json()["sandboxID"] == paused
        now = where(cluster, c)[paused]
        assert now != victim
        assert c.get(f"/sandboxes/{paused}").json()["state"] == "running"
        r = httpx.get(f"{cluster.url}/", headers={"E2b-Sandbox-Id": paused,
                                                  "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 200 and r.json()["node"] == now   # traffic reaches it there
        assert paused not in cluster.repository.handoffs  # running: withdrawn

        # the dead node comes back: its stale paused copy is dropped, not re-bound
        cluster.node(victim).start()
        wait_for("ready", lambda: node_state(c, victim) == "ready", 5)
        back = cluster.node(victim)
        wait_for("forgotten", lambda: forgotten(back, paused), 5)
        assert where(cluster, c)[paused] == now
        assert c.get(f"/sandboxes/{paused}").json()["state"] == "running"


def test_node_back_after_death_is_ready_again(cluster: Cluster) -> None:
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(3)]
        placed = where(cluster, c)
        node = cluster.node(placed[ids[0]])
        node.stop()
        wait_for("dead", lambda: c.get(f"/nodes/{node.node_id}").json().get("deadSince"),
                 DEAD_BOUND_S + 2)
        assert c.get(f"/sandboxes/{ids[0]}").status_code == 410
        node.start()   # same state dir: the fake VMs are gone, its recovery settles them
        wait_for("ready", lambda: node_state(c, node.node_id) == "ready", 5)
        assert c.get(f"/nodes/{node.node_id}").json()["lostSandboxes"] == []


def test_scheduler_and_gateway_restart(cluster: Cluster) -> None:
    with api(cluster) as c:
        before = [create(c)["sandboxID"] for _ in range(3)]
    cluster.stop_scheduler()
    with api(cluster) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 503 and r.json()["code"] == 503   # and retryable
        assert "should-retry" not in r.headers
        assert c.get(f"/sandboxes/{before[0]}").status_code == 200  # routing needs no scheduler
    cluster.stop_gateway()
    cluster.start_scheduler()
    cluster.start_gateway()
    with api(cluster) as c:
        for sid in before:
            assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"
        after = create(c)["sandboxID"]
        assert {s["sandboxID"] for s in c.get("/v2/sandboxes").json()} == {*before, after}
        r = httpx.get(f"{cluster.url}/", headers={"E2b-Sandbox-Id": after,
                                                  "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.json()["node"] == where(cluster, c)[after]


def test_flushed_redis_is_rebuilt_from_heartbeats(cluster: Cluster) -> None:
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(6)]
        placed = where(cluster, c)
        c.post(f"/sandboxes/{ids[0]}/pause", json={})
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    keys = Keys()
    try:
        r.flushall()
        flushed = time.monotonic()

        def rebuilt() -> bool:
            if r.scard(keys.nodes) != 3:
                return False
            return all(r.hget(keys.sandbox(i), "node") == placed[i] for i in ids)

        took = wait_for("rebuilt", rebuilt, HEARTBEAT_S * 2)
        assert took <= HEARTBEAT_S + 0.5, took      # the next heartbeat of each node
        assert r.hget(keys.sandbox(ids[0]), "state") == "paused"
        assert {r.hget(keys.sandbox(i), "state") for i in ids[1:]} == {"running"}
        assert time.monotonic() - flushed < HEARTBEAT_S * 2
    finally:
        r.close()
    with api(cluster) as c:
        assert all(n["state"] == "ready" for n in c.get("/nodes").json())
        assert c.get(f"/sandboxes/{ids[1]}").status_code == 200


def test_unbound_sandbox_is_found_on_its_node(cluster: Cluster) -> None:
    """A binding the index lost before the next heartbeat: the gateway asks the nodes."""
    with api(cluster) as c:
        sid = create(c)["sandboxID"]
        r = redis.Redis.from_url(cluster.redis_url)
        r.delete(Keys().sandbox(sid))
        r.close()
        assert c.get(f"/sandboxes/{sid}").json()["sandboxID"] == sid
        r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        assert r.hget(Keys().sandbox(sid), "node") == where(cluster, c)[sid]
        r.close()


def test_draining_node_takes_no_new_sandboxes(cluster: Cluster) -> None:
    with api(cluster) as c:
        first = create(c)["sandboxID"]
        holder = cluster.node(where(cluster, c)[first])
        assert holder.heartbeat is not None
        holder.heartbeat.draining = True
        wait_for("draining", lambda: node_state(c, holder.node_id) == "draining",
                 HEARTBEAT_S * 3)
        new = [create(c)["sandboxID"] for _ in range(4)]
        assert holder.node_id not in {where(cluster, c)[i] for i in new}
        assert c.get(f"/sandboxes/{first}").json()["state"] == "running"   # still served


def test_a_drained_node_back_resumes_only_what_no_other_node_took(cluster: Cluster) -> None:
    """A node drained at its stop (a container restart, an upgrade) leaves its sandboxes
    paused with their handoffs; while it is away, a connect resumes one of them on another
    node. Back, the node resumes the other by itself (drain.py), but not the one taken
    over: that one runs once, where it was taken. (Resumed before the node's first
    heartbeat, it ran on both.)"""
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(6)]
        placed = where(cluster, c)
        victim = placed[ids[0]]
        taken, kept = [i for i in ids if placed[i] == victim][:2]
        node = cluster.node(victim)
        assert node.heartbeat is not None
        # what host/__main__.py does at a SIGTERM with --drain-on-stop
        assert node.run(node.heartbeat.now(draining=True))
        assert node_state(c, victim) == "draining"
        report = node.run(node.orch.drain(), timeout=60)
        assert {taken, kept} <= set(report.paused) and not report.failed
        assert node.run(node.heartbeat.now())
        node.stop()
        wait_for("dead", lambda: node_state(c, victim) == "dead", DEAD_BOUND_S + 1.0)

        r = c.post(f"/v2/sandboxes/{taken}/connect", json={"timeout": 120})
        assert r.status_code == 201, r.text
        elsewhere = where(cluster, c)[taken]
        assert elsewhere != victim

        node.start()
        wait_for("ready", lambda: node_state(c, victim) == "ready", 5)
        wait_for("forgotten", lambda: forgotten(node, taken), 5)
        wait_for("resumed", lambda: node.run(node.orch.get(kept)).state.value == "running",
                 10)
        assert c.get(f"/sandboxes/{kept}").json()["state"] == "running"
        assert c.get(f"/sandboxes/{taken}").json()["state"] == "running"
        r = httpx.get(f"{cluster.url}/", headers={"E2b-Sandbox-Id": taken,
                                                  "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 200 and r.json()["node"] == elsewhere
        r = httpx.get(f"{cluster.url}/", headers={"E2b-Sandbox-Id": kept,
                                                  "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 200 and r.json()["node"] == victim
