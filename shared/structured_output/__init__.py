"""Structured output: constraining a request's tokens to a JSON schema, a regex, a
choice, an EBNF grammar or a structural tag.

``spec`` turns the request's ``StructuredOutputsParams`` into a ``GrammarSpec`` (its
canonical form, the cache key); ``backend`` is the interface a grammar library
implements (compile a spec, a matcher per request, the batch's token bitmask);
``xgrammar_backend`` is the one implementation (vLLM's default); ``compile_cache``
compiles each distinct spec once, in a thread; ``validation`` is the tokenizer
service's check that a spec compiles before the request is scheduled. Workers keep a
matcher per request (``services/worker/structured_output.py``).
"""

from .backend import GrammarError, GrammarMatcher, StructuredOutputBackend
from .compile_cache import GrammarCompileCache
from .spec import GrammarSpec, grammar_spec
from .vocabulary import TokenizerVocabulary

__all__ = [
    "GrammarCompileCache",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "StructuredOutputBackend",
    "TokenizerVocabulary",
    "grammar_spec",
    "make_backend",
]


def make_backend(vocabulary: TokenizerVocabulary, name: str = "xgrammar") -> StructuredOutputBackend:
    """The backend called ``name`` over ``vocabulary`` (only xgrammar for now)."""
    if name != "xgrammar":
        raise ValueError(f"unknown structured output backend {name!r} (known: xgrammar)")
    from .xgrammar_backend import XgrammarBackend

    return XgrammarBackend(vocabulary)
