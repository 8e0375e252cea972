import pytest
import torch

from kvyard.disagg.blocks import gather_blocks, layer_tensors, pack_blocks, scatter_blocks
from kvyard.disagg.layout import KVLayout
from kvyard.engine.kv_cache import bytes_per_block
from kvyard.models.config import ModelConfig
from kvyard.offload.codec import decode_block, encode_block
from tests.disagg.conftest import BLOCK, make_caches


@pytest.mark.parametrize("dtype,int8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_gather_scatter_round_trip_is_bit_exact(dtype, int8):
    src, dst = make_caches(dtype, int8), make_caches(dtype, int8, num_blocks=10)
    for c in dst:
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                t.zero_()
    ids = [7, 2, 11]
    got = gather_blocks(src, ids, BLOCK)
    assert len(got) == 3 and len(got[0]) == (4 if int8 else 2)
    assert all(t.is_contiguous() and t.shape[0] == len(ids) * BLOCK for layer in got for t in layer)
    scatter_blocks(dst, [5, 0, 9], BLOCK, got)
    for s, d in zip(src, dst, strict=True):
        for a, b in ((s.k, d.k), (s.v, d.v), (s.k_scale, d.k_scale), (s.v_scale, d.v_scale)):
            if a is None:
                continue
            for i, j in ((7, 5), (2, 0), (11, 9)):
                assert torch.equal(a[i * BLOCK : (i + 1) * BLOCK], b[j * BLOCK : (j + 1) * BLOCK])
            assert not b[BLOCK : 2 * BLOCK].any()  # untouched blocks stay untouched
    # int8: values and scales move as stored, so the dequantized KV reads back the same
    slots = torch.arange(BLOCK)
    assert torch.equal(src[0].read_slots(slots + 7 * BLOCK, dtype)[0], dst[0].read_slots(slots + 5 * BLOCK, dtype)[0])


@pytest.mark.parametrize("dtype,int8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_packed_rows_are_each_blocks_bytes_as_a_tier_stores_them(dtype, int8):
    """pack_blocks gives every block its own row of bytes: the same bytes as that block's gathered tensors,
    which a tier's codec turns back into the same tensors (int8 scales are narrower rows than the values)."""
    src, ids = make_caches(dtype, int8), [7, 2, 11, 3]
    packed = pack_blocks([layer_tensors(c) for c in src], ids, BLOCK)
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and packed.shape[0] == len(ids)
    layout = [[(tuple(t[:BLOCK].shape), t.dtype) for t in layer_tensors(c)] for c in src]
    for row, block_id in enumerate(ids):
        one = gather_blocks(src, [block_id], BLOCK)
        assert torch.equal(packed[row], torch.cat([t.view(torch.uint8).reshape(-1) for layer in one for t in layer]))
        tokens = tuple(range(row, row + BLOCK))
        back = decode_block(encode_block(tokens, packed[row]), tokens, layout)
        assert back is not None
        assert all(torch.equal(a, b) for la, lb in zip(one, back, strict=True) for a, b in zip(la, lb, strict=True))


def test_scatter_refuses_wrong_tensor_count():
    caches = make_caches()
    with pytest.raises(ValueError, match="tensors per layer"):
        scatter_blocks(caches, [0], BLOCK, [[caches[0].k[:BLOCK]]] * 3)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_layout_matches_the_engine_sizes(kv_dtype):
    cfg = ModelConfig("llama", 100, 64, 128, 3, 4, 2, 8, 1e-5, 1e4, 128, False, False, False)
    caches = make_caches(torch.bfloat16, kv_dtype == "int8", layers=3, heads=2, dim=8)
    layout = KVLayout.of(caches, BLOCK)
    assert layout.dtype == ("int8" if kv_dtype == "int8" else "bfloat16") and layout.quantized == (kv_dtype == "int8")
    assert layout.block_nbytes() == bytes_per_block(cfg, BLOCK, torch.bfloat16, kv_dtype)


def test_layout_mismatches_name_each_field():
    a = KVLayout(30, 3, 64, 16, "bfloat16", False)
    assert a.mismatches(a) == []
    diffs = a.mismatches(KVLayout(30, 3, 64, 32, "int8", True))
    assert diffs == ["block_size: expected 16, got 32", "dtype: expected 'bfloat16', got 'int8'",
                     "quantized: expected False, got True"]


def test_layout_tells_key_smoothings_apart():
    """Two workers fit their key smoothing on their own; blocks written under other factors must be refused."""
    a, b = make_caches(torch.bfloat16, True, layers=2), make_caches(torch.bfloat16, True, layers=2)
    assert KVLayout.of(a, BLOCK).key_smoothing == ""
    factors = torch.ones(6, 8)
    for c in a:
        c.key_smoothing = factors
    for c in b:
        c.key_smoothing = factors.clone()
    assert KVLayout.of(a, BLOCK).mismatches(KVLayout.of(b, BLOCK)) == []
    b[1].key_smoothing = factors * 2
    diffs = KVLayout.of(a, BLOCK).mismatches(KVLayout.of(b, BLOCK))
    assert len(diffs) == 1 and diffs[0].startswith("key_smoothing: expected")
