"""vLLM's ``lora_requests_info`` in /metrics: the adapters running and waiting (over all
engines) as comma-separated labels, ``max_lora``, the time of the latest stats as value;
absent when no engine serves LoRA."""

from services.gateway.metrics import EngineStatsStore, GatewayMetrics
from shared.protocol import EngineStats


def lora_lines(store) -> list[str]:
    text = GatewayMetrics("m", store).render().decode()
    return [line for line in text.splitlines() if line.startswith("natsllm:lora_requests_info")]


def test_lora_requests_info_joins_the_engines_adapters():
    store = EngineStatsStore()
    store.update(EngineStats("plain"))
    assert lora_lines(store) == []
    store.update(EngineStats("a", timestamp=1700000000.5, max_lora=2, running_lora_adapters=["x", "y"],
                             waiting_lora_adapters=["z"]))
    store.update(EngineStats("b", timestamp=1700000001.0, max_lora=2, running_lora_adapters=["w", "x"]))
    assert lora_lines(store) == [
        'natsllm:lora_requests_info{max_lora="2",running_lora_adapters="w,x,y",waiting_lora_adapters="z"} '
        '1.700000001e+09'
    ]


def test_idle_engine_reports_empty_adapter_lists():
    store = EngineStatsStore()
    store.update(EngineStats("a", timestamp=5.0, max_lora=4))
    assert lora_lines(store) == ['natsllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
                                 'waiting_lora_adapters=""} 5.0']
