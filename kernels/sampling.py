"""Sampling's per-row work: temperature, min-p, top-k and top-p, and one draw per row.

Each row's distribution is softmax(logits / T) with min-p, then top-k, then top-p applied
(vLLM's order); a greedy row (T < 1e-5) takes the argmax, and its distribution, where one
is asked for, is taken at temperature 1. The kept set of top-k and of top-p is every token
at least as likely as the boundary token (ties at the boundary are all kept, as vLLM's
top-k keeps them): top-k's boundary is the k-th likeliest token, top-p's the first token,
likeliest first, at which the mass so far reaches p. A draw takes ONE uniform u in [0, 1)
per row and returns the token whose interval of the cumulative distribution, in vocabulary
order, holds u (inverse CDF): a token of probability 0 is never drawn. No noise value per
vocabulary entry, no sort of the vocabulary.

- `sample_ref` / `filtered_probs_ref`: the PyTorch reference (sorts, float64 cumulative
  sums); `inverse_cdf_draw` the draw from given weights (the reference's, and what the
  rejection sampler and the draft model draw with from their explicit distributions);
- `sample_cpu` / `filtered_probs_cpu`: `kernels/cpu/sampling.c`, one pass per stage and a
  histogram search for the top-k / top-p boundary (the reference where no C kernel can be
  built);
- `sample_triton` / `filtered_probs_triton`: the GPU kernel, one program per row, the
  boundaries found by bisection over the float bits of the probabilities;
- `sample` / `filtered_probs`: whichever of them suits the logits' device.

Logits are float32 [rows, vocab]; temperature, top_p, min_p float32 [rows]; top_k int64
[rows] (<= 0 or >= vocab: off); uniforms float64 [rows].
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import bind, kernel_binding
from kernels.triton_import import tl, triton

GREEDY_BELOW = 1e-5  # a temperature below this is greedy


# ------------------------------------------------------------------ PyTorch reference


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens less likely than min_p times the likeliest at -inf."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p by a sort of each row; tokens outside at -inf (ties at each
    boundary kept)."""
    vocab = logits.shape[1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    # (top_p 1 keeps every token even where the float32 sum reaches 1 before the tail.)
    keep = ((probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(1)) | (top_p >= 1).unsqueeze(1)
    keep[:, 0] = True
    boundary = sorted_logits.gather(1, (keep.sum(dim=-1, keepdim=True) - 1))
    return logits.masked_fill(logits < torch.maximum(kth, boundary), float("-inf"))


def filtered_probs_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Each row's distribution after temperature (1 for greedy rows), min-p, top-k, top-p."""
    greedy = temperature < GREEDY_BELOW
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    logits = logits / temperature.unsqueeze(1)
    if bool((min_p > 0).any()):
        logits = apply_min_p(logits, min_p)
    vocab = logits.shape[1]
    if bool(((top_k > 0) & (top_k < vocab)).any() or (top_p < 1).any()):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def inverse_cdf_draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first token whose cumulative weight (float64, vocabulary
    order) exceeds u times the row's total; ``weights`` >= 0, not necessarily normalised."""
    cdf = weights.double().cumsum(dim=-1)
    target = uniforms.double().to(weights.device) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    # u * total may round up to the total: the last token of non-zero weight then.
    last = weights.shape[1] - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(tokens >= weights.shape[1], last, tokens)


def sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, uniforms: torch.Tensor,
) -> torch.Tensor:
    """Each row's token: the argmax for greedy rows, else a draw from ``filtered_probs_ref``."""
    drawn = inverse_cdf_draw(filtered_probs_ref(logits, temperature, top_k, top_p, min_p), uniforms)
    return torch.where(temperature.to(logits.device) < GREEDY_BELOW, logits.argmax(dim=-1), drawn)


# ------------------------------------------------------------------ CPU (C kernel)

_SAMPLE_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 7,
                ctypes.c_int64, ctypes.c_int]


@kernel_binding
def _sample_rows_kernel():
    return bind("sampling", "sample_rows", _SAMPLE_ARGS, ctypes.c_int)


def _c_ready(logits: torch.Tensor, params: tuple[torch.Tensor, ...]) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and all(p.is_contiguous() and p.device.type == "cpu" for p in params))


def _params(temperature, top_k, top_p, min_p):
    return (temperature.float().contiguous(), top_k.to(torch.int64).contiguous(), top_p.float().contiguous(),
            min_p.float().contiguous())


