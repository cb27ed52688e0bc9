"""Every message that crosses a process boundary, and every bus subject name.

One import for all of it (``from shared.protocol import X``); the messages live by
boundary:

    common       what several boundaries carry (SamplingParams, LoRARequest, Logprobs...)
    client       the request's way: gateway -> tokenizer -> scheduler -> detokenizer -> gateway
    step         scheduler <-> worker ranks, once per step
    control      membership, health, stats, restarts, LoRA adapters
    kv_transfer  P/D disaggregation: hand-offs, held blocks, KV pulls
    kv_offload   the tiered KV cache: stores, spills and loads of the host and disk tiers
    events       KV cache events (vLLM's schema), their replay and dump, the routers' stats
    codec        Codec (one message type's encoder/decoder) and Channel (a subject bound
                 to its message type; ``shared/bus.py`` publishes through them)

The request's way (see docs/ARCHITECTURE.md):

    gateway -> tokenizer -> scheduler ==SchedulerOutput==> workers
                                      <==ModelRunnerOutput== (rank 0)
    scheduler -> detokenizer -> gateway (EngineOutput / TextDelta)
    scheduler -> every detokenizer (StopStrings, once per request)

Hot per-step messages are ``array_like`` Structs of ints and lists of ints, encoded
with msgpack; one Encoder/Decoder per type, made once. No tensors, no pickles.
Fields of ``array_like`` Structs are only ever appended, with defaults (schema
evolution keeps old peers readable).
"""

from shared.protocol.codec import *  # noqa: F403
from shared.protocol.common import *  # noqa: F403
from shared.protocol.client import *  # noqa: F403
from shared.protocol.kv_offload import *  # noqa: F403
from shared.protocol.kv_transfer import *  # noqa: F403
from shared.protocol.step import *  # noqa: F403
from shared.protocol.control import *  # noqa: F403
from shared.protocol.events import *  # noqa: F403
