"""Chat templates: compiled as transformers compiles them, and ``--chat-template`` read.

Rendering is the tokenizer's (``shared/tokenizer.py``); the built-in tool fallback
(``shared/tool_template.py``) compiles its own template here too.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from shared.config_error import ConfigError


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """A chat template compiled as transformers compiles it (sandboxed, its filters and globals)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def read_chat_template(path_or_template: str) -> str:
    """``--chat-template``'s value as vLLM reads it: a file's text, or the template itself
    when no such file exists and it looks like one (it has braces or a newline)."""
    path = Path(path_or_template)
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif any(c in path_or_template for c in "{}\n"):
        template = path_or_template
    else:
        raise ConfigError(f"chat template {path_or_template!r} is neither a readable file nor a template")
    try:
        compile_template(template)
    except Exception as e:  # jinja2's TemplateSyntaxError
        raise ConfigError(f"chat template {path_or_template!r} does not compile: {e}") from e
    return template
