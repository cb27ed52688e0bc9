"""``python -m services.gateway``: the OpenAI-compatible HTTP front on the bus."""

import logging
import sys

from shared import aio, tracing
from shared.bus import setup_logging
from shared.cli import add_config_flags, add_flag, base_parser, begin_service, config_from_args

from shared.config import LoRAConfig

from .config import GatewayConfig, default_served_model_name

logger = logging.getLogger("services.gateway")


def build_parser():
    # Its metrics are on its HTTP port (/metrics).
    parser = base_parser("Gateway: OpenAI-compatible HTTP API (chat, completions, models, health, metrics)",
                         metrics_port=False)
    add_config_flags(parser, GatewayConfig)
    add_config_flags(parser, LoRAConfig)
    add_flag(parser, "--model", "MODEL", "", help="the model path; its base name is the default served name")
    add_flag(parser, "--api-key-file", "API_KEY_FILE", "",
             help="read the API key from this file (a Docker/Kubernetes secret) instead of --api-key")
    add_flag(parser, "--served-model-name", "SERVED_MODEL_NAME", "",
             help="name(s) clients use as 'model', comma-separated; the first is reported "
                  "(default: the model's base name, or SmolLM2-135M-Instruct)")
    return parser


def build_config(args) -> GatewayConfig:
    names = args.served_model_name or default_served_model_name(args.model)
    overrides = {"served_model_names": tuple(n.strip() for n in names.split(",") if n.strip()),
                 "model": args.model, "lora": config_from_args(LoRAConfig, args)}
    if args.api_key_file:
        with open(args.api_key_file) as f:
            overrides["api_key"] = f.read().strip()
    return config_from_args(GatewayConfig, args, **overrides)


def main() -> None:
    from .uvicorn_runner import GatewayServer, ServeError

    args = build_parser().parse_args()
    setup_logging(args.log_level)
    begin_service(args, "gateway")
    server = GatewayServer(build_config(args), nats_url=args.nats_url)
    try:
        aio.run(server.run())
    except ServeError as e:
        logger.error("%s", e)
        sys.exit(1)
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
