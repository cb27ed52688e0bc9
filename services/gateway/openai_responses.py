"""OpenAI response objects: chat / completions, whole or as stream chunks.

Shapes as the official ``openai`` client parses them (and vLLM's server writes
them): ``chat.completion`` / ``chat.completion.chunk`` with ``message`` /
``delta``, ``text_completion`` with ``text``; logprobs as
``{"content": [{token, logprob, bytes, top_logprobs}]}`` for chat and
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`` for
completions. ``-inf`` logprobs are clamped to -9999.0 (JSON has no infinity).
With vLLM's ``return_token_ids``, vLLM's fields too: chat's ``prompt_token_ids`` at the
top (in the opening chunks when streamed) and each choice's ``token_ids`` (each chunk's
own); a completion choice's ``prompt_token_ids`` (in its first chunk) and ``token_ids``.
"""

from __future__ import annotations

from shared.protocol import FinishReason, PromptLogprob, StreamDelta, TokenLogprob

from .echo import echo_logprobs, with_echo
from .openai_requests import GenerationRequest
from .prompt_logprobs import prompt_logprobs_json
from .tool_calls import ToolCallOutput, whole_answer

MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _finish_reason(delta: StreamDelta) -> str | None:
    return FinishReason(delta.finish_reason).openai_name()


