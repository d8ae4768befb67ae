"""The native row attention (verispec.blockmm.attend, the blocks backend's attention): each row against exact float64
attention, and bit for bit the same whatever the other rows, the thread count, the instruction set and the way its
keys are laid out (the causal prefix, a gathered index, a batch's sequence)."""

from __future__ import annotations

import pytest
import torch

from verispec import blockmm
from verispec.backends.hf.invariant import row_keys
from verispec.backends.hf.row_attention import row_attention

pytestmark = pytest.mark.skipif(not blockmm.available(), reason=str(blockmm.why_unavailable()))



def tensors(heads=12, kv_heads=2, rows=9, dim=128, length=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, rows, dim, generator=g)
    # keys and values as a cache holds them: a view of a longer buffer
    k = (torch.randn(1, kv_heads, length + 20, dim, generator=g) * 2)[:, :, :length]
    v = torch.randn(1, kv_heads, length + 20, dim, generator=g)[:, :, :length]
    return q, k, v


def exact(q, k, v, counts):
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    out = torch.empty(1, q.shape[2], heads, dim, dtype=torch.float64)
    for r in range(q.shape[2]):
        n = int(counts[0, r])
        kk = k[0, :, :n].double().repeat_interleave(heads // kv_heads, 0)
        vv = v[0, :, :n].double().repeat_interleave(heads // kv_heads, 0)
        scores = q[0, :, r : r + 1].double() @ kk.transpose(1, 2) * dim ** -0.5
        out[0, r] = (torch.softmax(scores, -1) @ vv)[:, 0]
    return out


@pytest.mark.parametrize("dim", [40, 64, 128, 256])
def test_rows_match_exact_attention(dim):
    q, k, v = tensors(dim=dim)
    counts = torch.arange(300 - 9 + 1, 301)[None]
    out = blockmm.attend(q, k, v, counts)
    assert out.shape == (1, 9, 12, dim)
    assert (out.double() - exact(q, k, v, counts)).abs().max() < 2e-6


def test_a_row_is_the_same_bits_alone_among_others_on_any_threads_and_instruction_set():
    q, k, v = tensors()
    counts = torch.arange(292, 301)[None]
    full = blockmm.attend(q, k, v, counts)
    for width in (1, 2, 5):
        for start in range(0, 10 - width, 2):
            part = blockmm.attend(q[:, :, start : start + width], k, v, counts[:, start : start + width])
            assert torch.equal(part, full[:, start : start + width]), (width, start)
    for threads in (1, 2, 5, 16):  # one row: the heads of a KV head split among the threads in parts, same bits
        assert torch.equal(blockmm.attend(q[:, :, 4:5], k, v, counts[:, 4:5], threads=threads), full[:, 4:5])
    best = blockmm.best_isa()
    try:
        for isa in blockmm.ISAS:
            try:
                blockmm.set_isa(isa)
            except ValueError:
                continue  # not on this CPU
            for threads in (1, 2, 5):
                assert torch.equal(blockmm.attend(q, k, v, counts, threads=threads), full), (isa, threads)
    finally:
        blockmm.set_isa(best)


def test_gathered_keys_equal_the_same_keys_in_a_row():
    q, k, v = tensors(rows=4)
    # row i sees the first 250 keys, then every other one of the next 2i + 1 columns (the others are decoys)
    index = torch.zeros(1, 4, 260, dtype=torch.int32)
    counts = torch.zeros(1, 4, dtype=torch.int32)
    columns = [list(range(250)) + list(range(250, 251 + 2 * i, 2)) for i in range(4)]
    for i, cols in enumerate(columns):
        index[0, i, : len(cols)] = torch.tensor(cols)
        counts[0, i] = len(cols)
    gathered = blockmm.attend(q, k, v, counts, index=index)
    for i, cols in enumerate(columns):
        alone = blockmm.attend(q[:, :, i : i + 1], k[:, :, cols], v[:, :, cols], counts[:, i : i + 1])
        assert torch.equal(gathered[:, i], alone[:, 0])


def test_tree_and_batch_layouts_give_each_row_its_chains_bits():
    q, k, v = tensors(heads=6, kv_heads=3, rows=3, dim=64, length=40)
    chain = [row_attention(None, q[:, :, i : i + 1], k[:, :, : 38 + i], v[:, :, : 38 + i], None)[0] for i in range(3)]
    # a tree whose nodes sit at columns 37, 38, 39 but see only the context and node 37 (siblings)
    allowed = torch.zeros(1, 3, 40, dtype=torch.bool)
    allowed[:, :, :37] = True
    allowed[0, :, 37] = True
    allowed[0, 1, 38] = allowed[0, 2, 39] = True
    tree = row_attention(None, q, k, v, None, verispec_keys=row_keys(allowed))[0]
    assert torch.equal(tree[:, 0], chain[0][:, 0])
    sibling = blockmm.attend(q[:, :, 2:3], k[:, :, [*range(38), 39]], v[:, :, [*range(38), 39]],
                             torch.tensor([[39]]))
    assert torch.equal(tree[:, 2], sibling[:, 0])
    # a batch of two sequences of lengths 40 and 25 (the second padded), each row causal in its own
    kb, vb = torch.cat([k, k.flip(2)]), torch.cat([v, v.flip(2)])
    qb = torch.cat([q, q.flip(2)])
    batched = row_attention(None, qb, kb, vb, None, verispec_keys=row_keys(
        torch.stack([torch.arange(40)[None, :] <= torch.arange(37, 40)[:, None],
                     torch.arange(40)[None, :] <= torch.arange(22, 25)[:, None]])))[0]
    lone = row_attention(None, qb[1:], kb[1:, :, :25], vb[1:, :, :25], None)[0]
    assert torch.equal(batched[1], lone[0])
    assert torch.equal(batched[0, 2], chain[2][0, 0])


def test_bad_shapes_are_refused_by_name():
    q, k, v = tensors(rows=2)
    with pytest.raises(ValueError, match="shapes do not match"):
        blockmm.attend(q, k[:, :, :, :64], v, torch.tensor([[10, 11]]))
    with pytest.raises(ValueError, match="keys"):
        blockmm.attend(q, k, v, torch.tensor([[0, 11]]))
    with pytest.raises(ValueError, match="float32"):
        blockmm.attend(q.double(), k, v, torch.tensor([[10, 11]]))


def test_a_sliding_window_layer_sees_its_window_and_a_row_is_the_same_bits_at_every_width():
    """A sliding-window layer (transformers' ``module.sliding_window``; Gemma 3's): in one sequence's plain pass row i
    at position q sees the keys q - window + 1 .. q, with transformers' mask for it or none, against exact attention
    over those keys; a row is the bits of the one-token step at its position. A mask that is not the plain windowed
    one (a tree's) goes to SDPA."""
    from types import SimpleNamespace

    window, length = 6, 40
    q, k, v = tensors(heads=4, kv_heads=2, rows=9, dim=64, length=length, seed=3)
    layer = SimpleNamespace(sliding_window=window)
    positions = torch.arange(length - 9, length)
    seen = (torch.arange(length)[None] <= positions[:, None]) & (torch.arange(length)[None] > positions[:, None] - window)
    full, _ = row_attention(layer, q, k, v, seen[None, None])
    assert torch.equal(row_attention(layer, q, k, v, None)[0], full)  # transformers may leave the mask out
    for r, pos in enumerate(positions.tolist()):  # exact attention over the window
        keys = slice(pos - window + 1, pos + 1)
        want = exact(q[:, :, r : r + 1], k[:, :, keys], v[:, :, keys], torch.tensor([[window]]))
        assert (full[:, r : r + 1].double() - want).abs().max() < 2e-6, r
        step, _ = row_attention(layer, q[:, :, r : r + 1], k[:, :, : pos + 1], v[:, :, : pos + 1],
                                seen[r : r + 1, : pos + 1][None, None])
        assert torch.equal(step, full[:, r : r + 1]), r  # the one-token step at that position
    early = positions[:3] - 30  # rows whose window starts at key 0 see every earlier key
    few, _ = row_attention(layer, q[:, :, :3], k[:, :, : int(early[-1]) + 1], v[:, :, : int(early[-1]) + 1], None)
    assert (few.double() - exact(q[:, :, :3], k, v, (early + 1)[None])).abs().max() < 2e-6
    tree = seen.clone()
    tree[4, positions[3]] = False  # a row that does not see the one before it: not the plain windowed mask
    sdpa = SimpleNamespace(sliding_window=window, num_key_value_groups=2, is_causal=False, training=False)
    out, _ = row_attention(sdpa, q, k, v, tree[None, None])
    assert (out[:, 4] - full[:, 4]).abs().max() > 1e-4  # computed over other keys, by SDPA with the mask given
