"""``python -m services.worker``: one model runner rank on the bus."""

import logging
import os

from .onednn_caches import bound_onednn_caches

bound_onednn_caches()  # before anything imports torch

from shared.bus import run_service, setup_logging  # noqa: E402
from shared.cli import base_parser, begin_service, config_from_args, metrics_server_config  # noqa: E402
from shared.config import (  # noqa: E402
    CacheConfig,
    EngineServiceConfig,
    KVOffloadConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelRunConfig,
    ParallelConfig,
    SchedulerConfig,
)
from shared.engine_args import add_engine_args  # noqa: E402

from .cpu_binding import apply_cpu_binding  # noqa: E402
from .openmp_wait import apply_omp_wait_policy  # noqa: E402


def build_parser():
    parser = base_parser("Model worker: runs engine steps on one device")
    add_engine_args(parser)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    setup_logging(args.log_level)
    begin_service(args, "worker")
    run_config = config_from_args(ModelRunConfig, args)
    apply_omp_wait_policy(run_config.omp_wait_policy)  # before torch is imported
    apply_cpu_binding(run_config.cpu_omp_threads_bind, config_from_args(ParallelConfig, args).rank)

    from .service import WorkerService

    engine = config_from_args(EngineServiceConfig, args)
    service = WorkerService(
        engine.engine_id,
        run_config,
        config_from_args(CacheConfig, args),
        config_from_args(SchedulerConfig, args),
        config_from_args(ParallelConfig, args),
        nats_url=args.nats_url,
        profile=engine.profile_steps,
        lora_config=config_from_args(LoRAConfig, args),
        kv_transfer_config=config_from_args(KVTransferConfig, args),
        kv_offload_config=config_from_args(KVOffloadConfig, args),
    )
    code = run_service(service, metrics_server_config(args))
    # A forward thread may be stuck in a collective with a dead peer (or the bus may be
    # gone): never wait for it, whatever ended the service.
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