class ChoiceResult:
    """One choice of a non-streamed response, accumulated from its deltas."""

    __slots__ = ("text_parts", "logprobs", "finish_reason", "stop_reason", "prompt_logprobs", "token_ids")

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list[PromptLogprob] = []
        self.token_ids: list[int] = []

    def add(self, delta: StreamDelta) -> None:
        self.prompt_logprobs.extend(delta.prompt_logprobs)
        self.text_parts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.token_ids.extend(delta.token_ids)
        if delta.finish_reason != FinishReason.NONE:
            self.finish_reason = _finish_reason(delta)
            self.stop_reason = delta.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class ResponseFormat:
    """What chat and completions share: ids, usage chunk, when a chunk is worth sending."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, created: int, request: GenerationRequest,
                 prompt_token_ids: list[list[int]]) -> None:
        self.response_id = response_id
        self.created = created
        self.request = request
        # Each prompt's ids (return_token_ids): filled in when the prompts are tokenized,
        # before any chunk or response is made.
        self.prompt_token_ids = prompt_token_ids

    def _head(self, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.request.model}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = self._head(self.chunk_object_name)
        chunk["choices"] = choices
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk but the last has usage null
        return chunk

    def usage_chunk(self, usage: dict) -> dict:
        chunk = self._head(self.chunk_object_name)
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    def response(self, results: list[ChoiceResult], usage: dict) -> dict:
        body = self._head(self.object_name)
        body["choices"] = [self._choice(i, r) for i, r in enumerate(results)]
        body["usage"] = usage
        return body

    def opening(self) -> list[dict]:
        return []

    def chunk(self, index: int, delta: StreamDelta) -> dict | None:
        """The chunk for one in-order delta of choice ``index``; None when it says nothing."""
        if not delta.text and not delta.logprobs and delta.finish_reason == FinishReason.NONE \
                and not self._token_ids_of(delta):
            return None
        return self._chunk([self._chunk_choice(index, delta)])

    def _token_ids_of(self, delta: StreamDelta) -> list[int]:
        """The delta's token ids the client asked for (return_token_ids): none is held back."""
        return delta.token_ids if self.request.return_token_ids else []

    def _choice(self, index: int, result: ChoiceResult) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, index: int, delta: StreamDelta) -> dict:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, response_id: str, created: int, request: GenerationRequest,
                 prompt_token_ids: list[list[int]]) -> None:
        super().__init__(response_id, created, request, prompt_token_ids)
        calling = request.tool_calling
        self.tool_calling = calling if calling is not None and calling.reads_calls else None
        self._tool_outputs: dict[int, ToolCallOutput] = {}  # per streamed choice

    def chunk(self, index: int, delta: StreamDelta) -> dict | None:
        if self.tool_calling is None:
            return super().chunk(index, delta)
        choice = self._chunk_choice(index, delta)
        if not choice["delta"] and not delta.logprobs and choice["finish_reason"] is None \
                and not self._token_ids_of(delta):
            return None  # the parser holds the text back for now
        return self._chunk([choice])

    def opening(self) -> list[dict]:
        """vLLM's (and OpenAI's) first chunk per choice: the role, empty content."""
        num_choices = len(self.request.prompts) * self.request.n
        chunks = [
            self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
            for i in range(num_choices)
        ]
        if self.request.return_token_ids:
            for chunk in chunks:
                chunk["prompt_token_ids"] = self.prompt_token_ids[0]
        return chunks

    def response(self, results: list[ChoiceResult], usage: dict) -> dict:
        body = super().response(results, usage)
        if self.request.prompt_logprobs:  # vLLM: chat's (one prompt) at the top
            body["prompt_logprobs"] = prompt_logprobs_json(results[0].prompt_logprobs)
        if self.request.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids[0]
        return body

    def _logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        if not self.request.logprobs:
            return None
        return {
            "content": [
                {
                    "token": lp.token,
                    "logprob": _logprob(lp.logprob),
                    "bytes": lp.bytes,
                    "top_logprobs": [
                        {"token": top.token, "logprob": _logprob(top.logprob), "bytes": top.bytes}
                        for top in lp.top_logprobs
                    ],
                }
                for lp in logprobs
            ]
        }

    def _choice(self, index: int, result: ChoiceResult) -> dict:
        message = {"role": "assistant", "content": result.text}
        finish_reason = result.finish_reason
        if self.tool_calling is not None:
            message, finish_reason = whole_answer(self.tool_calling, result.text, finish_reason)
        choice = {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(result.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": result.stop_reason,
        }
        if self.request.return_token_ids:
            choice["token_ids"] = result.token_ids
        return choice

    def _chunk_choice(self, index: int, delta: StreamDelta) -> dict:
        message = {"content": delta.text} if delta.text else {}
        finish_reason = _finish_reason(delta)
        if self.tool_calling is not None:
            output = self._tool_outputs.setdefault(index, ToolCallOutput(self.tool_calling))
            message = output.feed(delta.text, finished=finish_reason is not None)
            finish_reason = output.finish_reason(finish_reason)
        choice = {
            "index": index,
            "delta": message,
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if self.request.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, response_id: str, created: int, request: GenerationRequest,
                 prompt_token_ids: list[list[int]]) -> None:
        super().__init__(response_id, created, request, prompt_token_ids)
        self._text_len: dict[int, int] = {}  # per streamed choice: characters sent so far

    def _logprobs(self, logprobs: list[TokenLogprob], text_start: int) -> dict | None:
        if not self.request.logprobs:
            return None
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        offset = text_start
        for lp in logprobs:
            tokens.append(lp.token)
            token_logprobs.append(_logprob(lp.logprob))
            tops = {top.token: _logprob(top.logprob) for top in lp.top_logprobs}
            tops.setdefault(lp.token, _logprob(lp.logprob))  # vLLM: the sampled token is always listed
            top_logprobs.append(tops)
            text_offset.append(offset)
            offset += len(lp.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}

    def _choice(self, index: int, result: ChoiceResult) -> dict:
        text, logprobs = self._echoed(index, result.text, result.logprobs, result.prompt_logprobs, 0)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }
        if self.request.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(result.prompt_logprobs)
        if self.request.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_token_ids[index // self.request.n]
            choice["token_ids"] = result.token_ids
        return choice

    def chunk(self, index: int, delta: StreamDelta) -> dict | None:
        if self.request.echo and index not in self._text_len:  # the first chunk echoes the prompt
            return self._chunk([self._chunk_choice(index, delta)])
        return super().chunk(index, delta)

    def _echoed(self, index: int, text: str, logprobs: list[TokenLogprob], prompt_logprobs, start: int):
        """The text and logprobs, with the prompt's before them when echoing (``start``:
        characters of this choice already sent; echo goes only before the first)."""
        if not self.request.echo or start:
            return text, self._logprobs(logprobs, start)
        prompt = self.request.prompts[index // self.request.n]["prompt"]
        completion_logprobs = self._logprobs(logprobs, len(prompt))
        if completion_logprobs is None:
            return prompt + text, None
        return prompt + text, with_echo(echo_logprobs(prompt_logprobs), completion_logprobs)

    def _chunk_choice(self, index: int, delta: StreamDelta) -> dict:
        first = index not in self._text_len
        start = self._text_len.get(index, 0)
        text, logprobs = self._echoed(index, delta.text, delta.logprobs, delta.prompt_logprobs, start)
        self._text_len[index] = start + len(text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(delta),
            "stop_reason": delta.stop_reason,
        }
        if self.request.return_token_ids:
            if first:
                choice["prompt_token_ids"] = self.prompt_token_ids[index // self.request.n]
            choice["token_ids"] = delta.token_ids
        return choice


def response_format(kind: str, response_id: str, created: int, request: GenerationRequest,
                    prompt_token_ids: list[list[int]]) -> ResponseFormat:
    """``prompt_token_ids``: each prompt's ids once tokenized (vLLM's return_token_ids)."""
    return (ChatFormat if kind == "chat" else CompletionFormat)(response_id, created, request, prompt_token_ids)
