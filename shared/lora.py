"""LoRA adapter folders (PEFT) checked against a base model, without torch.

The gateway checks an adapter when it is loaded (``check_lora_adapter``: the config and the
safetensors header only, so a bad path, a rank above ``--max-lora-rank`` or a shape the base
model lacks is a 400 at once); the workers read the weights with the same checks
(``services/worker/lora/adapter.py``). A ``lora_path`` that is a file is a GGUF LoRA instead
(``shared/lora_gguf.py``), checked the same way (``shared/lora_shapes.py``: the checks both
formats share). Also ``--lora-modules``' parsing.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` with, per adapted module,
``...layers.<i>.<block>.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``; the model adds ``scaling * B @ A @ x`` to the module's output.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from shared.lora_gguf import read_gguf_lora
from shared.lora_shapes import (
    MODULE_TO_PROJECTION,
    LoRAAdapterError,
    ProjectionShapes,
    check_module_shapes,
    module_pairs,
)
from shared.model_config import ModelConfig
from shared.protocol import LoRARequest

PINNED_SUFFIX = ":pinned"  # --lora-modules name=path:pinned
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def read_adapter_config(path: str | Path, max_rank: int) -> dict:
    """``adapter_config.json`` of the folder, checked against what we can serve."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory (PEFT adapter) "
                               f"or a file (GGUF LoRA)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} has no {name}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"cannot read {CONFIG_FILE} of {str(path)!r}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} of {str(path)!r} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"adapter type {config.get('peft_type')!r} is not LoRA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"adapter_config r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    unsupported = [key for key, present in refused.items() if present]
    if unsupported:
        raise LoRAAdapterError(f"LoRA adapters with {', '.join(unsupported)} are not supported")
    return config


def lora_scaling(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    rank = config["r"]
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def parse_weight_name(name: str, num_layers: int) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> (3, "q_proj", "A")."""
    parts = name.split(".")
    try:
        i = parts.index("layers")
        layer = int(parts[i + 1])
        module, kind, leaf = parts[-3], parts[-2], parts[-1]
    except (ValueError, IndexError):
        raise LoRAAdapterError(f"LoRA weight {name!r} is not in a decoder layer") from None
    if leaf != "weight" or kind not in ("lora_A", "lora_B"):
        raise LoRAAdapterError(f"LoRA weight {name!r} is not a lora_A / lora_B weight")
    if module not in MODULE_TO_PROJECTION:
        raise LoRAAdapterError(f"LoRA target module {module!r} is not supported "
                               f"(supported: {', '.join(MODULE_TO_PROJECTION)})")
    if not 0 <= layer < num_layers:
        raise LoRAAdapterError(f"LoRA weight {name!r}: the base model has {num_layers} layers")
    return layer, module, kind[-1]


def _safetensors_header(file: Path) -> dict:
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"cannot read {file}: {e}") from None
    header.pop("__metadata__", None)
    return header


def check_lora_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> int:
    """Check the PEFT folder (or GGUF LoRA file) for a model of ``model_config`` from its
    config and safetensors header (no weights read); returns the adapter's rank. Raises
    ``LoRAAdapterError``."""
    if Path(path).is_file():
        return read_gguf_lora(path, model_config, max_rank).rank
    config = read_adapter_config(path, max_rank)
    header = _safetensors_header(Path(path) / WEIGHTS_FILE)
    shape_of = ((name, entry.get("shape", ()) if isinstance(entry, dict) else ()) for name, entry in header.items())
    shapes = ProjectionShapes.of(model_config)
    for (layer, module), pair in module_pairs(shape_of, model_config.num_hidden_layers, path, parse_weight_name).items():
        check_module_shapes(layer, module, pair["A"], pair["B"], config["r"], shapes)
    return config["r"]


def parse_lora_modules(value: str) -> list[LoRARequest]:
    """``--lora-modules``: whitespace-separated entries, each ``name=path``, ``name=path:pinned``
    or vLLM's JSON object ``{"name": .., "path": .., "base_model_name": ..}`` (which may
    also hold ``"pinned": true``). Raises ``ValueError`` naming the bad entry."""
    modules: list[LoRARequest] = []
    decoder = json.JSONDecoder()
    i = 0
    while True:
        while i < len(value) and value[i].isspace():
            i += 1
        if i == len(value):
            break
        if value[i] == "{":
            try:
                entry, i = decoder.raw_decode(value, i)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: bad JSON entry at character {i}: {e}") from None
            modules.append(_json_module(entry))
        else:
            end = i
            while end < len(value) and not value[end].isspace():
                end += 1
            modules.append(_short_module(value[i:end]))
            i = end
    names = [m.lora_name for m in modules]
    twice = {n for n in names if names.count(n) > 1}
    if twice:
        raise ValueError(f"lora_modules names {sorted(twice)[0]!r} twice")
    return modules


def _short_module(entry: str) -> LoRARequest:
    name, sep, path = entry.partition("=")
    pinned = path.endswith(PINNED_SUFFIX)
    if pinned:
        path = path[: -len(PINNED_SUFFIX)]
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entries are name=path, name=path{PINNED_SUFFIX} or a JSON object, "
                         f"got {entry!r}")
    return LoRARequest(name, path, pinned=pinned)


def _json_module(entry: object) -> LoRARequest:
    fields = {"name": str, "path": str, "base_model_name": str, "pinned": bool}
    if not isinstance(entry, dict) or not {"name", "path"} <= entry.keys() or not entry.keys() <= fields.keys():
        raise ValueError(f"lora_modules JSON entries are objects with name, path and optionally "
                         f"base_model_name and pinned, got {json.dumps(entry)}")
    for key, value in entry.items():
        if not isinstance(value, fields[key]) or (fields[key] is str and key != "base_model_name" and not value):
            raise ValueError(f"lora_modules JSON entry {json.dumps(entry)}: {key!r} must be a "
                             f"{'boolean' if fields[key] is bool else 'non-empty string'}")
    return LoRARequest(entry["name"], entry["path"], pinned=entry.get("pinned", False),
                       base_model_name=entry.get("base_model_name") or "")


def check_pinning(adapters: list[LoRARequest], max_loras: int) -> None:
    """Pinned adapters hold worker slots for good, so at most ``max_loras`` of them, and
    one slot fewer while other adapters are served (else those could never run)."""
    pinned = sum(a.pinned for a in adapters)
    limit = max_loras if pinned == len(adapters) else max_loras - 1
    if pinned > limit:
        raise LoRAAdapterError(
            f"{pinned} pinned LoRA adapters do not fit max_loras {max_loras} slots"
            + ("" if pinned == len(adapters) else " while unpinned adapters also need one")
        )
