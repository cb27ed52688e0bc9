"""Hugging Face transformers as the independent reference for tests.

- ``load_hf_model_from_gguf``: transformers' own GGUF loader (its own dequantization
  and Q/K un-permutation, not ours), cached per file.
- ``load_hf_model_from_folder``: a Hugging Face folder, cached per folder.
- ``hf_greedy``: greedy tokens and top-2 logit gaps, one prompt at a time, no padding.
- ``GreedyReferences``: ``hf_greedy`` of a model nobody changes, memoised per prompt, so
  that modules comparing with the same model on the same prompts share one run
  (tests/conftest.py keeps one for the default model and one per LoRA adapter).
- ``make_tiny_random_llama``: a small random GQA Llama with a byte-level tokenizer,
  saved as a complete Hugging Face folder (safetensors, config, tokenizer, template);
  ``make_random_llama`` the same for any shape (e.g. SmolLM2-135M's), on any device.

Everything is offline: nothing is fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@functools.lru_cache(maxsize=2)
def load_hf_model_from_gguf(gguf_path: str, dtype: torch.dtype = torch.float32):
    """``LlamaForCausalLM`` (fp32 unless told, eval) loaded by transformers from a GGUF file."""
    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    with _gguf_py_memoised():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


@contextlib.contextmanager
def _gguf_py_memoised():
    """transformers' GGUF loader parses the file's header twice (the config, then the
    weights) with gguf-py's ``GGUFReader``, and builds gguf-py's tensor-name map once per
    module of the model (397 times for SmolLM2): ~10 s of a 15 s load on a slow CPU, in
    every test process. Both are functions of their arguments alone, so while it loads they
    are memoised (the reader per file and version, reading through a plain ndarray view of
    its memory map, which numpy slices in C). What transformers reads and dequantizes is
    still gguf-py's."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = lambda path, mode="r": _gguf_py_reader(os.fspath(path), os.stat(path).st_mtime_ns, mode)
    gguf.get_tensor_name_map = _tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


@functools.lru_cache(maxsize=2)
def _gguf_py_reader(path: str, mtime_ns: int, mode: str):
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the module's own: gguf.GGUFReader is swapped meanwhile

    class PlainViewReader(GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):  # GGUFReader.__init__ assigns its memmap here, then parses through it
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainViewReader(path, mode)


@functools.lru_cache(maxsize=None)
def _tensor_name_map(arch, n_blocks):
    from gguf.tensor_mapping import get_tensor_name_map

    return get_tensor_name_map(arch, n_blocks)


