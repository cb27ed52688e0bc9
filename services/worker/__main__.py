"""``python -m services.worker``: one model runner rank on the bus."""

import os

from shared import engine_args
from shared.bus import run_service, setup_logging
from shared.cli import base_parser

from .service import WorkerService


def main() -> None:
    parser = base_parser("Model worker: runs engine steps on one device")
    engine_args.add_engine_args(parser)
    args = parser.parse_args()
    setup_logging(args.log_level)
    service = WorkerService(
        args.engine_id,
        engine_args.run_config(args),
        engine_args.cache_config(args),
        engine_args.scheduler_config(args),
        engine_args.parallel_config(args),
        nats_url=args.nats_url,
        profile=args.profile_steps,
    )
    code = run_service(service)
    if code:
        # A forward thread may be stuck in a collective with a dead peer: don't wait for it.
        os._exit(code)


if __name__ == "__main__":
    main()
