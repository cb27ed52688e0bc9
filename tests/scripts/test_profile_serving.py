"""scripts/profile_serving.py: a worker's py-spy samples sorted into the parts of a step."""

from __future__ import annotations

from profile_serving import read_py_spy

FORWARD = ("Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83);"
           "_WorkItem.run (concurrent/futures/thread.py:58);ModelRunner.execute_model (services/worker/model_runner.py:326)")
MODEL = FORWARD + ";LlamaForCausalLM.forward (services/worker/models/llama.py:260)"
LAYER = MODEL + ";LlamaDecoderLayer.forward (services/worker/models/llama.py:172)"


def test_samples_go_to_their_part_of_the_step(tmp_path):
    raw = tmp_path / "worker.txt"
    raw.write_text("\n".join([
        LAYER + ";LlamaMLP.forward (llama.py:152);prepacked_linear.<locals>.linear (linear.py:51) 50",
        # the LM head is a prepacked product too, but counts as the logits
        FORWARD + ";LlamaForCausalLM._logits (llama.py:282);prepacked_linear.<locals>.linear (linear.py:51) 7",
        LAYER + ";LlamaAttention.forward (llama.py:118);paged_attention_cpu (paged_attention_torch.py:312);"
                "decode_attention_native (paged_attention_torch.py:286) 11",
        LAYER + ";LlamaAttention.forward (llama.py:118);paged_attention_cpu (paged_attention_torch.py:322);"
                "paged_attention_ref (paged_attention_torch.py:240);_attend_group (paged_attention_torch.py:176) 5",
        LAYER + ";rms_norm_cpu (kernels/rms_norm.py:83) 3",
        MODEL + ";embedding (torch/nn/functional.py:2615) 2",
        FORWARD + ";Sampler.__call__ (services/worker/sampler.py:33) 4",
        FORWARD + " 1",
        "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 9",
        "<module> (services/worker/__main__.py:60);BaseEventLoop._run_once (asyncio/base_events.py:1922) 6",
    ]) + "\n")
    assert read_py_spy(raw) == {
        "weight products (oneDNN)": 50,
        "logits (LM head)": 7,
        "attention, per token (C decode kernel)": 11,
        "attention, prefill (padded SDPA)": 5,
        "RMSNorm, rotary + KV write, SiLU (C kernels)": 3,
        "model glue (embedding, module calls, splits)": 2,
        "sampling": 4,
        "batch update, inputs, output (Python)": 1,
        "forward thread, between steps": 9,
        "event loop thread (bus, step messages)": 6,
    }
