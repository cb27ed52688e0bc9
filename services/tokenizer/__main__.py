"""``python -m services.tokenizer``: a tokenizer replica on the bus (queue group "tokenizer"),
with its router (``services/router``)."""

from shared.bus import run_service, setup_logging
from shared.cli import add_config_flags, base_parser, begin_service, config_from_args, metrics_server_config

from services.router.config import RouterConfig

from .config import TokenizerConfig


def build_parser():
    parser = base_parser("Tokenizer: validates and tokenizes requests, routes each to an engine")
    add_config_flags(parser, TokenizerConfig)
    add_config_flags(parser, RouterConfig)
    return parser


def build_service(config: TokenizerConfig, nats_url: str, router_config: RouterConfig = RouterConfig()):
    from shared.chat_template import read_chat_template
    from shared.model_config import default_model_path, load_model_config, resolve_max_model_len
    from shared import startup
    from shared.tokenizer import load_tokenizer

    from .service import TokenizerService

    model = config.model or default_model_path()
    startup.phase(f"loading the tokenizer of {model}")
    model_config = load_model_config(model)
    tokenizer = load_tokenizer(model)
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return TokenizerService(
        tokenizer,
        max_model_len=resolve_max_model_len(model_config, config.max_model_len),
        vocab_size=model_config.vocab_size,
        extra_eos_token_ids=model_config.eos_token_ids,
        config=config,
        nats_url=nats_url,
        router_config=router_config,
    )


def main() -> None:
    args = build_parser().parse_args()
    setup_logging(args.log_level)
    begin_service(args, "tokenizer")
    run_service(build_service(config_from_args(TokenizerConfig, args), args.nats_url,
                              config_from_args(RouterConfig, args)),
                metrics_server_config(args))


if __name__ == "__main__":
    main()
