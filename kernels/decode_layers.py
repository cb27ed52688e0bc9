"""Every decoder layer of a Llama-shaped model for one query token, in one C call.

A batch-1 decode step of SmolLM2-135M runs ten kernels per layer, 300 a step, each a few
microseconds of Python (the module call, the wrapper's checks, ``torch.empty``, the ctypes
call) around a few microseconds of work: about 2 ms of a 6.5 ms step. ``DecodeLayers``
holds, once, the pointers every layer's kernels need (norm weights, the repacked product
tiles, the layer's KV cache) and runs all layers in ``kernels/cpu/decode_layers.c``: the
same C kernels (called through their entry points, each library built with its own
flags), in the same order, on the same rows, with the same bfloat16 roundings between
them as the per-kernel path (``decode_layers_per_kernel``, which the tests compare it
with bit for bit). So a token's hidden state does not depend on which of the two paths
ran, and batch invariance (the per-kernel path's, at any batch) carries over.

What it takes: bfloat16 activations and KV cache, every product a repacked quantized
weight (``kernels.int8_activations.WeightTiles``), RMSNorm, the rotary embedding with the
KV write, paged decode attention (one KV cache group) and SiLU-and-mul, built as C.
``decode_layers_ref`` is the PyTorch reference (each kernel's reference in turn).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels import int8_activations, paged_attention_torch, rms_norm, rotary_write_kv, silu_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_build import bind, kernel_binding
from kernels.int8_activations import WeightTiles

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [("rms_norm", _P), ("linear", _P), ("rotary_write_kv", _P), ("decode_attention", _P),
                ("silu_and_mul", _P)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
                ("block_size", _I), ("window", _I), ("eps", _F), ("scale", _F), ("cos_sin", _P),
                ("cos_sin_stride", _I64), ("cos_sin_rows", _I64), ("num_slots", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
                ("qkv_bits", _I), ("o_bits", _I), ("gate_up_bits", _I), ("down_bits", _I),
                ("qkv_scale_bytes", _I), ("o_scale_bytes", _I), ("gate_up_scale_bytes", _I), ("down_scale_bytes", _I),
                ("key_cache", _P), ("value_cache", _P)]


class _Scratch(ctypes.Structure):
    _fields_ = [("normed", _P), ("qkv", _P), ("attn", _P), ("gate_up", _P), ("act", _P)]


@kernel_binding
def _driver():
    return bind("decode_layers", "decode_layers_bf16",
                [_P, _P, _P, _I, _P, _P, _I, _I, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I], ctypes.c_int)


def _address(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


@kernel_binding
def _entry_points() -> _Kernels | None:
    """The C kernels the driver calls, or None when one of them is not built."""
    fns = (rms_norm._rms_norm_kernel_cpu(), int8_activations._kernel("linear_i8_tiled") if
           int8_activations.tiles_available() else None,
           rotary_write_kv._kernel_cpu(torch.bfloat16, torch.bfloat16),
           paged_attention_torch._kernel(torch.bfloat16, torch.bfloat16), silu_and_mul._silu_and_mul_kernel_cpu())
    addresses = [_address(fn) for fn in fns]
    return None if None in addresses else _Kernels(*addresses)


def available() -> bool:
    """Whether the driver and every kernel it calls are built."""
    return _driver() is not None and _entry_points() is not None


@dataclass
class LayerWeights:
    """One decoder layer's tensors: the two norms' weights (bfloat16 ``[hidden]``), the
    four products' repacked weights (q/k/v fused ``[(heads + 2 kv heads) * head_dim,
    hidden]``, o, gate/up fused ``[2 * intermediate, hidden]``, down) and its (key, value)
    cache ``[blocks, block_size, kv heads, head_dim]`` (bfloat16)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: WeightTiles
    o: WeightTiles
    gate_up: WeightTiles
    down: WeightTiles
    key_cache: torch.Tensor
    value_cache: torch.Tensor


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


