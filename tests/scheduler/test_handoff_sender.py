"""P/D, prefill side, on a real NATS server: a prefill scheduler just started (restarted by
the launcher, say) hears the decode engines before it hands its first request off, rather
than finding none and decoding the request itself."""

from __future__ import annotations

import asyncio

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.request import Request
from shared.config import KV_CONSUMER, KV_PRODUCER, KVTransferConfig, SchedulerConfig
from shared.protocol import (
    ENGINE_STATS_CHANNEL,
    KV_HANDOFF_CHANNEL,
    EngineOutput,
    EngineRequest,
    EngineStats,
    KVHandoffReply,
    KVTransferParams,
    SamplingParams,
)
from tests.scheduler.test_scheduler_service import GATEWAY, scheduler_on_bus

DECODE = "d0"
DECODE_STATS_AFTER = 0.4  # seconds: a decode engine's stats come once a second


async def test_a_prefill_engine_just_started_hears_the_decode_engines_before_it_hands_off():
    async with scheduler_on_bus(SchedulerConfig(max_num_batched_tokens=64),
                                kv_transfer_config=KVTransferConfig(kv_role=KV_PRODUCER),
                                service_config=SchedulerServiceConfig(stats_interval=0.2)) as (service, nc, _):
        handed: list[str] = []

        async def decode_engine_takes(msg):
            handed.append(KV_HANDOFF_CHANNEL.decode(msg.data).request.request_id)
            await msg.respond(KV_HANDOFF_CHANNEL.encode_reply(KVHandoffReply(True, "", DECODE, "inc-d0", 1)))

        async def decode_engine_stats():
            while True:
                await asyncio.sleep(DECODE_STATS_AFTER)
                stats = EngineStats(DECODE, ready=True, incarnation="inc-d0", kv_role=KV_CONSUMER)
                await nc.publish(ENGINE_STATS_CHANNEL.subject(), ENGINE_STATS_CHANNEL.encode(stats))

        await nc.subscribe(KV_HANDOFF_CHANNEL.subject(DECODE), cb=decode_engine_takes)
        stats_task = asyncio.get_running_loop().create_task(decode_engine_stats())
        try:
            # A request prefilled the moment the engine started, before any decode engine's stats.
            request = Request.from_engine_request(
                EngineRequest("r-0-0", list(range(100, 140)), SamplingParams(max_tokens=4), gateway_id=GATEWAY), 16)
            request.append_output_tokens([9])
            output = EngineOutput("r-0-0", GATEWAY, [9], [9], 0, 40)
            params = KVTransferParams(service.engine_id, service.incarnation, 40, 3)
            taken = await asyncio.wait_for(service.handoff_sender._hand_off_one(request, params, output), 10)
            assert taken and handed == ["r-0-0"]
            assert (output.owner_engine_id, output.owner_incarnation) == (DECODE, "inc-d0")
        finally:
            stats_task.cancel()