def _run_c(kernel, logits, params, uniforms, tokens, probs) -> None:
    temperature, top_k, top_p, min_p = params
    result = kernel(
        logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], temperature.data_ptr(),
        top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), uniforms.data_ptr() if uniforms is not None else None,
        tokens.data_ptr() if tokens is not None else None, probs.data_ptr() if probs is not None else None,
        probs.stride(0) if probs is not None else 0, torch.get_num_threads(),
    )  # fmt: skip
    if result != 0:
        raise MemoryError("sample_rows: no memory for its scratch")


def sample_cpu(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, uniforms: torch.Tensor,
) -> torch.Tensor:
    """`sample_ref` through the C kernel where it can be had."""
    kernel = _sample_rows_kernel()
    params = _params(temperature, top_k, top_p, min_p)
    uniforms = uniforms.double().contiguous()
    if kernel is None or not _c_ready(logits, (*params, uniforms)) or logits.shape[0] == 0:
        return sample_ref(logits, temperature, top_k, top_p, min_p, uniforms)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    _run_c(kernel, logits, params, uniforms, tokens, None)
    return tokens


def filtered_probs_cpu(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """`filtered_probs_ref` through the C kernel where it can be had."""
    kernel = _sample_rows_kernel()
    params = _params(temperature, top_k, top_p, min_p)
    if kernel is None or not _c_ready(logits, params) or logits.shape[0] == 0:
        return filtered_probs_ref(logits, temperature, top_k, top_p, min_p)
    probs = torch.empty_like(logits)
    _run_c(kernel, logits, params, None, None, probs)
    return probs


# ------------------------------------------------------------------ GPU (Triton)

# Float bits of 1.0: every e = exp((x - max) / T) lies in [0, ONE_BITS].
ONE_BITS = 0x3F800000
BISECTION_STEPS = 31  # ceil(log2(ONE_BITS + 2))


@triton.jit
def _weights(x, row_max, scale, min_p):
    """e = exp((x - max) / T), 0 for banned entries and below min-p."""
    e = tl.exp((x - row_max) * scale)
    return tl.where((x == float("-inf")) | (e < min_p), 0.0, e)


@triton.jit
def _mass_at_least(x_row, vocab, row_max, scale, min_p, floor, threshold, BLOCK: tl.constexpr):
    """(count, mass) of the entries e >= threshold that are >= floor (and non-zero)."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((), dtype=tl.int64)
    mass = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=float("-inf"))
        e = _weights(x, row_max, scale, min_p)
        bits = e.to(tl.int32, bitcast=True)
        kept = (bits >= threshold) & (bits >= floor) & (e > 0)
        count += tl.sum(kept.to(tl.int64), axis=0)
        mass += tl.sum(tl.where(kept, e, 0.0), axis=0)
    return count, mass


@triton.jit
def _kept_weights(x, row_max, scale, min_p, floor):
    """``_weights``, 0 below the threshold bit pattern ``floor`` (top-k and top-p's)."""
    e = _weights(x, row_max, scale, min_p)
    return tl.where(e.to(tl.int32, bitcast=True) >= floor, e, 0.0)


@triton.jit
def _largest_threshold(x_row, vocab, row_max, scale, min_p, floor, want, BY_MASS: tl.constexpr,
                       BLOCK: tl.constexpr, ONE: tl.constexpr, STEPS: tl.constexpr):
    """By bisection, the largest bit pattern t >= ``floor`` at which the entries e >= t
    reach ``want`` in count (or in mass, ``BY_MASS``)."""
    lo = floor
    hi = tl.full((), ONE + 1, dtype=tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        count, mass = _mass_at_least(x_row, vocab, row_max, scale, min_p, floor, mid, BLOCK)
        if BY_MASS:
            enough = mass >= want
        else:
            enough = count >= want
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo


@triton.jit
def _sample_kernel(
    logits_ptr, logits_stride, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, uniforms_ptr, tokens_ptr,
    probs_ptr, probs_stride, WANT_TOKENS: tl.constexpr, WANT_PROBS: tl.constexpr, BLOCK: tl.constexpr,
    ONE: tl.constexpr, STEPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * logits_stride
    offs = tl.arange(0, BLOCK)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature < 1e-5
    scale = 1.0 / tl.where(greedy, 1.0, temperature)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    # The maximum and the first index holding it.
    row_max = tl.full((), float("-inf"), dtype=tl.float32)
    argmax = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=float("-inf"))
        block_max = tl.max(x, axis=0)
        block_arg = tl.min(tl.where(x == block_max, offs, BLOCK), axis=0)
        argmax = tl.where(block_max > row_max, start + block_arg, argmax)
        row_max = tl.maximum(row_max, block_max)

    # Top-k: the largest bit pattern t with count(e >= t) >= k (0 when k is off or fewer
    # than k entries are non-zero), by bisection; then top-p the same way over the mass.
    floor = tl.zeros((), dtype=tl.int32)
    if (top_k > 0) & (top_k < vocab):
        floor = _largest_threshold(x_row, vocab, row_max, scale, min_p, floor, top_k, False, BLOCK, ONE, STEPS)
    if top_p < 1.0:
        _count, kept_mass = _mass_at_least(x_row, vocab, row_max, scale, min_p, floor, floor, BLOCK)
        floor = _largest_threshold(x_row, vocab, row_max, scale, min_p, floor, top_p * kept_mass, True, BLOCK, ONE,
                                   STEPS)

    # The kept mass, block by block in the order the draw walks them.
    total = tl.zeros((), dtype=tl.float64)
    for start in range(0, vocab, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=float("-inf"))
        total += tl.sum(_kept_weights(x, row_max, scale, min_p, floor), axis=0).to(tl.float64)

    if WANT_TOKENS:
        target = tl.load(uniforms_ptr + row) * total
        cum = tl.zeros((), dtype=tl.float64)
        token = tl.full((), -1, dtype=tl.int64)
        last_positive = tl.zeros((), dtype=tl.int64)
        for start in range(0, vocab, BLOCK):
            x = tl.load(x_row + start + offs, mask=start + offs < vocab, other=float("-inf"))
            e = _kept_weights(x, row_max, scale, min_p, floor)
            block_sum = tl.sum(e, axis=0).to(tl.float64)
            inside = cum + tl.cumsum(e, axis=0).to(tl.float64)
            first = tl.min(tl.where((inside > target) & (e > 0), offs, BLOCK), axis=0)
            block_last = tl.max(tl.where(e > 0, offs, -1), axis=0)
            # Rounding may leave the target just past the block's own sum: its last entry.
            first = tl.where(first == BLOCK, block_last, first)
            hit = (token < 0) & (cum + block_sum > target) & (block_last >= 0)
            token = tl.where(hit, start + first, token)
            last_positive = tl.where(block_last >= 0, start + block_last, last_positive)
            cum += block_sum
        token = tl.where(token < 0, last_positive, token)
        tl.store(tokens_ptr + row, tl.where(greedy, argmax, token))
    if WANT_PROBS:
        inv = (1.0 / total).to(tl.float32)
        for start in range(0, vocab, BLOCK):
            mask = start + offs < vocab
            x = tl.load(x_row + start + offs, mask=mask, other=float("-inf"))
            e = _kept_weights(x, row_max, scale, min_p, floor)
            tl.store(probs_ptr + row * probs_stride + start + offs, e * inv, mask=mask)


def _launch_triton(logits, temperature, top_k, top_p, min_p, uniforms, tokens, probs) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32
    rows, vocab = logits.shape
    if rows == 0:
        return
    temperature, top_k, top_p, min_p = _params(temperature, top_k, top_p, min_p)
    dummy = logits  # an unused pointer argument still needs a tensor
    _sample_kernel[(rows,)](
        logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p,
        uniforms if uniforms is not None else dummy, tokens if tokens is not None else dummy,
        probs if probs is not None else dummy, probs.stride(0) if probs is not None else 0,
        WANT_TOKENS=tokens is not None, WANT_PROBS=probs is not None,
        BLOCK=min(1024, triton.next_power_of_2(vocab)), ONE=ONE_BITS,
        STEPS=BISECTION_STEPS,
    )  # fmt: skip


def sample_triton(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, uniforms: torch.Tensor,
) -> torch.Tensor:
    """`sample_ref` as one Triton program per row."""
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    uniforms = uniforms.to(device=logits.device, dtype=torch.float64).contiguous()
    _launch_triton(logits, temperature, top_k, top_p, min_p, uniforms, tokens, None)
    return tokens


def filtered_probs_triton(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """`filtered_probs_ref` as one Triton program per row."""
    probs = torch.empty_like(logits)
    _launch_triton(logits, temperature, top_k, top_p, min_p, None, None, probs)
    return probs


# ------------------------------------------------------------------ by device


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, uniforms: torch.Tensor,
) -> torch.Tensor:
    """Each row's token (greedy rows: the argmax; others: one draw with their uniform)."""
    if logits.device.type == "cuda":
        return sample_triton(logits, temperature, top_k, top_p, min_p, uniforms)
    return sample_cpu(logits, temperature, top_k, top_p, min_p, uniforms)


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Each row's distribution after temperature, min-p, top-k and top-p."""
    if logits.device.type == "cuda":
        return filtered_probs_triton(logits, temperature, top_k, top_p, min_p)
    return filtered_probs_cpu(logits, temperature, top_k, top_p, min_p)
