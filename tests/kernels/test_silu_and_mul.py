"""SiLU-and-mul: the Triton kernel and the CPU path (C kernel for bf16) against the PyTorch
reference."""

import pytest
import torch
import torch.nn.functional as F

from kernels.silu_and_mul import silu_and_mul_cpu, silu_and_mul_cpu_c, silu_and_mul_ref, silu_and_mul_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
SHAPES = [(1, 1536), (257, 14336), (64, 11008)] if ON_CUDA else [(1, 1536), (5, 100), (3, 2500)]
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens,intermediate_size", SHAPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_triton_matches_reference(num_tokens, intermediate_size, dtype):
    x = (3 * torch.randn(num_tokens, 2 * intermediate_size, device=DEVICE)).to(dtype)
    out = torch.full((num_tokens, intermediate_size), float("nan"), device=DEVICE, dtype=dtype)
    got = silu_and_mul_triton(x, out=out)
    tol = TOLERANCES[dtype]
    assert got is out
    torch.testing.assert_close(got, silu_and_mul_ref(x), rtol=tol, atol=tol)


def test_reference_formula():
    x = torch.randn(4, 20, dtype=torch.float64, device=DEVICE)
    gate, up = x[:, :10], x[:, 10:]
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(silu_and_mul_ref(x), expected)
    torch.testing.assert_close(silu_and_mul_ref(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_cpu_path_matches_reference(dtype, cpu_isa):
    x = (3 * torch.randn(7, 2 * 300)).to(dtype)
    out = torch.full((7, 300), float("nan"), dtype=dtype)
    got = silu_and_mul_cpu(x, out=out)
    assert got is out
    if dtype == torch.float32:
        torch.testing.assert_close(got, silu_and_mul_ref(x), rtol=0, atol=0)
    else:  # one more rounding than the reference: within two units in the last place
        torch.testing.assert_close(got, silu_and_mul_ref(x), rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


@pytest.mark.skipif(ON_CUDA, reason="the CPU path")
def test_cpu_bf16_kernel_rounds_once_like_the_reference(cpu_isa):
    from kernels.silu_and_mul import _silu_and_mul_kernel_cpu

    if _silu_and_mul_kernel_cpu() is None:
        pytest.skip("no C compiler: the C kernel cannot be built here")
    # Rows of a wider buffer (strided input and output), gates from -100 to 100.
    wide = (20 * torch.randn(33, 2 * 1536 + 7)).to(torch.bfloat16)
    wide[0, :1536] = torch.linspace(-100, 100, 1536).to(torch.bfloat16)
    x = wide[:, : 2 * 1536]
    out_buffer = torch.full((33, 1600), float("nan"), dtype=torch.bfloat16)
    got = silu_and_mul_cpu(x, out=out_buffer[:, :1536])
    expected = silu_and_mul_ref(x)
    # The same float32 value rounded once; only the exp approximation may move a result
    # across a rounding boundary, by one unit in the last place.
    diff = (got.float() - expected.float()).abs()
    assert bool((diff <= torch.finfo(torch.bfloat16).eps * expected.float().abs()).all())
    assert (diff > 0).float().mean().item() < 0.01
    assert torch.isnan(out_buffer[:, 1536:]).all()


def test_cpu_path_without_the_c_kernel_matches_hugging_face_ops(monkeypatch):
    import kernels.silu_and_mul as module

    monkeypatch.setattr(module, "_silu_and_mul_kernel_cpu", lambda: None)
    x = (3 * torch.randn(7, 2 * 300)).to(torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_cpu(x), F.silu(gate) * up)


@pytest.mark.skipif(ON_CUDA, reason="the CPU path")
def test_cpu_float32_c_kernel_matches_reference(cpu_isa):
    from kernels.silu_and_mul import _silu_and_mul_f32_kernel_cpu

    if _silu_and_mul_f32_kernel_cpu() is None:
        pytest.skip("no C compiler: the C kernel cannot be built here")
    # silu_and_mul_cpu_c (quantized models): float32 through the C kernel, whose exp is
    # fast_expf (relative error < 2e-8) where the reference takes PyTorch's: results within
    # a few units in the last place. Strided rows, gates from -100 to 100.
    wide = 20 * torch.randn(33, 2 * 1536 + 7)
    wide[0, :1536] = torch.linspace(-100, 100, 1536)
    x = wide[:, : 2 * 1536]
    out_buffer = torch.full((33, 1600), float("nan"))
    got = silu_and_mul_cpu_c(x, out=out_buffer[:, :1536])
    torch.testing.assert_close(got, silu_and_mul_ref(x), rtol=4 * torch.finfo(torch.float32).eps, atol=1e-30)
    assert torch.isnan(out_buffer[:, 1536:]).all()
    assert torch.equal(silu_and_mul_cpu_c(x.bfloat16()), silu_and_mul_cpu(x.bfloat16()))  # bf16: the same kernel
