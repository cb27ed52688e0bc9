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
from services.worker.linear import quantized_embedding

# SmolLM2's head layout, smaller widths (multiples of the products' 32-value blocks).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK, BLOCKS = 192, 6, 2, 32, 320, 3, 16, 12


def tiles(n, k, bits, gen, scale_bytes=None):
    if bits == 4:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
        offsets = (-8 * scales + 0.001 * torch.randn(n, k // 32, generator=gen)).half().float()
        return ia.repack_tiles(packed, scales, offsets, scale_bytes=scale_bytes)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    return ia.repack_tiles(q, (torch.rand(n, k // 32, generator=gen) / 600).half().float(), scale_bytes=scale_bytes)


VOCAB = 40


def model(bits, seed=0, scale_bytes=None):
    gen = torch.Generator().manual_seed(seed)
    shape = dl.DecoderShape(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1e-5, HEAD_DIM ** -0.5)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    norm = lambda: (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16)  # noqa: E731
    cache = lambda: torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)  # noqa: E731
    weight = lambda n, k: tiles(n, k, bits, gen, scale_bytes)  # noqa: E731
    layers = [dl.LayerWeights(norm(), norm(), weight(q + 2 * kv, HIDDEN), weight(HIDDEN, q), weight(2 * INTER, HIDDEN),
                              weight(HIDDEN, INTER), cache(), cache())
              for _ in range(LAYERS)]
    return shape, layers, norm(), compute_cos_sin_cache(HEAD_DIM, 1024, 10000.0), weight(VOCAB, HIDDEN)


def copy(layers):
    return [dl.LayerWeights(**{**vars(l), "key_cache": l.key_cache.clone(), "value_cache": l.value_cache.clone()})
            for l in layers]


def step(position, block_table, window=None):
    slot = int(block_table[position // BLOCK]) * BLOCK + position % BLOCK
    attn = dl._attention_metadata(position, slot, block_table, window)
    return slot, torch.tensor([position]), attn


@pytest.mark.parametrize("scale_bytes", [2, 4], ids=["float16 scales", "float32 scales"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("lookup", [True, False], ids=["embedding in C", "embedding given"])
def test_driver_equals_the_kernels_one_by_one_and_is_near_the_reference(cpu_isa, bits, window, lookup, scale_bytes):
    if not dl.available():
        pytest.skip("the C kernels are not built")
    if scale_bytes == 2 and not ia.half_scales_available():
        pytest.skip("this CPU has no F16C: its AVX2 build reads float32 scales only")
    shape, layers, final_norm, cos_sin, table = model(bits, scale_bytes=scale_bytes)
    assert all(w.scale_bytes == scale_bytes for w in (layers[0].qkv, layers[0].down, table))
    mine, theirs, reference = layers, copy(layers), copy(layers)
    driver = dl.DecodeLayers.build(shape, mine, final_norm, cos_sin, window, table if lookup else None)
    assert driver is not None
    block_table = torch.tensor([7, 2, 9, 0, 11, 4], dtype=torch.int32)
    for position, token in ((0, 0), (37, 17), (63, 39), (90, 5)):  # a first token, inside and at the end of blocks
        token_ids = torch.tensor([token])
        x = quantized_embedding(table, token_ids, torch.bfloat16)
        slot, positions, attn = step(position, block_table, window)
        assert driver.takes(token_ids, positions, attn)
        got = driver.run(token_ids, positions, attn, None if lookup else x.clone())
        want = dl.decode_layers_per_kernel(shape, theirs, final_norm, cos_sin, x, position, slot, block_table, window)
        ref = dl.decode_layers_ref(shape, reference, final_norm, cos_sin, x, position, slot, block_table, window)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), (got.float() - want.float()).abs().max()
        for a, b in zip(mine, theirs):
            assert torch.equal(a.key_cache, b.key_cache) and torch.equal(a.value_cache, b.value_cache)
        # Three layers of bfloat16 roundings apart (the references round where the kernels
        # do, but sum in other orders; a last-bit difference moves an int8 activation): a
        # few percent of the hidden state's norm (up to 4% seen).
        error = (got.float() - ref.float()).norm() / ref.float().norm()
        assert error < 0.08, error


def test_driver_reports_a_slot_outside_the_cache(cpu_isa):
    if not dl.available():
        pytest.skip("the C kernels are not built")
    shape, layers, final_norm, cos_sin, table = model(4)
    driver = dl.DecodeLayers.build(shape, layers, final_norm, cos_sin, embedding=table)
    _, positions, attn = step(5, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(IndexError, match="vocabulary"):
        driver.run(torch.tensor([VOCAB]), positions, attn)
    attn.slot_mapping = torch.tensor([BLOCKS * BLOCK])
    with pytest.raises(IndexError, match="slot"):
        driver.run(torch.tensor([1]), positions, attn)


def test_build_refuses_what_the_driver_does_not_run():
    shape, layers, final_norm, cos_sin, _ = model(4)
    f32 = [dl.LayerWeights(**{**vars(l), "key_cache": l.key_cache.float()}) for l in layers]
    assert dl.DecodeLayers.build(shape, f32, final_norm, cos_sin) is None
    narrow = dl.DecoderShape(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER + 32, 1e-5, 1.0)
    assert dl.DecodeLayers.build(narrow, layers, final_norm, cos_sin) is None