@functools.lru_cache(maxsize=4)
def load_hf_model_from_folder(folder: str | os.PathLike):
    """A Hugging Face folder's causal LM (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


@torch.no_grad()
def hf_greedy(
    model, prompt_token_ids_list: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True
) -> list[tuple[list[int], list[float]]]:
    """Per prompt: (greedy tokens, top-2 logit gap at each generated position).

    A manual greedy loop over the KV cache, one prompt at a time (no padding). With
    ``stop_at_eos`` it stops after emitting an EOS of the model's generation config, as
    ``generate`` does; the EOS token is included. Runs on the model's device.
    """
    eos = _eos_ids(model) if stop_at_eos else set()
    results = []
    for prompt in prompt_token_ids_list:
        out = model(input_ids=torch.tensor([list(prompt)], device=model.device), use_cache=True)
        past, tokens, gaps = out.past_key_values, [], []
        for _ in range(max_new_tokens):
            top2 = torch.topk(out.logits[0, -1].float(), 2)
            token = int(top2.indices[0])
            tokens.append(token)
            gaps.append(float(top2.values[0] - top2.values[1]))
            if token in eos or len(tokens) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]], device=model.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
        results.append((tokens, gaps))
    return results


class GreedyReferences:
    """``hf_greedy`` of one model, memoised per (prompt, ``stop_at_eos``) for as long as this
    object lives. Greedy decoding is a prefix of itself: a prompt asked again for as many
    tokens or fewer is cut from its longest run so far; only prompts asked for more run
    (again). ``load_model`` is called only then; the model it gives must not change."""

    def __init__(self, load_model) -> None:
        self._load_model = load_model
        self._runs: dict[tuple[tuple[int, ...], bool], tuple[int, list[int], list[float]]] = {}

    def __call__(self, prompt_token_ids_list: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True,
                 run_for: int = 0) -> list[tuple[list[int], list[float]]]:
        """As ``hf_greedy``. Prompts not run yet run for ``max(max_new_tokens, run_for)``
        tokens: ``run_for`` is for a caller that knows a longer ask of the same prompts follows."""
        keys = [(tuple(prompt), stop_at_eos) for prompt in prompt_token_ids_list]
        missing = list(dict.fromkeys(k for k in keys if k not in self._runs or self._runs[k][0] < max_new_tokens))
        if missing:
            length = max(max_new_tokens, run_for)
            results = hf_greedy(self._load_model(), [list(k[0]) for k in missing], length, stop_at_eos)
            for key, (tokens, gaps) in zip(missing, results):
                self._runs[key] = (length, tokens, gaps)
        return [(self._runs[k][1][:max_new_tokens], self._runs[k][2][:max_new_tokens]) for k in keys]


def make_tiny_random_llama(
    dir: str | os.PathLike,
    seed: int = 0,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    *,
    hidden_size: int = 64,
    head_dim: int = 16,
    num_layers: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 320,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool = False,
    init_std: float = 0.2,
    lm_head_scale: float = 5.0,
) -> Path:
    """Save a random ``LlamaForCausalLM`` (GQA) with a matching tokenizer into ``dir``.

    ``init_std`` (HF uses 0.02) and ``lm_head_scale`` (untied models only) spread the
    logits out, so greedy choices are rarely near ties (under 1% of positions have a
    top-2 gap < 0.01 at the defaults) and outputs are not degenerate. Returns the folder.
    """
    folder, _ = make_random_llama(
        dir, seed, num_heads=num_heads, num_kv_heads=num_kv_heads, hidden_size=hidden_size, head_dim=head_dim,
        num_layers=num_layers, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings, init_std=init_std, lm_head_scale=lm_head_scale,
    )
    return folder


def make_random_llama(
    dir: str | os.PathLike,
    seed: int = 0,
    *,
    num_heads: int,
    num_kv_heads: int,
    hidden_size: int,
    head_dim: int,
    num_layers: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    rope_theta: float,
    rope_scaling: dict | None,
    tie_word_embeddings: bool,
    init_std: float,
    lm_head_scale: float = 1.0,
    device: str | torch.device = "cpu",
    save_dtype: torch.dtype | None = None,
):
    """A random ``LlamaForCausalLM`` of any shape, built on ``device`` and saved into ``dir``
    with a byte-level tokenizer of ``vocab_size`` tokens: (folder, the float32 model, eval).

    Norm weights are jittered around 1 (a mix-up of norms would show); ``init_std`` and
    ``lm_head_scale`` (untied models) spread the logits out, so greedy choices are rarely
    near ties. ``save_dtype`` (e.g. bfloat16) stores the weights rounded to it;
    the model returned then holds those rounded values, so it equals what a loader reads.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
        if not tie_word_embeddings:
            model.lm_head.weight.mul_(lm_head_scale)
    if save_dtype is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        # Buffers (the rotary inverse frequencies) are not saved: a loader computes them
        # again, so the model returned keeps them unrounded.
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        model.to(save_dtype).save_pretrained(folder, safe_serialization=True)
        model.float()
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
    save_byte_level_tokenizer(folder, vocab_size)
    return folder, model


def _merge_candidates(alphabet: list[str]):
    """Pairs to merge, in rank order: frequent English pairs first (what tiny vocabularies
    hold), then every pair of bytes, then a pair of bytes and one more byte."""
    yield from ((a, b) for a in "Ġetaoinsrh" for b in "etaoinsrhl")
    yield from ((a, b) for a in alphabet for b in alphabet)
    yield from ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)


def save_byte_level_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE of exactly ``vocab_size`` tokens (at least 259): 3 specials, 256
    bytes, then merges; with a chat template and its tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be at least {len(vocab)}, got {vocab_size}")
    merges = []
    for a, b in _merge_candidates(alphabet):
        if len(vocab) >= vocab_size:
            break
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in TINY_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": list(TINY_SPECIAL_TOKENS[1:]),
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
