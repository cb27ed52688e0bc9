"""What several boundaries carry: a request's settings and adapter, logprobs, errors.

``SamplingParams`` and ``LoRARequest`` travel from the gateway to the workers;
``Logprobs`` from the workers to the detokenizers; ``FinishReason`` and ``ErrorInfo``
end a request on any side.
"""

from __future__ import annotations

import enum

import msgspec


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """A request's output constraint, vLLM's ``StructuredOutputsParams``: exactly one
    field is set. The gateway writes each in its canonical form (the JSON schema and
    the structural tag as compact JSON text, keys in the order given), which is also
    the grammar cache's key (``shared.structured_output.GrammarSpec``)."""

    json: str | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF)
    structural_tag: str | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """Per-request sampling and stopping settings (OpenAI / vLLM meaning).

    ``top_k`` <= 0 and ``top_p`` == 1 disable those filters. ``logprobs`` is the
    number of top alternatives to return besides the sampled token (None: no
    logprobs at all). ``stop`` strings are handled by the detokenizer only.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    # Sent to the workers once, with the request's new-request data; each rank compiles
    # it and keeps a grammar matcher in its request state (docs/ARCHITECTURE.md).
    structured_outputs: StructuredOutputsParams | None = None
    # Logit controls (services/worker/logit_controls.py): a bias added to a token's logit,
    # the only tokens allowed, and words never to generate (their token sequences, filled
    # in by the tokenizer service).
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    # Output text settings, the detokenizers' (they reach every replica with the stop
    # strings, ``RequestStopStrings``): keep a matched stop string (and the text of a stop
    # token) in the text; keep special tokens' text; vLLM's spacing between special tokens.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's return_tokens_as_token_ids: each logprob's token is "token_id:<id>".
    return_tokens_as_token_ids: bool = False
    # Keep only the prompt's last k tokens (-1: max_model_len); the tokenizer applies it.
    truncate_prompt_tokens: int | None = None
    # Logprobs of each prompt token (and the top-n at its position), vLLM's
    # ``prompt_logprobs``: computed by the workers over every prefill chunk.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_text_settings(self) -> bool:
        """Whether the detokenizers must be told anything about this request (stop strings
        or an output text setting other than the default; token ids as logprob names only
        where there are logprobs to name)."""
        return bool(self.stop) or self.include_stop_str_in_output or not self.skip_special_tokens \
            or not self.spaces_between_special_tokens \
            or (self.return_tokens_as_token_ids and self.logprobs is not None)

    def for_choice(self, i: int) -> "SamplingParams":
        """The settings of sample ``i`` of a prompt's ``n`` (vLLM's rule): a given seed
        becomes ``seed + i``, so the samples differ from each other yet repeat from call
        to call."""
        if self.seed is None or i == 0:
            return self
        return msgspec.structs.replace(self, seed=self.seed + i)


class LoRARequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The LoRA adapter a request runs under (vLLM's name): the workers read it from
    ``lora_path`` (a PEFT folder or a GGUF LoRA file) the first time they meet it;
    ``lora_name`` is the model name clients use. Requests without one run on the base model."""

    lora_name: str
    lora_path: str
    # Pinned (``"pinned": true`` on load, or a pinned ``--lora-modules`` entry): once a
    # worker puts it in a slot it stays there, and the scheduler counts that slot as taken.
    pinned: bool = False
    # The model card's ``parent`` (vLLM's ``base_model_name``; "": the served model).
    base_model_name: str = ""


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of one sampled position: index 0 is the sampled token, then top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # EOS, a stop token id, or a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3
    ERROR = 4

    def openai_name(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(self))


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    """An error for the client, in OpenAI's shape plus the HTTP status to use."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400