def _fits(shape: DecoderShape, layer: LayerWeights) -> bool:
    """Whether the layer's tensors are what the driver reads."""
    h, q = shape.hidden, shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    products = ((layer.qkv, q + 2 * kv, h), (layer.o, h, q), (layer.gate_up, 2 * shape.intermediate, h),
                (layer.down, h, shape.intermediate))
    caches = (layer.key_cache, layer.value_cache)
    return (all(isinstance(w, WeightTiles) and w.shape == (n, k) and w.tiles.is_contiguous()
                and (w.scale_bytes == 4 or int8_activations.half_scales_available()) for w, n, k in products)
            and all(t.dtype == torch.bfloat16 and t.shape == (h,) and t.is_contiguous()
                    for t in (layer.input_norm, layer.post_norm))
            and all(c.dtype == torch.bfloat16 and c.dim() == 4 and c.shape[2:] == (shape.num_kv_heads, shape.head_dim)
                    and c.is_contiguous() and c.device.type == "cpu" for c in caches)
            and layer.key_cache.shape == layer.value_cache.shape)


class DecodeLayers:
    """All ``layers`` for one token per call (``run``); build with ``DecodeLayers.build``,
    which returns None where the driver cannot take these tensors. ``embedding``: the token
    embedding's table where it is kept as tiles ``[vocab, hidden]`` (the driver then looks
    the token up itself, as ``services/worker/linear.py`` ``quantized_embedding`` does),
    else None."""

    def __init__(self, shape: DecoderShape, layers: list[LayerWeights], final_norm: torch.Tensor,
                 cos_sin: torch.Tensor, window: int | None, embedding: WeightTiles | None = None) -> None:
        self.shape, self.layers, self.final_norm, self.cos_sin = shape, layers, final_norm, cos_sin
        self.embedding = embedding
        cache = layers[0].key_cache
        self._shape = _Shape(shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate,
                             cache.shape[1], window or 0, shape.eps, shape.scale, cos_sin.data_ptr(),
                             cos_sin.stride(0), cos_sin.shape[0], cache.shape[0] * cache.shape[1])
        self._layers = (_Layer * len(layers))(*(
            _Layer(l.input_norm.data_ptr(), l.post_norm.data_ptr(), l.qkv.tiles.data_ptr(), l.o.tiles.data_ptr(),
                   l.gate_up.tiles.data_ptr(), l.down.tiles.data_ptr(), l.qkv.bits, l.o.bits, l.gate_up.bits,
                   l.down.bits, l.qkv.scale_bytes, l.o.scale_bytes, l.gate_up.scale_bytes, l.down.scale_bytes,
                   l.key_cache.data_ptr(), l.value_cache.data_ptr()) for l in layers))
        q = shape.num_heads * shape.head_dim
        qkv = q + 2 * shape.num_kv_heads * shape.head_dim
        bf16 = lambda n: torch.empty(n, dtype=torch.bfloat16)  # noqa: E731
        # act holds o's and down's outputs too ([hidden]) and the MLP's activation ([intermediate]).
        self._buffers = (bf16(shape.hidden), bf16(qkv), bf16(q), bf16(2 * shape.intermediate),
                         bf16(max(shape.hidden, shape.intermediate)))
        self._scratch = _Scratch(*(b.data_ptr() for b in self._buffers))
        self._kernels = _entry_points()
        self._driver = _driver()
        self._args = (ctypes.byref(self._kernels), ctypes.byref(self._shape), self._layers, len(layers),
                      final_norm.data_ptr(), None if embedding is None else embedding.tiles.data_ptr(),
                      0 if embedding is None else embedding.bits, 0 if embedding is None else embedding.scale_bytes,
                      0 if embedding is None else embedding.n)

    @staticmethod
    def build(shape: DecoderShape, layers: list[LayerWeights], final_norm: torch.Tensor, cos_sin: torch.Tensor,
              window: int | None = None, embedding: WeightTiles | None = None) -> DecodeLayers | None:
        if embedding is not None and not (embedding.shape[1] == shape.hidden and embedding.tiles.is_contiguous()):
            return None
        if not (available() and layers and all(_fits(shape, layer) for layer in layers)
                and final_norm.dtype == torch.bfloat16 and final_norm.shape == (shape.hidden,)
                and final_norm.is_contiguous() and cos_sin.dtype == torch.float32 and cos_sin.stride(1) == 1
                and shape.head_dim % 2 == 0 and shape.num_heads % shape.num_kv_heads == 0
                and len({(l.key_cache.shape[0], l.key_cache.shape[1]) for l in layers}) == 1):
            return None
        return DecodeLayers(shape, layers, final_norm, cos_sin, window, embedding)

    def takes(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> bool:
        """Whether a step's inputs are one token this driver can run."""
        return (token_ids.shape == (1,) and token_ids.dtype == torch.int64
                and positions.dtype == attn.slot_mapping.dtype == torch.int64
                and attn.block_tables.dtype == attn.seq_lens.dtype == torch.int32
                and attn.block_tables.stride(-1) == 1 and attn.seq_lens.shape[0] == 1
                and attn.max_query_len == 1 and (attn.sliding_window or 0) == self._shape.window)

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
            x: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final norm of the last layer's output for the token ``token_ids[0]``, whose
        embedding ``x`` (bfloat16 ``[1, hidden]``, used as scratch) is given where the
        driver has no ``embedding``; or None when the attention kernel declined the shapes
        (nothing but KV rows the per-kernel path writes alike was written: it can run the
        step instead)."""
        if x is None:
            x = torch.empty(1, self.shape.hidden, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        status = self._driver(*self._args, token_ids.data_ptr(), x.data_ptr(), out.data_ptr(), positions.data_ptr(),
                              attn.slot_mapping.data_ptr(), attn.block_tables.data_ptr(), attn.seq_lens.data_ptr(),
                              ctypes.byref(self._scratch), torch.get_num_threads())
        if status == 0:
            return out
        layer, what = divmod(status, 16)
        if status == 6:
            raise IndexError(f"embedding: token {int(token_ids[0])} is outside the vocabulary's {self.embedding.n} rows")
        if what == 2:
            raise IndexError(f"rotary embedding: a position is outside the table's {self.cos_sin.shape[0]} rows")
        if what == 3:
            raise IndexError(f"write_kv: a slot is outside the cache's {self._shape.num_slots} slots")
        if what == 4:
            return None
        raise MemoryError(f"decode layers: out of memory in layer {layer}")


# --------------------------------------------------------------------------- the paths it is compared with


def _attention_metadata(position: int, slot: int, block_table: torch.Tensor, window: int | None) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([slot]), block_tables=block_table.view(1, -1).to(torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([position + 1], dtype=torch.int32),
        max_query_len=1, max_seq_len=position + 1, sliding_window=window)


def _layers_in_turn(shape: DecoderShape, layers: list[LayerWeights], final_norm: torch.Tensor, cos_sin: torch.Tensor,
                    x: torch.Tensor, position: int, slot: int, block_table: torch.Tensor, window: int | None,
                    norm, linear, rotary, attention, act) -> torch.Tensor:
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    positions = torch.tensor([position])
    attn = _attention_metadata(position, slot, block_table, window)
    residual = None
    for layer in layers:
        if residual is None:
            x, residual = norm(x, layer.input_norm, shape.eps), x
        else:
            x, residual = norm(x, layer.input_norm, shape.eps, residual)
        qkv = linear(x, layer.qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        rotary(positions, q, k, v, cos_sin, shape.head_dim, layer.key_cache, layer.value_cache, attn.slot_mapping)
        out = attention(q.view(1, shape.num_heads, shape.head_dim), layer.key_cache, layer.value_cache, attn,
                        shape.scale)
        x, residual = norm(linear(out.view(1, q_size), layer.o), layer.post_norm, shape.eps, residual)
        x = linear(act(linear(x, layer.gate_up)), layer.down)
    return norm(x, final_norm, shape.eps, residual)[0]


def decode_layers_per_kernel(shape, layers, final_norm, cos_sin, x, position, slot, block_table, window=None):
    """What the model's layers compute for one token through the CPU kernels one by one
    (``x``: its embedding ``[1, hidden]``; ``slot``: where its KV goes; ``block_table``:
    its blocks): the driver's result, bit for bit."""
    return _layers_in_turn(shape, layers, final_norm, cos_sin, x.clone(), position, slot, block_table, window,
                           rms_norm.rms_norm_cpu, int8_activations.tiled_linear_cpu,
                           rotary_write_kv.rotary_write_kv_cpu, paged_attention_torch.paged_attention_cpu_batch_invariant,
                           silu_and_mul.silu_and_mul_cpu)


def decode_layers_ref(shape, layers, final_norm, cos_sin, x, position, slot, block_table, window=None):
    """The same through every kernel's PyTorch reference."""
    return _layers_in_turn(shape, layers, final_norm, cos_sin, x.clone(), position, slot, block_table, window,
                           rms_norm.rms_norm_ref, int8_activations.tiled_linear_ref,
                           rotary_write_kv.rotary_write_kv_ref, paged_attention_torch.paged_attention_ref,
                           silu_and_mul.silu_and_mul_ref)
