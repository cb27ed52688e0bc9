"""All decoder layers for one token in one C call (kernels/decode_layers.py): against the
same kernels called one by one from Python (bit for bit: hidden state and KV cache), and
against the PyTorch references (within the int8 activations' and bfloat16's rounding), for
each instruction-set build this host can run, int4 and int8 weights, with and without a
sliding window."""

import pytest
import torch

from kernels import decode_layers as dl
from kernels import int8_activations as ia
from kernels.rotary import compute_cos_sin_cache

# SmolLM2's head layout, smaller widths (multiples of the products' 32-value blocks).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK, BLOCKS = 192, 6, 2, 32, 320, 3, 16, 12


def tiles(n, k, bits, gen):
    if bits == 4:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
        offsets = (-8 * scales + 0.001 * torch.randn(n, k // 32, generator=gen)).half().float()
        return ia.repack_tiles(packed, scales, offsets)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    return ia.repack_tiles(q, (torch.rand(n, k // 32, generator=gen) / 600).half().float())


def model(bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = dl.DecoderShape(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1e-5, HEAD_DIM ** -0.5)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    norm = lambda: (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16)  # noqa: E731
    cache = lambda: torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)  # noqa: E731
    layers = [dl.LayerWeights(norm(), norm(), tiles(q + 2 * kv, HIDDEN, bits, gen), tiles(HIDDEN, q, bits, gen),
                              tiles(2 * INTER, HIDDEN, bits, gen), tiles(HIDDEN, INTER, bits, gen), cache(), cache())
              for _ in range(LAYERS)]
    return shape, layers, norm(), compute_cos_sin_cache(HEAD_DIM, 1024, 10000.0)


def copy(layers):
    return [dl.LayerWeights(**{**vars(l), "key_cache": l.key_cache.clone(), "value_cache": l.value_cache.clone()})
            for l in layers]


def step(position, block_table, window=None):
    slot = int(block_table[position // BLOCK]) * BLOCK + position % BLOCK
    attn = dl._attention_metadata(position, slot, block_table, window)
    return slot, torch.tensor([position]), attn


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("window", [None, 40])
def test_driver_equals_the_kernels_one_by_one_and_is_near_the_reference(cpu_isa, bits, window):
    if not dl.available():
        pytest.skip("the C kernels are not built")
    shape, layers, final_norm, cos_sin = model(bits)
    mine, theirs, reference = layers, copy(layers), copy(layers)
    driver = dl.DecodeLayers.build(shape, mine, final_norm, cos_sin, window)
    assert driver is not None
    block_table = torch.tensor([7, 2, 9, 0, 11, 4], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    for position in (0, 37, 63, 90):  # a first token, inside and at the end of blocks
        x = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
        slot, positions, attn = step(position, block_table, window)
        assert driver.takes(x, positions, attn)
        got = driver.run(x.clone(), positions, attn)
        want = dl.decode_layers_per_kernel(shape, theirs, final_norm, cos_sin, x, position, slot, block_table, window)
        ref = dl.decode_layers_ref(shape, reference, final_norm, cos_sin, x, position, slot, block_table, window)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), (got.float() - want.float()).abs().max()
        for a, b in zip(mine, theirs):
            assert torch.equal(a.key_cache, b.key_cache) and torch.equal(a.value_cache, b.value_cache)
        # Three layers of bfloat16 roundings and int8 activations apart: a few bfloat16 ulps.
        assert torch.allclose(got.float(), ref.float(), rtol=5e-2, atol=5e-2), (got.float() - ref.float()).abs().max()


def test_driver_reports_a_slot_outside_the_cache(cpu_isa):
    if not dl.available():
        pytest.skip("the C kernels are not built")
    shape, layers, final_norm, cos_sin = model(4)
    driver = dl.DecodeLayers.build(shape, layers, final_norm, cos_sin)
    _, positions, attn = step(5, torch.tensor([3], dtype=torch.int32))
    attn.slot_mapping = torch.tensor([BLOCKS * BLOCK])
    with pytest.raises(IndexError, match="slot"):
        driver.run(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), positions, attn)


def test_build_refuses_what_the_driver_does_not_run():
    shape, layers, final_norm, cos_sin = model(4)
    f32 = [dl.LayerWeights(**{**vars(l), "key_cache": l.key_cache.float()}) for l in layers]
    assert dl.DecodeLayers.build(shape, f32, final_norm, cos_sin) is None
    narrow = dl.DecoderShape(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER + 32, 1e-5, 1.0)
    assert dl.DecodeLayers.build(narrow, layers, final_norm, cos_sin) is None
