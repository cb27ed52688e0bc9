"""The request fields that constrain the output, in OpenAI's and vLLM's names, read
into one ``StructuredOutputsParams``.

* OpenAI: ``response_format`` ``{"type": "text" | "json_object" | "json_schema" |
  "structural_tag", ...}``;
* vLLM: ``structured_outputs`` ``{json, json_object, regex, choice, grammar,
  structural_tag}``, and the older ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``.

At most one constraint in all; vLLM's options we do not implement (another backend,
a whitespace pattern, ...) are refused with a 400. Whether the constraint compiles is
the tokenizer service's check (``shared.structured_output.validation``).
"""

from __future__ import annotations

import json

from shared.protocol import StructuredOutputsParams

from .errors import invalid

# A spec travels once to every worker rank, in the step that first schedules its request.
MAX_SPEC_CHARS = 1 << 16
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# vLLM's StructuredOutputsParams options that change how a constraint compiles: refused
# when set, rather than silently compiled another way.
_UNSUPPORTED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                        "whitespace_pattern", "backend")


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The one constraint the request body sets (None: unconstrained)."""
    found: dict[str, tuple[str, object]] = {}  # source field -> (kind, value)
    if body.get("response_format") is not None:
        kind_value = _response_format(body["response_format"])
        if kind_value is not None:
            found["response_format"] = kind_value
    if body.get("structured_outputs") is not None:
        found.update(_structured_outputs_object(body["structured_outputs"]))
    for field, kind in _GUIDED_FIELDS.items():
        if body.get(field) is not None:
            found[field] = (kind, body[field])
    for field in ("guided_whitespace_pattern",):
        if body.get(field) is not None:
            raise invalid(f"{field} is not supported", param=field)
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("auto", "xgrammar"):
        raise invalid(f"guided_decoding_backend {backend!r} is not supported (only xgrammar)",
                      param="guided_decoding_backend")
    if not found:
        return None
    if len(found) > 1:
        raise invalid(f"only one kind of structured output may be given, got {', '.join(found)}",
                      param=next(iter(found)))
    (field, (kind, value)), = found.items()
    return StructuredOutputsParams(**{kind: _canonical(kind, value, field)})


def _response_format(value) -> tuple[str, object] | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("response_format must be an object with a string type", param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise invalid("response_format json_schema needs a json_schema object with a schema", param=param)
        if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise invalid("response_format json_schema: name must be a string and strict a boolean", param=param)
        return "json", spec["schema"]
    if kind == "structural_tag":
        return "structural_tag", value
    raise invalid(f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}",
                  param=param)


def _structured_outputs_object(value) -> dict[str, tuple[str, object]]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", param=param)
    found = {}
    for key, item in value.items():
        if item is None or (key in _UNSUPPORTED_OPTIONS and item is False):
            continue
        if key in _UNSUPPORTED_OPTIONS:
            raise invalid(f"structured_outputs.{key} is not supported", param=f"{param}.{key}")
        if key not in _KINDS:
            raise invalid(f"structured_outputs has an unknown field {key!r} (known: {', '.join(_KINDS)})",
                          param=param)
        if key == "json_object" and item is not True:
            if item is False:
                continue
            raise invalid("structured_outputs.json_object must be a boolean", param=f"{param}.json_object")
        found[f"{param}.{key}"] = (key, item)
    return found


def _canonical(kind: str, value, field: str):
    """The field's value in the form the engine compiles (and caches by)."""
    if kind == "json_object":
        return True
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise invalid(f"{field} is not valid JSON: {e}", param=field) from e
        if kind == "json" and not isinstance(value, (dict, bool)):
            raise invalid(f"{field} must be a JSON schema (an object)", param=field)
        if kind == "structural_tag" and not isinstance(value, dict):
            raise invalid(f"{field} must be an object", param=field)
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(f"{field} must be a non-empty list of strings", param=field)
        text = json.dumps(value, ensure_ascii=False)
        value = list(value)
    else:
        if not isinstance(value, str) or not value:
            raise invalid(f"{field} must be a non-empty string", param=field)
        text = value
    if len(text) > MAX_SPEC_CHARS:
        raise invalid(f"{field} may be at most {MAX_SPEC_CHARS} characters long", param=field)
    return value if kind == "choice" else text
