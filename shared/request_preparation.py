"""Request preparation: a ``TokenizeRequest`` checked and tokenized into its ``EngineRequest``s.

The one way in to a scheduler, for the tokenizer service (requests from the bus)
and the in-process ``Engine`` alike: sampling settings and prompt checked
(``request_validation``), chat messages rendered with the model's template, the
prompt tokenized (and cut to its last ``truncate_prompt_tokens``), ``max_tokens``
resolved against the context, and every
end-of-sequence id of the model made to stop the request. A prompt with ``n``
samples is prepared once; its samples differ only in request id and seed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from shared.protocol import EngineRequest, ResumedSample, SamplingParams, TokenizeRequest
from shared.request_validation import (
    InvalidRequest,
    chat_messages,
    resolve_max_tokens,
    validate_request_shape,
    validate_sampling_params,
)
from shared.logit_controls import prepare_logit_controls
from shared.prompt_truncation import truncate_prompt
from shared.structured_output.validation import check_structured_outputs


@dataclass(frozen=True)
class RequestPreparer:
    """What preparing a request needs to know of the model.

    ``eos_token_ids``: the model's end-of-sequence ids; the first becomes the
    request's ``eos_token_id``, the others (generation_config's list, as vLLM does)
    join its ``stop_token_ids`` unless it ignores EOS. ``special_tokens_in_content``:
    special-token texts typed in a message become control tokens (off: plain text).
    """

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    special_tokens_in_content: bool = False

    def prepare(self, request: TokenizeRequest, tokenizer=None) -> list[EngineRequest]:
        """Check and tokenize ``request``'s prompt once; one ``EngineRequest`` per sample
        (``request_ids[i]``, seed + i). Raises ``InvalidRequest``. CPU work: the tokenizer
        service runs it in a thread. ``tokenizer`` may be None for a request with
        ``prompt_token_ids``."""
        params = validate_sampling_params(request.sampling_params, self.vocab_size)
        validate_request_shape(request, self.vocab_size)
        check_structured_outputs(params, tokenizer, self.vocab_size)
        params = prepare_logit_controls(params, tokenizer, self.vocab_size)
        if request.messages is not None:
            prompt_param = "messages"
            prompt_token_ids = tokenize_chat(tokenizer, request.messages, request.add_generation_prompt,
                                             self.special_tokens_in_content, request.tools,
                                             request.chat_template_kwargs, request.continue_final_message,
                                             request.add_special_tokens is True)
        elif request.prompt is not None:
            prompt_param = "prompt"
            prompt_token_ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens
                                                is not False)
        else:
            prompt_param = "prompt_token_ids"
            prompt_token_ids = list(request.prompt_token_ids)
        prompt_token_ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len,
                                           request.truncation_side)
        params = self.stop_at_every_eos(resolve_max_tokens(params, len(prompt_token_ids), self.max_model_len,
                                                           prompt_param))
        arrival_time = time.time()
        resumed = self.resumed_samples(request)
        return [
            EngineRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=params.for_choice(sample.choice),
                arrival_time=arrival_time,
                eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                gateway_id=request.gateway_id,
                cache_salt=request.cache_salt,
                lora_request=request.lora_request,
                output_token_ids=sample.output_token_ids,
            )
            for request_id, sample in zip(request.request_ids, resumed)
        ]

    def resumed_samples(self, request: TokenizeRequest) -> list[ResumedSample]:
        """Each request id's sample: sample i with no output yet, or the resumed one."""
        if not request.resumed:
            return [ResumedSample(i, []) for i in range(len(request.request_ids))]
        if len(request.resumed) != len(request.request_ids):
            raise InvalidRequest(f"{len(request.resumed)} resumed samples for {len(request.request_ids)} request ids")
        for sample in request.resumed:
            if sample.choice < 0 or not all(0 <= t < self.vocab_size for t in sample.output_token_ids):
                raise InvalidRequest("a resumed sample has a negative choice or token ids outside the vocabulary")
        return request.resumed

    def stop_at_every_eos(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the EOS ids after the first added to its stop token ids."""
        extra = [i for i in self.eos_token_ids[1:] if i not in params.stop_token_ids]
        if not extra or params.ignore_eos:
            return params
        return msgspec.structs.replace(params, stop_token_ids=params.stop_token_ids + extra)


def tokenize_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    special_tokens_in_content: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The chat prompt's ids, as transformers' ``apply_chat_template(tokenize=True)``
    (the rendered text already holds the special tokens, so none are added unless
    ``add_special_tokens``), except that special-token texts inside the client's strings
    stay text unless allowed. ``tools`` and ``chat_template_kwargs`` reach the template
    (the gateway checked their shape); ``continue_final_message``: the prompt ends inside
    the final message."""
    messages = chat_messages(messages)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt, special_tokens_in_content, tools,
                                     chat_template_kwargs, continue_final_message, add_special_tokens)
    except Exception as e:  # the template's raise_exception, or a template that needs fields we lack
        raise InvalidRequest(f"the chat template cannot render these messages: {e}", param="messages") from e
