"""Runs the whole stack in the foreground until Ctrl-C or SIGTERM (see scripts/serve),
showing what each service does until the stack serves, then its URL.

A process of the stack that dies is restarted by the launcher's supervisor
(services/launch/supervisor.py); the launcher stops the stack only on a signal or when
one keeps dying (its crash-loop budget, --crash-loop-restarts within --crash-loop-window
seconds, is spent), and then exits with status 1 naming it. Flags other than its own go
to the services that take them, e.g. ``--max-num-seqs`` to the scheduler and workers,
``--served-model-name`` or ``--api-key`` to the gateway.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.launch.stack import Stack, StackConfig  # noqa: E402
from services.launch.supervisor import CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW, CrashLoopBudget  # noqa: E402
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
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="data-parallel engines, each its own scheduler and --tp worker ranks; the tokenizers' "
                             "routers place each request on one (--router-mode); with P/D, per prefill and per "
                             "decode instance")
    parser.add_argument("--cpu-omp-threads-bind", default="auto",
                        help="CPU cores of each worker: auto (this machine's cores split evenly among the workers "
                             "when there are several), nobind (each worker every core), or one core list per "
                             "worker separated by | (engines in order, their ranks within), e.g. 0-7|8-15")
    parser.add_argument("--crash-loop-restarts", type=int, default=CRASH_LOOP_RESTARTS,
                        help="a process that dies again after this many restarts within --crash-loop-window "
                             "seconds is in a crash loop: the stack stops")
    parser.add_argument("--crash-loop-window", type=float, default=CRASH_LOOP_WINDOW, help="seconds")
    args, service_args = parser.parse_known_args()
    try:
        crash_loop = CrashLoopBudget(args.crash_loop_restarts, args.crash_loop_window)
    except ValueError as e:
        parser.error(str(e))
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
                data_parallel_size=args.data_parallel_size,
                cpu_omp_threads_bind=args.cpu_omp_threads_bind,
                crash_loop=crash_loop,
            )
        )
    except ConfigError as e:
        parser.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stack.start()
        stack.wait_ready(show=lambda line: print(line, flush=True))
        print(f"serving on {stack.base_url} (OpenAI API under /v1, fleet status on {stack.base_url}/dashboard); "
              f"Ctrl-C stops", flush=True)
        # A dead process is the supervisor's to restart; only a crash loop ends the stack.
        while not stop.wait(1.0):
            looping = stack.crash_loops()
            if looping:
                print(f"crash loop: {'; '.join(looping.values())}; stopping the stack", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
