"""``python -m services.tokenizer``: a tokenizer replica on the bus (queue group "tokenizer")."""

from shared.bus import run_service, setup_logging
from shared.cli import add_flag, base_parser
from shared.config import ConfigError
from shared.engine_args import _optional_int

from .service import TokenizerService


def build_service(args) -> TokenizerService:
    from shared.model_config import load_model_config
    from shared.tokenizer import load_tokenizer

    model = args.model
    if not model:
        from shared.model_config import default_model_path

        model = default_model_path()
    config = load_model_config(model)
    max_model_len = config.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {args.max_model_len}")
        max_model_len = min(max_model_len, args.max_model_len)
    return TokenizerService(
        load_tokenizer(model),
        max_model_len=max_model_len,
        vocab_size=config.vocab_size,
        extra_eos_token_ids=config.eos_token_ids,
        scheduler_timeout=args.scheduler_timeout,
        nats_url=args.nats_url,
    )


def main() -> None:
    parser = base_parser("Tokenizer: validates and tokenizes requests, hands them to a scheduler")
    add_flag(parser, "--model", "MODEL", "", help="GGUF file or Hugging Face folder ('' = the default SmolLM2 model)")
    add_flag(parser, "--max-model-len", "MAX_MODEL_LEN", None, _optional_int,
             help="context length cap (default: the model's)")
    add_flag(parser, "--scheduler-timeout", "SCHEDULER_TIMEOUT", 5.0, float,
             help="seconds to wait for a scheduler to take a request")
    args = parser.parse_args()
    setup_logging(args.log_level)
    run_service(build_service(args))


if __name__ == "__main__":
    main()
