"""``--lora-modules``: name=path, name=path:pinned and vLLM's JSON entries, and the bound on
pinned adapters (they hold worker slots for good)."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, LoRAConfig
from shared.protocol import LoRARequest


def test_short_pinned_and_json_entries():
    value = ('plain=/a/plain  fixed=/a/fixed:pinned '
             '{"name": "json one", "path": "/a/j s", "base_model_name": "base"} '
             '{"name": "jp", "path": "/a/jp", "pinned": true}')
    modules = LoRAConfig(enable_lora=True, max_loras=3, lora_modules=value).modules()
    assert modules == [
        LoRARequest("plain", "/a/plain"),
        LoRARequest("fixed", "/a/fixed", pinned=True),
        LoRARequest("json one", "/a/j s", base_model_name="base"),
        LoRARequest("jp", "/a/jp", pinned=True),
    ]


@pytest.mark.parametrize("value,error", [
    ("noequals", "entries are name=path"),
    ("=/path", "entries are name=path"),
    ("a=:pinned", "entries are name=path"),
    ('{"name": "a"}', "objects with name, path"),
    ('{"name": "a", "path": "/p", "rank": 8}', "objects with name, path"),
    ('{"name": "a", "path": "/p", "pinned": "yes"}', "'pinned' must be a boolean"),
    ('{"name": "a", "path": ""}', "'path' must be a non-empty string"),
    ('{"name": "a", "path": "/p"', "bad JSON entry"),
    ("a=/p a=/q", "names 'a' twice"),
    # Two pinned adapters fit two slots, but not beside an unpinned one; three never fit.
    ("a=/p:pinned b=/q:pinned c=/r", "2 pinned LoRA adapters do not fit max_loras 2 slots while unpinned"),
    ("a=/p:pinned b=/q:pinned c=/r:pinned", "3 pinned LoRA adapters do not fit max_loras 2 slots"),
])
def test_bad_entries_stop_start_up(value, error):
    with pytest.raises(ConfigError, match=error):
        LoRAConfig(enable_lora=True, max_loras=2, lora_modules=value)


def test_as_many_pinned_adapters_as_slots_when_all_are_pinned():
    modules = LoRAConfig(enable_lora=True, max_loras=2, lora_modules="a=/p:pinned b=/q:pinned").modules()
    assert all(m.pinned for m in modules)
