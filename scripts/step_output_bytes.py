"""Bytes of one decode step's ``EngineOutputBatch`` with stop strings flagged vs carried.

Runs the real (pure) scheduler over a batch of requests that each have stop strings,
answers its steps with random token ids of the SmolLM2 vocabulary until every window
is full, then encodes one step's outputs twice: as sent now (each output flags that
its request has stop strings; the detokenizers got them once, by broadcast) and as
before (each output carrying the stop strings), plus the one-off broadcast.

    .venv/bin/python scripts/step_output_bytes.py [--requests 32] [--stops 4] [--chars 20]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler.request import Request  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from shared.config import CacheConfig, SchedulerConfig  # noqa: E402
from shared.protocol import (  # noqa: E402
    ENGINE_OUTPUT_BATCH,
    STOP_STRINGS,
    EngineOutputBatch,
    ModelRunnerOutput,
    RequestStopStrings,
    SamplingParams,
    StopStrings,
)
from shared.token_window import window_tokens  # noqa: E402

VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--stops", type=int, default=4, help="stop strings per request")
    parser.add_argument("--chars", type=int, default=20, help="characters per stop string")
    args = parser.parse_args()
    rng = random.Random(0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=8192),
                          CacheConfig(block_size=16), num_blocks=4096, max_model_len=8192)
    stops = {}
    for i in range(args.requests):
        stop = ["".join(rng.choice("abcdefghij ") for _ in range(args.chars)) for _ in range(args.stops)]
        stops[f"cmpl-{i:032x}-0-0"] = stop
        prompt = [rng.randrange(VOCAB) for _ in range(40)]
        scheduler.add_request(Request(f"cmpl-{i:032x}-0-0", prompt, SamplingParams(max_tokens=4096, stop=stop),
                                      gateway_id="a1b2c3d4e5f6"))
    window = window_tokens(next(iter(stops.values())))
    for _ in range(window + 2):
        step = scheduler.schedule()
        tokens = [[rng.randrange(VOCAB)] for _ in step.scheduled_req_ids]
        outputs = scheduler.update_from_output(step, ModelRunnerOutput(step.step_id, step.scheduled_req_ids, tokens))
    after = ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch(outputs, "0"))
    carried = [msgspec.structs.replace(o, stop=stops[o.request_id], has_stop=False) for o in outputs]
    before = ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch(carried))
    broadcast = STOP_STRINGS.encode(StopStrings([RequestStopStrings(r, s) for r, s in stops.items()]))
    print(f"{len(outputs)} requests x {args.stops} stop strings of {args.chars} chars, "
          f"window {window} + 1 new token each")
    print(f"one step's EngineOutputBatch, stop strings carried (before): {len(before)} bytes")
    print(f"one step's EngineOutputBatch, stop strings flagged (after):  {len(after)} bytes "
          f"({len(after) / len(before):.2f}x)")
    print(f"the broadcast of all their stop strings, sent once:           {len(broadcast)} bytes")


if __name__ == "__main__":
    main()
