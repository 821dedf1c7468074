"""Placement on a real llama-server in router mode: the real model, Gemma 3
270M, under two names, one loaded at a time. A model declared to want one
warm replica is loaded by the fleet itself: no data plane runs, so no
client can have asked for it."""

import json
import tempfile
from pathlib import Path

import pytest

from harness import Fleet, http_get, llama_server, real_model, wait_until


@pytest.fixture(scope="module")
def router():
    tmp = Path(tempfile.mkdtemp(prefix="inferyes-e2e-placement-"))
    fleet = Fleet(tmp)
    fleet.llama_server = llama_server()
    catalog = tmp / "router-models"
    catalog.mkdir()
    for name in ("gemma-a", "gemma-b"):
        (catalog / f"{name}.gguf").symlink_to(real_model())
    try:
        fleet.start_etcd()
        fleet.start_controller()
        fleet.router_url = fleet.start_llama_router("llama-r", catalog, 1, ["-np", "1"])
        fleet.start_agent("node-r", [("router", fleet.router_url, [])])
        yield fleet
    finally:
        fleet.stop()
        print(f"\nend-to-end logs (placement): {fleet.logs}")


def states(fleet):
    """Each model's state on node-r, as the fleet sees it."""
    return {m["id"]: [p["state"] for p in m["placements"] if p["node_id"] == "node-r"][0]
            for m in fleet.ctl("models")["models"]}


def router_states(fleet):
    """Each model's state, as the router itself says."""
    return {m["id"]: m["status"]["value"] for m in json.loads(http_get(f"{fleet.router_url}/v1/models")[1])["data"]}


def test_a_model_declared_to_want_a_replica_is_loaded_without_a_client(router):
    wait_until("both models listed, neither loaded",
               lambda: states(router) == {"gemma-a": "cold", "gemma-b": "cold"})
    policy = router.ctl("policy", "set", "--replicas", "gemma-b=1")
    assert policy["replicas"] == {"gemma-b": {"min": 1, "max": 0}}, policy

    wait_until("gemma-b loaded by placement", lambda: router_states(router)["gemma-b"] == "loaded", timeout=120)
    assert router_states(router)["gemma-a"] == "unloaded"
    wait_until("the fleet sees it warm", lambda: states(router)["gemma-b"] == "warm")
    [model] = [m for m in router.ctl("models")["models"] if m["id"] == "gemma-b"]
    assert (model["desired_replicas"], model["loaded_on"]) == (1, ["node-r"]), model
    wait_until("the order settled", lambda: not [m for m in router.ctl("models")["models"]
                                                 if m["id"] == "gemma-b"][0]["placing"])
