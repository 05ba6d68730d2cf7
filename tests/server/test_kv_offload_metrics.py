"""The prefix cache's host-tier counters on /metrics."""

from __future__ import annotations

from kvloop.core.host_tier import HostTierStats
from kvloop.core.stats import SchedulerStats
from kvloop.engine.stats import EngineStats
from kvloop.server.metrics import ServerMetrics


def _stats(host: HostTierStats | None) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_swapped=0, num_unfinished=0,
                       kv_usage=0.0, scheduler=SchedulerStats(), host_tier=host,
                       kv_block_bytes=1024)


def test_host_tier_counters_grow_with_the_snapshots() -> None:
    m = ServerMetrics("tiny")
    m.observe_stats(_stats(HostTierStats(host_hit_blocks=3, blocks_loaded=3, blocks_stored=5)))
    m.observe_stats(_stats(HostTierStats(host_hit_blocks=4, blocks_loaded=4, blocks_stored=5,
                                         host_evictions=2)))
    text = m.render().decode()
    assert 'kvloop:kv_offload_blocks_loaded_total{model_name="tiny"} 4.0' in text
    assert 'kvloop:kv_offload_bytes_stored_total{model_name="tiny"} 5120.0' in text
    assert 'kvloop:kv_offload_host_evictions_total{model_name="tiny"} 2.0' in text


def test_no_host_tier_leaves_the_counters_at_zero() -> None:
    m = ServerMetrics("tiny")
    m.observe_stats(_stats(None))
    assert 'kvloop:kv_offload_blocks_loaded_total{model_name="tiny"} 0.0' in m.render().decode()
