"""The KV tiers and prompt token sources in /metrics: vLLM's names, summed over engines."""

from services.gateway.metrics import EngineStatsStore, GatewayMetrics
from shared.protocol import EngineStats


def scrape(store: EngineStatsStore) -> dict[str, float]:
    text = GatewayMetrics("m", store).render().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("natsllm:") and not line.startswith("#")}


def test_prompt_tokens_by_source_and_the_tiers_are_summed_over_engines():
    store = EngineStatsStore()
    store.update(EngineStats("a", prompt_tokens_local_compute=100, prompt_tokens_local_cache_hit=32,
                             prompt_tokens_external_kv_transfer=64, external_prefix_cache_queries=80,
                             external_prefix_cache_hits=64, kv_offload_block_queries={"CPU": 5, "DISK": 3},
                             kv_offload_block_hits={"CPU": 2, "DISK": 2},
                             kv_offload_bytes={"GPU_to_CPU": 1000, "CPU_to_GPU": 500},
                             kv_offload_seconds={"GPU_to_CPU": 0.5, "CPU_to_GPU": 0.25},
                             kv_offload_cpu_cache_usage_perc=0.5, kv_offload_disk_bytes_used=300,
                             kv_offload_disk_bytes_limit=1000, kv_offload_load_failures=1))
    store.update(EngineStats("b", prompt_tokens_local_compute=10, kv_offload_block_queries={"CPU": 1},
                             kv_offload_block_hits={"CPU": 1}, kv_offload_bytes={"GPU_to_CPU": 24},
                             kv_offload_cpu_cache_usage_perc=0.25, kv_offload_disk_bytes_used=200,
                             kv_offload_disk_bytes_limit=1000))
    store.update(EngineStats("c", prompt_tokens_local_compute=1))  # no tiers
    m = scrape(store)
    assert m['natsllm:prompt_tokens_by_source_total{model_name="m",source="local_compute"}'] == 111
    assert m['natsllm:prompt_tokens_by_source_total{model_name="m",source="local_cache_hit"}'] == 32
    assert m['natsllm:prompt_tokens_by_source_total{model_name="m",source="external_kv_transfer"}'] == 64
    assert m['natsllm:prompt_tokens_cached_total{model_name="m"}'] == 96
    assert m['natsllm:external_prefix_cache_hits_total{model_name="m"}'] == 64
    assert m['natsllm:kv_offload_tiering_block_queries_total{model_name="m",tier="CPU"}'] == 6
    assert m['natsllm:kv_offload_tiering_block_hits_total{model_name="m",tier="DISK"}'] == 2
    assert m['natsllm:kv_offload_total_bytes_total{model_name="m",transfer_type="GPU_to_CPU"}'] == 1024
    assert m['natsllm:kv_offload_total_time_total{model_name="m",transfer_type="CPU_to_GPU"}'] == 0.25
    assert m['natsllm:kv_offload_cpu_cache_usage_perc{model_name="m"}'] == 0.375
    assert m['natsllm:kv_offload_disk_bytes_used{model_name="m"}'] == 300  # one shared folder
    assert m['natsllm:kv_offload_load_failures_total{model_name="m"}'] == 1


def test_no_tier_metrics_without_tiers():
    store = EngineStatsStore()
    store.update(EngineStats("a", prompt_tokens_local_compute=5))
    m = scrape(store)
    assert not any("kv_offload_tiering" in name or "cpu_cache_usage" in name for name in m)
    assert m['natsllm:prompt_tokens_cached_total{model_name="m"}'] == 0
