"""Rotary position embedding (Neox / Hugging Face Llama layout), applied in place to q and k.

The cos/sin table is built once per model by `compute_cos_sin_cache` in vLLM's layout:
row p holds [cos(p * inv_freq), sin(p * inv_freq)], each half head_dim wide. Each head is
rotated as rotate_half does: x1 = first half, x2 = second half,
out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin.
`rotary_embedding_ref` is the PyTorch reference; `rotary_embedding_cpu` the CPU path
(`kernels/cpu/rotary.c`: one call instead of a dozen small tensor ops, float32 results
bit for bit the reference's); `rotary_embedding_triton` is the GPU kernel: one program
per token, all q and k heads of that token.
"""

import ctypes

import torch

from kernels.cpu_build import bind, heads_packed, kernel_binding
from kernels.triton_import import tl, triton


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos in the first head_dim/2 columns, sin in the rest.

    inv_freq [head_dim/2] overrides the default base ** (-2i / head_dim) frequencies
    (e.g. Llama-3 scaled ones).
    """
    if inv_freq is None:
        # Computed exactly as Hugging Face does, so fp32 models match it bit for bit.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (base**exponents)
    inv_freq = inv_freq.float().cpu()
    assert inv_freq.shape == (head_dim // 2,), "inv_freq must have head_dim/2 entries"
    t = torch.arange(max_position, dtype=torch.float32, device="cpu")
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    """Rotate q [T, nh*hd] (or [T, nh, hd]) and k [T, nkv*hd] (or [T, nkv, hd]) in place."""
    half = head_dim // 2
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        heads = x.unflatten(-1, (-1, head_dim)) if x.dim() == 2 else x
        xf = heads.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


_ROTARY_SYMBOLS = {torch.float32: "rotary_f32", torch.bfloat16: "rotary_bf16"}
_ROTARY_ARGS = [
    ctypes.c_void_p, ctypes.c_int,  # positions, rows
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # q, its row stride, its heads
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # k, its row stride, its heads
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # cos_sin, its row stride, its rows
    ctypes.c_int, ctypes.c_int,  # head_dim, threads
]


@kernel_binding
def _rotary_kernel_cpu(dtype: torch.dtype):
    symbol = _ROTARY_SYMBOLS.get(dtype)
    return bind("rotary", symbol, _ROTARY_ARGS, ctypes.c_int) if symbol else None


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """x as [T, heads, head_dim] when each row's heads are packed, else None."""
    heads = x.unflatten(-1, (-1, head_dim)) if x.dim() == 2 else x
    return heads if heads_packed(heads) else None


def rotary_embedding_cpu(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    """`rotary_embedding_ref` through the C kernel where it applies (float32 or bfloat16
    q and k on CPU, each row's heads packed; the rows may be strided)."""
    kernel = _rotary_kernel_cpu(q.dtype)
    q3, k3 = _heads(q, head_dim), _heads(k, head_dim)
    if (
        kernel is None
        or q3 is None
        or k3 is None
        or k.dtype != q.dtype
        or q.device.type != "cpu"
        or cos_sin_cache.dtype != torch.float32
        or cos_sin_cache.stride(-1) != 1
        or head_dim % 2
    ):
        rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim)
        return
    positions = positions.to(torch.int64).contiguous()
    status = kernel(
        positions.data_ptr(), positions.shape[0],
        q3.data_ptr(), q3.stride(0), q3.shape[1],
        k3.data_ptr(), k3.stride(0), k3.shape[1],
        cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        head_dim, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"rotary embedding: a position is outside the table's {cos_sin_cache.shape[0]} rows")


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cos_sin_stride,
    num_q_heads,
    num_k_heads,
    HALF_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF_DIM)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + dims)[None, :]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF_DIM + dims)[None, :]
    heads = tl.arange(0, BLOCK_HEADS)

    q_mask = (heads < num_q_heads)[:, None]
    q1_ptrs = q_ptr + token * q_token_stride + heads[:, None] * q_head_stride + dims[None, :]
    q1 = tl.load(q1_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF_DIM, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptrs + HALF_DIM, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    k_mask = (heads < num_k_heads)[:, None]
    k1_ptrs = k_ptr + token * k_token_stride + heads[:, None] * k_head_stride + dims[None, :]
    k1 = tl.load(k1_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF_DIM, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(k1_ptrs, (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k1_ptrs + HALF_DIM, (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    """Triton rotary embedding; q and k may be strided views (e.g. slices of a fused qkv)."""
    q3 = q.unflatten(-1, (-1, head_dim)) if q.dim() == 2 else q
    k3 = k.unflatten(-1, (-1, head_dim)) if k.dim() == 2 else k
    assert q3.stride(-1) == 1 and k3.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, (
        "head_dim / 2 must be a power of two"
    )
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions,
        q3,
        k3,
        cos_sin_cache,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        cos_sin_cache.stride(0),
        q3.shape[1],
        k3.shape[1],
        HALF_DIM=head_dim // 2,
        BLOCK_HEADS=triton.next_power_of_2(max(q3.shape[1], k3.shape[1])),
    )
