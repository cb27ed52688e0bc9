"""RMSNorm: the Triton kernel and the CPU path against the PyTorch reference, with and
without residual."""

import pytest
import torch

from kernels.rms_norm import _rms_norm_kernel_cpu, rms_norm_cpu, rms_norm_cpu_c, rms_norm_ref, rms_norm_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
SHAPES = [(1, 576), (257, 4096), (33, 5120)] if ON_CUDA else [(1, 576), (7, 96), (5, 1000)]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens,hidden_size", SHAPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_triton_matches_reference(num_tokens, hidden_size, dtype):
    x = torch.randn(num_tokens, hidden_size, device=DEVICE).to(dtype)
    weight = torch.randn(hidden_size, device=DEVICE).to(dtype)
    out = torch.full_like(x, float("nan"))
    got = rms_norm_triton(x, weight, 1e-5, out=out)
    tol = TOLERANCES[dtype]
    assert got is out
    torch.testing.assert_close(got, rms_norm_ref(x, weight, 1e-5), rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens,hidden_size", SHAPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_triton_with_residual_matches_reference(num_tokens, hidden_size, dtype):
    x = torch.randn(num_tokens, hidden_size, device=DEVICE).to(dtype)
    weight = torch.randn(hidden_size, device=DEVICE).to(dtype)
    residual = torch.randn(num_tokens, hidden_size, device=DEVICE).to(dtype)
    _, expected_residual = rms_norm_ref(x, weight, 1e-6, residual.clone())
    out, new_residual = rms_norm_triton(
        x, weight, 1e-6, residual.clone(), out=torch.full_like(x, float("nan"))
    )
    tol = TOLERANCES[dtype]
    # Exact, except that the interpreter rounds fp32 -> bf16 by truncation (1 ulp apart).
    sum_tol = tol if dtype == torch.bfloat16 and not ON_CUDA else 0.0
    torch.testing.assert_close(new_residual, expected_residual, rtol=sum_tol, atol=sum_tol)
    # Normalise the sum the kernel returned, so a 1-ulp sum difference is not counted twice.
    torch.testing.assert_close(out, rms_norm_ref(new_residual, weight, 1e-6), rtol=tol, atol=tol)


def test_reference_formula():
    x = torch.randn(4, 64, dtype=torch.float64, device=DEVICE)
    weight = torch.randn(64, dtype=torch.float64, device=DEVICE)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    # The reference computes in fp32 whatever the input dtype.
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6), expected, rtol=1e-5, atol=1e-6)
    residual = torch.randn(4, 64, dtype=torch.float64, device=DEVICE)
    out, summed = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, rms_norm_ref(x + residual, weight, 1e-6))


def test_reference_keeps_half_dtype():
    x = torch.randn(3, 32, device=DEVICE).to(torch.bfloat16)
    out = rms_norm_ref(x, torch.ones(32, device=DEVICE, dtype=torch.bfloat16), 1e-6)
    assert out.dtype == torch.bfloat16


needs_c_kernel = pytest.mark.skipif(
    _rms_norm_kernel_cpu() is None,
    reason="no C compiler: the C kernel cannot be built here",
)


@needs_c_kernel
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 576), (32, 576), (5, 1000), (300, 1024)])
def test_cpu_path_matches_reference_in_bfloat16(num_tokens, hidden_size, cpu_isa):
    # 300 x 1024 rows are split among threads. The C kernel sums squares in another order,
    # so an output may differ from the reference by one bf16 rounding step, rarely.
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden_size, generator=gen).bfloat16()
    residual = torch.randn(num_tokens, hidden_size, generator=gen).bfloat16()
    weight = torch.randn(hidden_size, generator=gen).bfloat16()
    expected, expected_sum = rms_norm_ref(x, weight, 1e-6, residual.clone())
    out, summed = rms_norm_cpu(x, weight, 1e-6, residual)
    assert summed is residual  # the sum is written in place, as the Triton kernel does
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert (out != expected).float().mean() < 0.01
    plain = rms_norm_cpu(x, weight, 1e-6, out=torch.empty_like(x))
    torch.testing.assert_close(plain, rms_norm_ref(x, weight, 1e-6), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_tokens,hidden_size", [(4, 96), (1, 576), (32, 576), (300, 4096)])
def test_cpu_path_keeps_float32_bit_for_bit_the_reference(num_tokens, hidden_size):
    # float32 must stay bit for bit Hugging Face's (greedy parity).
    gen = torch.Generator().manual_seed(num_tokens)
    x, residual = (3 * torch.randn(num_tokens, hidden_size, generator=gen) for _ in range(2))
    weight = torch.randn(hidden_size, generator=gen)
    expected, expected_sum = rms_norm_ref(x, weight, 1e-6, residual)
    out, summed = rms_norm_cpu(x, weight, 1e-6, residual)
    assert torch.equal(out, expected) and torch.equal(summed, expected_sum)
    assert torch.equal(rms_norm_cpu(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@needs_c_kernel
@pytest.mark.parametrize("num_tokens,hidden_size", [(1, 576), (32, 576), (5, 1000), (300, 1024)])
def test_float32_c_kernel_matches_reference(num_tokens, hidden_size, cpu_isa):
    # rms_norm_cpu_c (quantized models): float32 through the C kernel. The residual sum is
    # one float32 add, bit for bit; the normalized rows differ only where the vectorized sum
    # of squares rounds differently: a few units in the last place.
    gen = torch.Generator().manual_seed(num_tokens)
    x, residual = (3 * torch.randn(num_tokens, hidden_size, generator=gen) for _ in range(2))
    weight = torch.randn(hidden_size, generator=gen)
    expected, expected_sum = rms_norm_ref(x, weight, 1e-6, residual.clone())
    out, summed = rms_norm_cpu_c(x, weight, 1e-6, residual)
    assert summed is residual and torch.equal(summed, expected_sum)  # written in place
    torch.testing.assert_close(out, expected, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)
    # Rows of a wider buffer, without a residual, into a preallocated output.
    wide = 3 * torch.randn(num_tokens, hidden_size + 5, generator=gen)
    buffer = torch.full((num_tokens, hidden_size + 3), float("nan"))
    plain = rms_norm_cpu_c(wide[:, :hidden_size], weight, 1e-6, out=buffer[:, :hidden_size])
    torch.testing.assert_close(plain, rms_norm_ref(wide[:, :hidden_size], weight, 1e-6),
                               rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)
    assert torch.isnan(buffer[:, hidden_size:]).all()
