"""``python -m services.scheduler``: one engine's scheduler on the bus."""

from shared.bus import run_service, setup_logging
from shared.cli import add_config_flags, base_parser, begin_service, config_from_args, metrics_server_config
from shared.config import (
    CacheConfig,
    EngineServiceConfig,
    KVOffloadConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
)
from shared.engine_args import add_engine_args

from .config import KVEventsConfig, SchedulerServiceConfig


def build_parser():
    parser = base_parser("Engine scheduler: batches requests into steps for its workers")
    add_engine_args(parser)
    add_config_flags(parser, SchedulerServiceConfig)
    add_config_flags(parser, KVEventsConfig)
    return parser


def main() -> None:
    from .service import SchedulerService

    args = build_parser().parse_args()
    setup_logging(args.log_level)
    begin_service(args, "scheduler")
    engine = config_from_args(EngineServiceConfig, args)
    service = SchedulerService(
        engine.engine_id,
        config_from_args(SchedulerConfig, args),
        config_from_args(CacheConfig, args),
        world_size=config_from_args(ParallelConfig, args).tensor_parallel_size,
        service_config=config_from_args(SchedulerServiceConfig, args),
        profile=engine.profile_steps,
        nats_url=args.nats_url,
        lora_config=config_from_args(LoRAConfig, args),
        kv_transfer_config=config_from_args(KVTransferConfig, args),
        kv_offload_config=config_from_args(KVOffloadConfig, args),
        kv_events_config=config_from_args(KVEventsConfig, args),
    )
    run_service(service, metrics_server_config(args))


if __name__ == "__main__":
    main()
