"""The tokenizer service's check that a request's constraint compiles, before anything
is scheduled: an invalid schema, regex or grammar is a 400 that says what is wrong.

Compiling here also warms nothing on the workers (they compile again, from their own
cache): its purpose is the early, precise error.
"""

from __future__ import annotations

import functools
from concurrent.futures import TimeoutError as FutureTimeout

from shared.protocol import SamplingParams
from shared.request_validation import InvalidRequest

from . import make_backend
from .backend import GrammarError
from .compile_cache import GrammarCompileCache
from .spec import grammar_spec
from .vocabulary import TokenizerVocabulary

# A spec that takes longer to compile is refused (the compile thread runs on to its end);
# below the gateway's tokenize_timeout (10 s), so the client learns why.
COMPILE_TIMEOUT_S = 5.0

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


@functools.lru_cache(maxsize=4)
def compile_cache_for(tokenizer, vocab_size: int) -> GrammarCompileCache:
    return GrammarCompileCache(lambda: make_backend(TokenizerVocabulary.from_tokenizer(tokenizer, vocab_size)),
                               max_workers=2)


def check_structured_outputs(params: SamplingParams, tokenizer, vocab_size: int) -> None:
    """Raise ``InvalidRequest`` unless ``params.structured_outputs`` (if any) is one
    constraint that compiles, in a request that lets the grammar decide where it ends."""
    if params.structured_outputs is None:
        return
    try:
        spec = grammar_spec(params.structured_outputs)
    except ValueError as e:
        raise InvalidRequest(str(e), param="structured_outputs") from e
    # The grammar ends the output with EOS: a request that may not stop there cannot follow it.
    if params.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with structured outputs "
                             "(the output ends with EOS where the grammar is complete)", param="ignore_eos")
    if params.min_tokens > 0:
        raise InvalidRequest("min_tokens cannot be combined with structured outputs "
                             "(the grammar decides where the output ends)", param="min_tokens")
    if tokenizer is None:
        raise InvalidRequest("structured outputs need the model's tokenizer", param=spec.param)
    name = _KIND_NAMES[spec.kind]
    cache = compile_cache_for(tokenizer, vocab_size)
    cache.backend  # built once (imports the library, reads the vocabulary): not part of the timeout
    future = cache.get(spec)
    try:
        future.result(timeout=COMPILE_TIMEOUT_S)
    except GrammarError as e:
        raise InvalidRequest(f"invalid {name}: {e}", param=spec.param) from e
    except FutureTimeout as e:
        raise InvalidRequest(f"the {name} did not compile within {COMPILE_TIMEOUT_S:g} s", param=spec.param) from e
