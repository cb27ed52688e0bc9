"""``python -m services.scheduler``: one engine's scheduler on the bus."""

from shared import engine_args
from shared.bus import run_service, setup_logging
from shared.cli import add_flag, base_parser

from .service import SchedulerService


def main() -> None:
    parser = base_parser("Engine scheduler: batches requests into steps for its workers")
    engine_args.add_engine_args(parser)
    add_flag(parser, "--step-timeout", "STEP_TIMEOUT", 60.0, float, help="seconds to wait for a step's result")
    add_flag(parser, "--stats-interval", "STATS_INTERVAL", 1.0, float, help="seconds between EngineStats messages")
    add_flag(parser, "--worker-timeout", "WORKER_TIMEOUT", 5.0, float, help="seconds of worker silence that fail the engine")
    args = parser.parse_args()
    setup_logging(args.log_level)
    service = SchedulerService(
        args.engine_id,
        engine_args.scheduler_config(args),
        engine_args.cache_config(args),
        world_size=args.tensor_parallel_size,
        step_timeout=args.step_timeout,
        stats_interval=args.stats_interval,
        worker_timeout=args.worker_timeout,
        profile=args.profile_steps,
        nats_url=args.nats_url,
    )
    run_service(service)


if __name__ == "__main__":
    main()
