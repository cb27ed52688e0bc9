"""``python -m services.detokenizer``: a detokenizer replica on the bus (queue group "detokenizer")."""

from shared.bus import run_service, setup_logging
from shared.cli import add_flag, base_parser

from .service import DetokenizerService


def build_service(args) -> DetokenizerService:
    from shared.tokenizer import load_tokenizer

    model = args.model
    if not model:
        from shared.model_config import default_model_path

        model = default_model_path()
    return DetokenizerService(load_tokenizer(model), nats_url=args.nats_url)


def main() -> None:
    parser = base_parser("Detokenizer: turns each step's new tokens into text deltas for the gateways")
    add_flag(parser, "--model", "MODEL", "", help="GGUF file or Hugging Face folder ('' = the default SmolLM2 model)")
    args = parser.parse_args()
    setup_logging(args.log_level)
    run_service(build_service(args))


if __name__ == "__main__":
    main()
