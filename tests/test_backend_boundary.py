"""The target-backend boundary (verispec.backends.base): the transformers backend implements the protocol. That the
engine, verification, sampling, the audit and the drafters import no backend module is checked in test_layers.py."""

import torch

from verispec.backends.base import KVCache, TargetModel


def test_the_transformers_backend_implements_the_protocol(tiny_target):
    assert isinstance(tiny_target, TargetModel)
    kv = tiny_target.new_kv()
    assert isinstance(kv, KVCache) and len(kv) == 0
    ids = [3, 5, 7, 9, 11]
    full = tiny_target.forward(kv, ids, feature_layers=(0, 1))
    assert full.logits.shape == (5, tiny_target.vocab_size) and full.hidden.shape[:2] == (5, 2)
    kv.truncate(3)
    assert len(kv) == 3
    again = tiny_target.forward(kv, ids[3:], last_only=True)
    assert again.logits.shape == (1, tiny_target.vocab_size) and again.hidden is None
    torch.testing.assert_close(again.logits[0], full.logits[-1], atol=1e-5, rtol=1e-4)
    # a tree of two children of the pending token: each child row equals a chain pass over that child alone
    kv.truncate(3)
    tree = tiny_target.forward(kv, [ids[3], 20, 21], parents=[-1, -1]).logits
    for row, child in ((1, 20), (2, 21)):
        kv.truncate(3)
        chain = tiny_target.forward(kv, [ids[3], child]).logits
        torch.testing.assert_close(tree[row], chain[1], atol=1e-5, rtol=1e-4)
