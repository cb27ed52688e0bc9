"""The xgrammar backend (vLLM's default): compiles specs, matches tokens, masks logits.

Special tokens have empty strings in the vocabulary (``TokenizerVocabulary``), which
xgrammar treats as never part of the text: only the stop tokens may end a grammar.
"""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from .backend import GrammarError, GrammarMatcher, StructuredOutputBackend, apply_bitmask_on_cpu
from .spec import GrammarSpec, choice_ebnf
from .vocabulary import TokenizerVocabulary

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: ": not for clients.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Compile threads per compile (the caller's pool decides how many compiles run at once).
COMPILE_THREADS = 2


class XgrammarMatcher(GrammarMatcher):
    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def reset(self) -> None:
        self._matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, vocabulary: TokenizerVocabulary) -> None:
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(vocabulary.tokenizer_json)
        self.vocab_size = vocabulary.vocab_size
        self.tokenizer_info = xgr.TokenizerInfo(
            list(vocabulary.tokens),
            metadata["vocab_type"],
            vocab_size=vocabulary.vocab_size,
            stop_token_ids=list(vocabulary.stop_token_ids) or None,
            add_prefix_space=metadata["add_prefix_space"],
        )
        # Our compile cache keys on the spec; xgrammar's own cache would hold a second copy.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=COMPILE_THREADS, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            message = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise GrammarError(message) from e

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self.compiler
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.text)
        if spec.kind == "json_object":  # as vLLM: any JSON object
            return compiler.compile_json_schema('{"type": "object"}')
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.text)))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.text)
        if spec.kind == "structural_tag":
            return self._compile_structural_tag(spec.text)
        raise ValueError(f"unknown structured output kind {spec.kind!r}")

    def _compile_structural_tag(self, text: str) -> xgr.CompiledGrammar:
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            # vLLM's first form: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in tag["structures"]
            ]
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self.compiler.compile_structural_tag(text)

    def matcher(self, compiled, stop_token_ids: list[int] | None = None) -> XgrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            apply_bitmask_on_cpu(logits, bitmask, rows)
            return
        bitmask = bitmask[: logits.shape[0]]
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
