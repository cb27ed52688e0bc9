"""The speculative decoding counters in /metrics: vLLM's names, summed over engines."""

from services.gateway.metrics import EngineStatsStore, GatewayMetrics
from shared.protocol import EngineStats


def test_spec_decode_counters_are_summed_over_engines_by_position():
    store = EngineStatsStore()
    store.update(EngineStats("a", spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                             spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=[4, 2, 1]))
    store.update(EngineStats("b", spec_decode_num_drafts=1, spec_decode_num_draft_tokens=2,
                             spec_decode_num_accepted_tokens=1, spec_decode_num_accepted_tokens_per_pos=[1, 0]))
    store.update(EngineStats("c"))  # an engine without speculative decoding
    text = GatewayMetrics("m", store).render().decode()
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("natsllm:spec_decode")}
    assert lines == {
        'natsllm:spec_decode_num_drafts_total{model_name="m"}': 5.0,
        'natsllm:spec_decode_num_draft_tokens_total{model_name="m"}': 14.0,
        'natsllm:spec_decode_num_accepted_tokens_total{model_name="m"}': 8.0,
        'natsllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}': 5.0,
        'natsllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}': 2.0,
        'natsllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}': 1.0,
    }
