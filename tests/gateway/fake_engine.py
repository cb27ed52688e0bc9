"""A fake tokenizer + engine + detokenizer for the gateway tests, on a real NATS bus.

It answers ``TokenizeRequest``s on ``llm.tokenize`` (queue group "tokenizer", and
health pings as a "tokenizer") and then "generates" a known text: the label
``[<first word of the prompt>]`` (``[<word>/<seed>]`` with a seed) followed by the
words of ``WORDS``, one token each. The output goes to the requesting gateway's
stream subject as ``StreamDeltaBatch``es, deliberately out of order, split into
deltas of one or two tokens, some before the tokenize reply and some after, with
a repeated delta and a delta for an unknown request mixed in.

Control words in the prompt: ``REJECT`` (a 400 from the "tokenizer"),
``UNAVAILABLE`` (its 503), ``BUSY`` (a full waiting queue's 429), ``REJECTSECOND`` (refuse only sample 1), ``HANG``
(two tokens, then nothing), ``FAIL`` (two tokens, then an engine error),
``SILENT`` (no tokenize reply at all), ``GAP`` / ``LASTLOST`` (the second / the
last delta is lost until the gateway asks for a resend), ``SILENTONCE`` (no reply to the first
attempt: a tokenizer that died), ``GHOST`` (queued by engine "ghost", which
never sends stats), a word of ``SCRIPTS`` (the output is that script's tokens: a model's
tool calls, say). Other requests are queued by engine ``FAKE_ENGINE_ID`` under
the fake's current ``incarnation`` (a test changes it to play a restarted scheduler).
Token ``j`` of an output has id ``j``, token ``j`` of a prompt ``PROMPT_TOKEN_BASE + j``
(in the reply when asked for). A resumed sample (``TokenizeRequest.resumed``: its
engine was lost) goes on from the tokens its client has, to the end of its text (``HANG``,
``FAIL`` and ``GHOST`` play only the first engine), on engine ``FAKE_ENGINE_ID``; with
``NORESUME`` in the prompt no engine takes it again (503).
Chat messages are checked and normalised as the real tokenizer does; a refused one
is not recorded. Each ``TokenizeRequest`` (one prompt, its n samples) is recorded in
``prompts`` and each of its samples in ``requests`` (a ``Sample``: the request's fields
with the sample's own ``request_id`` and ``sampling_params``, seed + i). It records
every abort it sees, and says
it is a ready engine (``EngineStats`` with ``ready=True``, engine id ``FAKE_ENGINE_ID``) every
``STATS_INTERVAL`` seconds, as a scheduler does, so the gateway's /health is 200.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg

from shared.bus import Service, flush_in_order
from shared.protocol import (
    ABORT_REQUEST,
    ENGINE_STATS,
    ENGINE_STATS_MSG,
    RESEND_OUTPUTS,
    STREAM_DELTA_BATCH,
    TOKENIZE,
    TOKENIZE_REPLY,
    TOKENIZE_REQUEST,
    EngineRequestReply,
    EngineStats,
    ErrorInfo,
    FinishReason,
    ResendOutputs,
    SamplingParams,
    StreamDelta,
    StreamDeltaBatch,
    TokenizeReply,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    engine_abort_subject,
    engine_resend_subject,
    gateway_stream_subject,
)
from shared.request_validation import InvalidRequest, chat_messages

FAKE_ENGINE_ID = "fake"
STATS_INTERVAL = 0.5
PROMPT_TOKEN_BASE = 1000
WORDS = "The quick brown fox jumps over the lazy dog .".split()
# Scripted outputs, by control word: the tokens a model would write.
SCRIPTS = {
    "HERMESCALLS": ["Let", " me", " check", ".", "\n", "<", "tool", "_call", ">", "\n", '{"name": "get_weather", ',
                    '"arguments": {"city": ', '"Paris', '", "unit": "celsius"}}', "\n", "</", "tool_call", ">", "\n",
                    "<tool_call>", '\n{"name": "get_time", "arguments": {"zone": "CET"}}\n', "</tool_call>"],
    "LLAMACALLS": ['{"name": "get_weather", "param', 'eters": {"city": "Par', 'is", "unit": "celsius"}}', "; ",
                   '{"name": "get_time", ', '"parameters": {"zone": "CET"}}'],
}
REJECTION = ErrorInfo(
    "This model's maximum context length is 64 tokens. However, you requested 100 tokens.",
    param="max_tokens",
    code="context_length_exceeded",
    status=400,
)


@dataclass
class Sample:
    """One sample of a recorded ``TokenizeRequest``: its id and settings, the rest shared."""

    request_id: str
    sampling_params: SamplingParams
    prompt_request: TokenizeRequest
    output_token_ids: list[int] | None = None  # resumed: the tokens its client has

    def __getattr__(self, name):
        return getattr(self.prompt_request, name)


def prompt_words(request: TokenizeRequest | Sample) -> list[str]:
    if request.messages is not None:
        return request.messages[-1]["content"].split()
    if request.prompt is not None:
        return request.prompt.split()
    return [f"ids{len(request.prompt_token_ids)}"]


def label(first_word: str, seed: int | None = None) -> str:
    return f"[{first_word}]" if seed is None else f"[{first_word}/{seed}]"


def output_tokens(first_word: str, seed: int | None = None) -> list[str]:
    """The fake model's whole output for a prompt starting with ``first_word``."""
    return [label(first_word, seed)] + [f" {w}" for w in WORDS]


