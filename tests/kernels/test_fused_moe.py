"""The mixture-of-experts kernels: routing, the PyTorch reference (grouped products) against
a token-by-token loop in float64, the Triton grouped GEMMs against the reference."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_moe_ref, fused_moe_triton, select_experts
from tests.kernels.paged_batch import DEVICE


def moe_inputs(num_tokens, num_experts, top_k, hidden=32, inter=24, seed=0, renormalize=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


def token_by_token(x, w13, w2, weights, ids, activation="silu"):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            out[t] += w * (w2[e].double() @ (act * up))
    return out


def test_routing_is_hugging_faces():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.5, 5.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [2, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normalised, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(normalised.sum(-1), torch.ones(2))


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 6, 2), (64, 8, 3), (5, 3, 1)])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_reference_matches_a_token_by_token_loop(num_tokens, num_experts, top_k, activation):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, num_experts, top_k, seed=num_tokens)
    out = fused_moe_ref(x, w13, w2, weights, ids, activation)
    torch.testing.assert_close(out.double().cpu(), token_by_token(*(t.cpu() for t in (x, w13, w2, weights, ids)),
                                                                  activation), rtol=1e-5, atol=1e-5)


def test_reference_sums_in_ascending_expert_order_from_zero():
    """As Hugging Face's index_add_ over the experts: the same float32 bits whatever order
    the router lists a token's experts in."""
    x, w13, w2, weights, ids = moe_inputs(16, 5, 3, seed=3)
    swapped = fused_moe_ref(x, w13, w2, weights.flip(-1), ids.flip(-1))
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids), swapped)


def test_no_tokens_and_unused_experts():
    x, w13, w2, weights, ids = moe_inputs(0, 4, 2)
    assert fused_moe_ref(x, w13, w2, weights, ids).shape == (0, 32)
    x, w13, w2, weights, ids = moe_inputs(3, 8, 1, seed=5)  # at most 3 of the 8 experts hit
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids).double().cpu(),
                               token_by_token(*(t.cpu() for t in (x, w13, w2, weights, ids))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (37, 6, 2), (70, 8, 3)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_triton_matches_the_reference(num_tokens, num_experts, top_k, block_m):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, num_experts, top_k, seed=7)
    out = fused_moe_triton(x, w13, w2, weights, ids, "silu", block_m=block_m)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)
