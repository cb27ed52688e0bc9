"""``python -m services.gateway``: the OpenAI-compatible HTTP front on the bus."""

import asyncio
import logging
import sys

from shared.bus import setup_logging
from shared.cli import add_flag, base_parser

from .config import GatewayConfig, default_served_model_name
from .server import GatewayServer, ServeError

logger = logging.getLogger("services.gateway")


def build_config(args) -> GatewayConfig:
    names = args.served_model_name or default_served_model_name(args.model)
    return GatewayConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(n.strip() for n in names.split(",") if n.strip()),
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        tokenize_timeout=args.tokenize_timeout,
        access_log=args.access_log,
    )


def main() -> None:
    parser = base_parser("Gateway: OpenAI-compatible HTTP API (chat, completions, models, health, metrics)")
    add_flag(parser, "--host", "HOST", "127.0.0.1", help="address to listen on (0.0.0.0 in docker)")
    add_flag(parser, "--port", "PORT", 8000, int, help="HTTP port")
    add_flag(parser, "--model", "MODEL", "", help="the model path; its base name is the default served name")
    add_flag(parser, "--served-model-name", "SERVED_MODEL_NAME", "",
             help="name(s) clients use as 'model', comma-separated; the first is reported "
                  "(default: the model's base name, or SmolLM2-135M-Instruct)")
    add_flag(parser, "--api-key", "API_KEY", "", help="when set, /v1 routes need 'Authorization: Bearer <key>'")
    add_flag(parser, "--request-timeout", "REQUEST_TIMEOUT", 600.0, float, help="seconds for a whole request")
    add_flag(parser, "--tokenize-timeout", "TOKENIZE_TIMEOUT", 10.0, float,
             help="seconds to wait for the tokenizer service's answer")
    add_flag(parser, "--access-log", "ACCESS_LOG", True, bool, help="log one line per HTTP request")
    args = parser.parse_args()
    setup_logging(args.log_level)
    server = GatewayServer(build_config(args), nats_url=args.nats_url)
    try:
        asyncio.run(server.run())
    except ServeError as e:
        logger.error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