def expected_text(first_word: str, seed: int | None = None, max_tokens: int = 0) -> str:
    tokens = output_tokens(first_word, seed)
    return "".join(tokens[:max_tokens] if max_tokens else tokens)


def token_logprob(token: str, position: int, num_top: int) -> TokenLogprob:
    tops = [TopLogprob(f"alt{r}", -1.0 - r, list(f"alt{r}".encode())) for r in range(num_top)]
    return TokenLogprob(token, -0.25 * (position + 1), list(token.encode()), tops)


class FakeEngine(Service):
    """Plays tokenizer, scheduler and detokenizer for one test module."""

    name = "tokenizer"

    def __init__(self, nats_url: str) -> None:
        super().__init__(nats_url)
        self.prompts: list[TokenizeRequest] = []
        self.prompt_headers: list[dict | None] = []  # each tokenize request's NATS headers
        self.requests: list[Sample] = []
        self.aborted: list[str] = []
        self._changed = asyncio.Condition()
        self.incarnation = "fake-1"
        self.resends: list[ResendOutputs] = []
        self._outputs: dict[str, tuple[Sample, list[StreamDelta]]] = {}

    async def setup(self) -> None:
        await self.subscribe(TOKENIZE, self._on_tokenize, queue="tokenizer")
        await self.subscribe(engine_abort_subject("*"), self._on_abort)
        await self.subscribe(engine_resend_subject("*"), self._on_resend)
        await flush_in_order(self.nc)
        self.spawn(self._announce_ready())

    async def announce(self) -> None:
        stats = EngineStats(FAKE_ENGINE_ID, ready=True, incarnation=self.incarnation)
        await self.nc.publish(ENGINE_STATS, ENGINE_STATS_MSG.encode(stats))

    async def _announce_ready(self) -> None:
        while True:
            await self.announce()
            await asyncio.sleep(STATS_INTERVAL)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate, timeout: float = 5.0):
        """Until ``predicate()`` is truthy (bounded by ``timeout``); returns its value."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
        return predicate()

    def requests_with(self, word: str) -> list[Sample]:
        return [r for r in self.requests if word in prompt_words(r)]

    async def _on_resend(self, msg: Msg) -> None:
        resend = RESEND_OUTPUTS.decode(msg.data)
        self.resends.append(resend)
        request, deltas = self._outputs.get(resend.request_id, (None, []))
        if request is not None:
            await self.publish(gateway_stream_subject(request.gateway_id),
                               [d for d in deltas if d.token_offset >= resend.token_offset])
        await self._notify()

    async def _on_abort(self, msg: Msg) -> None:
        self.aborted.extend(ABORT_REQUEST.decode(msg.data).request_ids)
        await self._notify()

    async def _on_tokenize(self, msg: Msg) -> None:
        request = TOKENIZE_REQUEST.decode(msg.data)
        if request.messages is not None:
            try:
                request = msgspec.structs.replace(request, messages=chat_messages(request.messages))
            except InvalidRequest as e:
                await msg.respond(TOKENIZE_REPLY.encode(TokenizeReply(error=e.error)))
                return
        self.prompts.append(request)
        self.prompt_headers.append(msg.headers)
        if request.resumed:
            samples = [Sample(request_id, request.sampling_params.for_choice(r.choice), request, r.output_token_ids)
                       for request_id, r in zip(request.request_ids, request.resumed)]
        else:
            samples = [Sample(request_id, request.sampling_params.for_choice(i), request)
                       for i, request_id in enumerate(request.request_ids)]
        self.requests.extend(samples)
        await self._notify()
        self.spawn(self._serve(msg, request, samples))

    async def _serve(self, msg: Msg, request: TokenizeRequest, samples: list[Sample]) -> None:
        words = prompt_words(request)
        num_prompt_tokens = len(words) + 3
        if "SILENT" in words:
            return
        first_attempt = [r.request_ids[0].split(".r")[0] for r in self.prompts].count(
            request.request_ids[0].split(".r")[0]) == 1
        if "SILENTONCE" in words and first_attempt:
            return
        if "REJECT" in words:
            await msg.respond(TOKENIZE_REPLY.encode(TokenizeReply(error=REJECTION)))
            return
        choices = [self._queue(sample, words) for sample in samples]
        accepted = [s for s, c in zip(samples, choices) if c.error is None]
        published = [self._outputs_of(sample, words, num_prompt_tokens) for sample in accepted]
        # Half the output before the tokenize reply: the engine can be faster than the reply.
        for subject, shuffled in published:
            await self.publish(subject, shuffled[: len(shuffled) // 2] + [StreamDelta("no-such-request", 0, 1, "junk")])
        asked = request.return_prompt_token_ids
        prompt_ids = [PROMPT_TOKEN_BASE + j for j in range(num_prompt_tokens)] if asked else []
        await msg.respond(TOKENIZE_REPLY.encode(TokenizeReply(num_prompt_tokens, choices=choices,
                                                              prompt_token_ids=prompt_ids)))
        for (subject, shuffled), sample in zip(published, accepted):
            rest = shuffled[len(shuffled) // 2:]
            for i in range(0, len(rest), 2):
                await self.publish(subject, rest[i : i + 2])
            deltas = self._outputs[sample.request_id][1]
            if deltas:
                await self.publish(subject, [deltas[0]])  # a repeat, after the end

    def _queue(self, sample: Sample, words: list[str]) -> EngineRequestReply:
        """The "scheduler's" answer for one sample."""
        if sample.output_token_ids is not None:
            if "NORESUME" in words:
                error = ErrorInfo("engine fake is not ready (waiting for its workers)", type="service_unavailable",
                                  status=503)
                return EngineRequestReply(sample.request_id, error)
            return EngineRequestReply(sample.request_id, engine_id=FAKE_ENGINE_ID, incarnation=self.incarnation)
        if "REJECTSECOND" in words and sample.request_id.endswith("-1"):
            return EngineRequestReply(sample.request_id, REJECTION)
        if "BUSY" in words:
            error = ErrorInfo("engine 0 has 1024 requests waiting; try again later", type="rate_limit_error",
                              code="too_many_requests", status=429)
            return EngineRequestReply(sample.request_id, error)
        if "UNAVAILABLE" in words:
            error = ErrorInfo("no scheduler is available", type="service_unavailable", status=503)
            return EngineRequestReply(sample.request_id, error)
        engine, incarnation = ("ghost", "ghost-1") if "GHOST" in words else (FAKE_ENGINE_ID, self.incarnation)
        return EngineRequestReply(sample.request_id, engine_id=engine, incarnation=incarnation)

    def _outputs_of(self, sample: Sample, words: list[str], num_prompt_tokens: int) -> tuple[str, list[StreamDelta]]:
        """The stream subject and the sample's deltas as they will be sent: shuffled, some lost."""
        deltas = self.deltas(sample, words, num_prompt_tokens)
        self._outputs[sample.request_id] = (sample, deltas)
        if "GAP" in words:  # the detokenizer handling the second delta died
            deltas = deltas[:1] + deltas[2:]
        if "LASTLOST" in words:  # ... or the one handling the last delta
            deltas = deltas[:-1]
        rng = random.Random(sample.request_id)
        order = list(range(len(deltas)))
        rng.shuffle(order)
        if order == sorted(order) and len(order) > 1:
            order.reverse()
        return gateway_stream_subject(sample.gateway_id), [deltas[i] for i in order]

    async def publish(self, subject: str, deltas: list[StreamDelta]) -> None:
        if deltas:
            await self.nc.publish(subject, STREAM_DELTA_BATCH.encode(StreamDeltaBatch(deltas)))

    def deltas(self, request: Sample, words: list[str], num_prompt_tokens: int) -> list[StreamDelta]:
        params = request.sampling_params
        tokens = output_tokens(words[0] if words else "", params.seed)
        scripts = [SCRIPTS[w] for w in words if w in SCRIPTS]
        if scripts:
            tokens = scripts[0]
        texts = list(tokens)
        finish = FinishReason.STOP
        error = ""
        resumed = request.output_token_ids is not None
        if not resumed and ("HANG" in words or "FAIL" in words or "GHOST" in words):
            tokens, texts = tokens[:2], texts[:2]
            finish = FinishReason.NONE
            error = "the engine failed: FAIL" if "FAIL" in words else ""
        elif params.max_tokens and params.max_tokens < len(tokens):
            tokens, texts = tokens[: params.max_tokens], texts[: params.max_tokens]
            finish = FinishReason.LENGTH
        for stop in params.stop:
            # As the detokenizer: the text ends just before the stop string.
            text = ""
            for j, token in enumerate(tokens):
                if stop in text + token:
                    texts = texts[:j] + [(text + token)[len(text):(text + token).index(stop)]]
                    tokens = tokens[: j + 1]
                    finish = FinishReason.STOP
                    break
                text += token
        deltas = []
        offset = len(request.output_token_ids) if resumed else 0
        sizes = [1, 2] * len(tokens)
        while offset < len(tokens):
            size = min(sizes.pop(), len(tokens) - offset)
            logprobs = []
            if params.logprobs is not None:
                logprobs = [token_logprob(tokens[j], j, params.logprobs) for j in range(offset, offset + size)]
            deltas.append(
                StreamDelta(
                    request.request_id, offset, size, "".join(texts[offset : offset + size]),
                    num_prompt_tokens=num_prompt_tokens, logprobs=logprobs, token_ids=list(range(offset, offset + size)),
                )
            )
            offset += size
        if error:
            deltas.append(StreamDelta(request.request_id, offset, 0, "", FinishReason.ERROR, error=error))
        elif finish != FinishReason.NONE:
            deltas[-1] = StreamDelta(
                request.request_id, deltas[-1].token_offset, deltas[-1].num_tokens, deltas[-1].text, finish,
                num_prompt_tokens=num_prompt_tokens, num_cached_tokens=2, logprobs=deltas[-1].logprobs,
                token_ids=deltas[-1].token_ids,
            )
        return deltas
