"""``python -m services.detokenizer``: a detokenizer replica on the bus (queue group "detokenizer")."""

from shared.bus import run_service, setup_logging
from shared.cli import add_config_flags, base_parser, begin_service, config_from_args, metrics_server_config

from .config import DetokenizerConfig


def build_parser():
    parser = base_parser("Detokenizer: turns each step's new tokens into text deltas for the gateways")
    add_config_flags(parser, DetokenizerConfig)
    return parser


def build_service(config: DetokenizerConfig, nats_url: str):
    from shared.model_config import default_model_path
    from shared import startup
    from shared.tokenizer import load_tokenizer

    from .service import DetokenizerService

    model = config.model or default_model_path()
    startup.phase(f"loading the tokenizer of {model}")
    return DetokenizerService(load_tokenizer(model), config, nats_url=nats_url)


def main() -> None:
    args = build_parser().parse_args()
    setup_logging(args.log_level)
    begin_service(args, "detokenizer")
    run_service(build_service(config_from_args(DetokenizerConfig, args), args.nats_url),
                metrics_server_config(args))


if __name__ == "__main__":
    main()
