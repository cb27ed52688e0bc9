"""A request's constraint in canonical form: what is compiled, and the compile cache's key."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.protocol import StructuredOutputsParams

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """``kind`` is one of ``KINDS``; ``text`` the constraint as compiled: the schema's or
    structural tag's compact JSON, the regex, the EBNF, the choices as a JSON list, or
    "" for ``json_object``. Two requests with equal specs share one compiled grammar."""

    kind: str
    text: str

    @property
    def param(self) -> str:
        """The request field that names this kind, for error messages."""
        return f"structured_outputs.{self.kind}"


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The one constraint ``params`` sets; ValueError unless exactly one is set."""
    given = [
        kind for kind in KINDS
        if (params.json_object if kind == "json_object" else getattr(params, kind) is not None)
    ]
    if len(given) != 1:
        raise ValueError(f"exactly one kind of structured output must be given, got {given or 'none'}")
    kind = given[0]
    if kind == "json_object":
        return GrammarSpec(kind, "")
    if kind == "choice":
        return GrammarSpec(kind, json.dumps(params.choice, ensure_ascii=False))
    return GrammarSpec(kind, getattr(params, kind))


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are
    EBNF string-literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
