"""Runs the whole stack in the foreground until Ctrl-C or SIGTERM (see scripts/serve).

Flags other than its own go to the services that take them, e.g. ``--max-num-seqs``
to the scheduler and workers, ``--served-model-name`` or ``--api-key`` to the gateway.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.launch.stack import Stack, StackConfig  # noqa: E402
from shared.config import ConfigError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description="Serve the OpenAI-compatible API on this machine")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel worker processes")
    parser.add_argument("--tokenizers", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument("--prefill-engines", type=int, default=0,
                        help="P/D: prefill engines (kv_producer), each with --tp worker ranks")
    parser.add_argument("--decode-engines", type=int, default=0,
                        help="P/D: decode engines (kv_consumer), each with --tp worker ranks")
    parser.add_argument("--nats-cluster", type=int, default=1,
                        help="nats-servers: 1, or a cluster of N (routes between them; every service gets all "
                             "their URLs; a killed node is restarted and rejoins)")
    args, service_args = parser.parse_known_args()
    try:
        stack = Stack(
            StackConfig(
                port=args.port,
                host=args.host,
                model=args.model,
                tensor_parallel_size=args.tp,
                num_tokenizers=args.tokenizers,
                num_detokenizers=args.detokenizers,
                args=service_args,
                prefill_engines=args.prefill_engines,
                decode_engines=args.decode_engines,
                nats_cluster=args.nats_cluster,
            )
        )
    except ConfigError as e:
        parser.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stack.start()
        stack.wait_ready()
        print(f"serving on {stack.base_url} (OpenAI API under /v1); Ctrl-C stops", flush=True)
        while not stop.wait(1.0):
            dead = stack.dead_services()
            if dead:
                print(f"service(s) exited: {dead}; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
