import pytest
import torch

from kvyard.disagg.blocks import gather_blocks
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVIntegrityError, KVPayload, check_payload
from tests.disagg.conftest import BLOCK, Offer


def payload_of(caches, layout: KVLayout, offer: Offer) -> KVPayload:
    tensors = gather_blocks(caches, offer.block_ids, BLOCK)
    return KVPayload(offer.tid, layout, offer.hashes, offer.tokens, tensors,
                     sum(t.nbytes for layer in tensors for t in layer))


def test_a_matching_payload_passes(caches, layout):
    offer = Offer("t", [1, 2])
    check_payload(payload_of(caches, layout, offer), layout, offer.hashes)


def test_layout_mismatch_is_listed(caches, layout):
    offer = Offer("t", [1, 2])
    other = KVLayout(layout.num_layers, 4, layout.head_dim, 8, layout.dtype, False)
    with pytest.raises(KVIntegrityError, match="num_kv_heads: expected 4, got 2; block_size: expected 8, got 4"):
        check_payload(payload_of(caches, layout, offer), other, offer.hashes)


def test_other_hashes_are_refused(caches, layout):
    offer = Offer("t", [1, 2])
    with pytest.raises(KVIntegrityError, match="block 0 hash .* differs"):
        check_payload(payload_of(caches, layout, offer), layout, Offer("u", [1, 2], seed=5).hashes)
    with pytest.raises(KVIntegrityError, match="2 blocks offered, 1 expected"):
        check_payload(payload_of(caches, layout, offer), layout, offer.hashes[:1])


@pytest.mark.parametrize("damage,match", [
    (lambda p: p.tensors.pop(), "2 layers of KV, expected 3"),
    (lambda p: p.tensors[1].pop(), "layer 1 has 1 tensors, expected 2"),
    (lambda p: p.tensors[2].__setitem__(0, p.tensors[2][0].float()), "layer 2 tensor 0 is torch.float32"),
    (lambda p: p.tensors[0].__setitem__(1, p.tensors[0][1][:-1]), r"layer 0 tensor 1 is .* \(7, 2, 8\)"),
    (lambda p: p.token_ids.pop(), "7 token ids for 2 blocks of 4"),
    (lambda p: setattr(p, "nbytes", 1), "payload says 1"),
])
def test_damaged_payloads_are_refused(caches, layout, damage, match):
    offer = Offer("t", [1, 2])
    p = payload_of(caches, layout, offer)
    damage(p)
    with pytest.raises(KVIntegrityError, match=match):
        check_payload(p, layout, offer.hashes)


def test_non_contiguous_tensors_are_refused(caches, layout):
    offer = Offer("t", [1, 2])
    p = payload_of(caches, layout, offer)
    k = p.tensors[0][0]
    p.tensors[0][0] = torch.empty(k.shape[0], k.shape[2], k.shape[1], dtype=k.dtype).transpose(1, 2)
    with pytest.raises(KVIntegrityError, match="not contiguous"):
        check_payload(p, layout, offer.hashes)
