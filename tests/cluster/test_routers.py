"""The routers of ``kvloop.cluster.routers``: pure functions of what they are
told, shared by the Ray deployment and the cluster simulator."""

from __future__ import annotations

import pytest

from kvloop.cluster.routers import (
    MAX_ROUTED_BLOCKS,
    KVAwareRouter,
    ReplicaLoad,
    RouteRequest,
    make_router,
    route_request,
)
from kvloop.core.request import Request
from kvloop.sampling_params import SamplingParams

IDLE = {"a": ReplicaLoad(), "b": ReplicaLoad(), "c": ReplicaLoad()}


def req(rid: str, tokens: list[int], block_size: int = 4) -> RouteRequest:
    return route_request(rid, tokens, block_size)


def test_route_request_hashes_match_the_prefix_cache() -> None:
    tokens = list(range(37))
    r = Request("x", tokens, SamplingParams(max_tokens=1), cache_salt="s")
    assert list(route_request("x", tokens, 8, "s").block_hashes) == r.update_block_hashes(8)
    assert route_request("x", tokens, 8).block_hashes != route_request("x", tokens, 8,
                                                                       "s").block_hashes
    assert route_request("x", [1, 2, 3], 8).block_hashes == ()
    long = route_request("x", list(range(16 * (MAX_ROUTED_BLOCKS + 5))), 16)
    assert len(long.block_hashes) == MAX_ROUTED_BLOCKS


def test_round_robin_cycles_in_id_order() -> None:
    rr = make_router("round-robin")
    assert [rr.choose(RouteRequest(str(i)), IDLE) for i in range(6)] == list("abcabc")


def test_least_loaded_counts_waiting_and_running_then_kv() -> None:
    ll = make_router("least-loaded")
    loads = {"a": ReplicaLoad(2, 1), "b": ReplicaLoad(0, 2, 0.9), "c": ReplicaLoad(1, 1, 0.1)}
    assert ll.rank(RouteRequest("x"), loads) == ["c", "b", "a"]


def test_kv_aware_follows_the_prefix_and_spreads_new_ones() -> None:
    kv = make_router("kv-aware")
    shared = list(range(40))
    first = kv.choose(req("1", [*shared, 100]), IDLE)
    others = {kv.choose(req("2", [7] * 40), IDLE), kv.choose(req("3", [9] * 40), IDLE)}
    assert first not in others and len(others) == 2  # new prefixes go where nothing is
    assert kv.choose(req("4", [*shared, 200]), IDLE) == first
    assert kv.matched(req("5", shared[:20] + [5] * 20), list(IDLE)) == {
        first: 5, **{r: 0 for r in others}}


def test_kv_aware_pays_for_load_and_spills_when_imbalanced() -> None:
    kv = KVAwareRouter(load_penalty=0.5, imbalance=4)
    shared = list(range(40))
    home = kv.choose(req("1", shared), IDLE)
    busy = {**IDLE, home: ReplicaLoad(num_waiting=3, num_running=1)}
    assert kv.rank(req("2", shared), busy)[0] == home  # 1.0 - 0.5 > 0
    half = shared[:20] + [1] * 20
    assert kv.rank(req("3", half), busy)[0] != home  # 0.5 - 0.5 < 0 - 0
    hot = {**IDLE, home: ReplicaLoad(num_waiting=5, num_running=1)}
    assert kv.rank(req("4", shared), hot)[0] != home  # 6 more than the least: spill


def test_kv_aware_index_is_bounded_and_forgets_removed_replicas() -> None:
    kv = KVAwareRouter(cache_blocks=10)
    for i in range(20):
        kv.on_routed(req(str(i), [i] * 8), "a")
    assert len(kv._lru["a"]) == 10 and len(kv._holders) == 10
    kv.on_replica_removed("a")
    assert not kv._holders and "a" not in kv._lru


@pytest.mark.parametrize(("kwargs", "field"), [({"cache_blocks": 0}, "cache_blocks"),
                                               ({"load_penalty": -1}, "load_penalty"),
                                               ({"imbalance": -1}, "imbalance")])
def test_bad_router_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVAwareRouter(**kwargs)


def test_unknown_router_names_the_choices() -> None:
    with pytest.raises(ValueError, match="round-robin, least-loaded, kv-aware"):
        make_router("random")
