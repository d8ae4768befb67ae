"""Width-invariant bfloat16 passes (verispec.backends.hf.invariant): a position's logits are the same bits whether it
is computed in a one-token step or as a row of a wide pass, so greedy speculation equals plain decoding in bfloat16.
The attention function is checked on any CPU; the whole model where this CPU packs bfloat16 linears (elsewhere the
model keeps SDPA, which is checked too)."""

import pytest
import torch

from tiny import ancestors, loaded, make_model
from verispec import NgramDrafter, SpeculativeDecoder
from verispec.backends.hf import invariant
from verispec.backends.torch_cpu.packing import PackedLinear, pack_linear_layers, packing_available

needs_bf16_packing = pytest.mark.skipif(not packing_available(torch.bfloat16),
                                        reason="this CPU cannot run oneDNN's packed bfloat16 kernel; "
                                               "test_a_model_without_packed_bfloat16_keeps_sdpa covers it")


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(invariant, "BUCKET", 8)  # passes cross bucket boundaries in a few tokens


def test_rows_are_grouped_by_the_bucket_of_their_position(small_buckets):
    # 13 cached + 6 new rows at positions 13..18: keys up to 16 for 13..15, up to 24 for 16..18
    assert invariant._groups(19, 6) == [(0, 3, 16), (3, 6, 24)]
    assert invariant._groups(1, 1) == [(0, 1, 8)]
    assert invariant._groups(8, 8) == [(0, 8, 8)]


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_sdpa(small_buckets, dtype):
    """On any CPU and dtype the function computes causal attention (grouped query heads, keys padded to buckets)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, cached, widest = 4, 2, 16, 11, 9
    q = torch.randn(1, heads, widest, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, cached + widest, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, cached + widest, dim, generator=gen).to(dtype)
    for width in range(1, widest + 1):
        out, _ = invariant.width_invariant_attention(None, q[:, :, :width], k[:, :, : cached + width],
                                                     v[:, :, : cached + width], None)
        mask = torch.ones(width, cached + width, dtype=torch.bool).tril(cached)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, :width], k[:, :, : cached + width],
                                                               v[:, :, : cached + width], attn_mask=mask,
                                                               enable_gqa=True).transpose(1, 2)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), width


@needs_bf16_packing
@torch.inference_mode()
def test_attention_rows_do_not_depend_on_the_pass_width_in_bfloat16(small_buckets):
    """Where the CPU passes the probe, the model's own shapes (3 query heads per KV head)."""
    if not invariant.kernels_are_width_invariant():
        pytest.skip("this CPU's kernels fail the width-invariance probe: bfloat16 passes keep SDPA here")
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, cached, widest = 6, 2, 16, 11, 9
    q = torch.randn(1, heads, widest, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, cached + widest, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, cached + widest, dim, generator=gen).to(dtype)
    alone = [invariant.width_invariant_attention(None, q[:, :, i : i + 1], k[:, :, : cached + i + 1],
                                                 v[:, :, : cached + i + 1], None)[0][0, 0] for i in range(widest)]
    for width in range(1, widest + 1):
        out, _ = invariant.width_invariant_attention(None, q[:, :, :width], k[:, :, : cached + width],
                                                     v[:, :, : cached + width], None)
        for i in range(width):
            assert torch.equal(out[0, i], alone[i]), (width, i)


def _bf16_target(seed=0):
    model = make_model(seed=seed, scale=0.3, layers=2).to(torch.bfloat16)
    pack_linear_layers(model)
    target = loaded(model)
    target.dtype = torch.bfloat16
    target.packed_layers = sum(isinstance(m, PackedLinear) for m in model.modules())
    target.width_invariant = invariant.make_width_invariant(model)
    return target


@needs_bf16_packing
@torch.inference_mode()
def test_a_bfloat16_models_rows_are_the_same_bits_at_every_width(small_buckets):
    target = _bf16_target()
    assert target.width_invariant and "width-invariant attention" in target.linear_kernel
    following = list(range(3, 20))
    for cached in (5, 13, 16):  # passes inside one bucket, across one, starting on one
        kv = target.new_kv()
        target.forward(kv, [3 + (i * 7) % 28 for i in range(cached)], last_only=True)
        chain = torch.stack([target.forward(kv, [t]).logits[0] for t in following])
        kv.truncate(cached)
        for width in (1, 2, 3, 5, 8, 9, 17):
            rows = target.forward(kv, following[:width]).logits
            kv.truncate(cached)
            assert torch.equal(rows, chain[:width]), (cached, width)


@needs_bf16_packing
def test_greedy_speculation_in_bfloat16_equals_plain_decoding(small_buckets):
    target = _bf16_target(seed=2)
    prompt = "w5 w9 w3 w5 w9 w3 w5 w9 w3 w5"
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=60)
    for k in (2, 5, 9):
        spec = SpeculativeDecoder(target, NgramDrafter(), k=k, k_policy="fixed").generate(prompt, max_new_tokens=60)
        assert spec.token_ids == plain.token_ids, k
        assert spec.stats.drafted > 0


def test_a_model_without_packed_bfloat16_keeps_sdpa():
    model = make_model(seed=0).to(torch.bfloat16)  # not packed: the one-row padding has nothing to act on
    assert not invariant.make_width_invariant(model)
    assert model.config._attn_implementation != invariant.WIDTH_INVARIANT_ATTENTION
    float32 = make_model(seed=0)
    pack_linear_layers(float32)
    assert not invariant.make_width_invariant(float32)  # float32 rows differ by ~1e-6 only; SDPA stays


@needs_bf16_packing
@torch.inference_mode()
def test_a_packed_linear_given_one_row_computes_it_as_a_product_of_two():
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    layer = PackedLinear(weight)
    x = torch.randn(1, 1, 24, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    layer.one_row_as_two = True
    pair = torch.ops.mkldnn._linear_pointwise(torch.cat([x, x], dim=1), layer._packed, None, "none", [], "")
    assert torch.equal(layer(x), pair[:, :1]) and layer(x).shape == (1, 1, 40)
    assert torch.equal(layer(x[0, 0]), pair[0, 0])  # a 1-D row too


@needs_bf16_packing
@torch.inference_mode()
def test_a_packed_linear_gives_each_row_the_same_bits_at_any_width():
    """Wider products than ``ROWS_AT_ONCE`` run as products of at most that many rows (oneDNN's kernel for wider ones
    rounds rows otherwise: AMX tiles on Sapphire Rapids), so a row's bits do not depend on the pass: 1 to 70 rows,
    rows at any place, a batch of sequences flattened or not."""
    gen = torch.Generator().manual_seed(0)
    layer = PackedLinear(torch.randn(576, 1536, generator=gen).to(torch.bfloat16))
    layer.one_row_as_two, layer.rows_at_once = True, invariant.ROWS_AT_ONCE
    x = torch.randn(1, 70, 1536, generator=gen).to(torch.bfloat16)
    alone = torch.cat([layer(x[:, i : i + 1]) for i in range(70)], dim=1)
    for w in (2, 31, 32, 33, 45, 64, 70):
        assert torch.equal(layer(x[:, :w]), alone[:, :w]), w
        assert torch.equal(layer(x[:, 70 - w :]), alone[:, 70 - w :]), w
    assert torch.equal(layer(x[0, :63].reshape(9, 7, 1536)), alone[0, :63].reshape(9, 7, 576))


@needs_bf16_packing
@torch.inference_mode()
def test_padded_batches_still_see_their_padding_mask():
    """train-eagle answers prompts in padded batches through the same bfloat16 model: those passes must keep
    transformers' padding mask (they take SDPA), or padded rows would attend to the padding."""
    target = _bf16_target(seed=4)
    assert target.width_invariant
    prompts = [[5, 9, 3, 5, 9, 4, 7, 12, 30, 7], [12, 30, 7]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = target.model(input_ids=ids, attention_mask=mask).logits
    target.model.set_attn_implementation("sdpa")  # transformers' own path for the same padded batch
    assert torch.equal(batch, target.model(input_ids=ids, attention_mask=mask).logits)


def test_row_keys_lay_each_row_out_as_its_own_chain(small_buckets):
    # a tree after 6 cached tokens: the pending token (column 6) and nodes 0..2 (columns 7..9), node 2 under node 0
    allowed = torch.zeros(1, 4, 10, dtype=torch.bool)
    allowed[0, :, :7] = True
    allowed[0, 1, 7] = allowed[0, 2, 8] = allowed[0, 3, 7] = allowed[0, 3, 9] = True
    rows = invariant.row_keys(allowed)
    assert rows.lengths is None
    # positions 6, 7, 7, 8: rows 0-2 in the bucket of 8 keys, row 3 in the bucket of 16; column 10 is the zero key
    (eight, b, i, index, hidden), (sixteen, b3, i3, index3, hidden3) = rows.groups
    assert (eight, b.tolist(), i.tolist(), sixteen, b3.tolist(), i3.tolist()) == (8, [0, 0, 0], [0, 1, 2], 16, [0], [3])
    assert index.tolist() == [[0, 1, 2, 3, 4, 5, 6, 10], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 8]]
    assert hidden.sum(-1).tolist() == [1, 0, 0]
    assert index3.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 9] + [10] * 7] and hidden3.sum().item() == 7
    # rows of a batch, each sequence causal at its own length: no gathering, each sequence's key length
    lengths = torch.tensor([5, 9])
    columns = torch.arange(10)
    batch = columns[None, None, :] <= (lengths[:, None] - 3 + torch.arange(3))[:, :, None]
    assert invariant.row_keys(batch) == invariant.RowKeys((), (5, 9))


@needs_bf16_packing
@torch.inference_mode()
def test_a_token_trees_rows_are_the_same_bits_as_each_nodes_own_chain(small_buckets):
    """A tree pass gathers each node's keys (the context, then its ancestors) into the layout of a plain pass at
    the node's depth: its logits are those of the one-token steps along its branch, bit for bit."""
    target = _bf16_target(seed=5)
    parents = [-1, -1, -1, 0, 0, 1, 3, 3, 6, 8, 9]  # depth 6, branching at the root and at depths 1 and 3
    nodes = [7, 11, 4, 9, 21, 13, 5, 17, 8, 30, 12]
    for cached in (4, 6, 13):  # the tree inside one bucket, across one, starting on one
        prompt = [3 + (i * 5) % 29 for i in range(cached)]
        kv = target.new_kv()
        target.forward(kv, prompt, last_only=True)
        for fed in ([22], [22, 6, 19]):  # the pending token alone, or accepted tokens fed again before the tree
            tree = target.forward(kv, fed + nodes, parents=parents).logits
            kv.truncate(cached)
            for node in range(len(parents)):
                chain = [target.forward(kv, [t]).logits[0] for t in fed + [nodes[j] for j in ancestors(parents, node)]]
                kv.truncate(cached)
                assert torch.equal(tree[len(fed) + node], chain[-1]), (cached, fed, node)
            assert torch.equal(tree[: len(fed)], torch.stack(chain[: len(fed)]))


@needs_bf16_packing
@torch.inference_mode()
def test_the_rows_of_a_batched_pass_are_the_same_bits_as_each_sequence_alone(small_buckets):
    target = _bf16_target(seed=6)
    prompts = [[3 + (i * 7) % 28 for i in range(n)] for n in (5, 14, 9)]
    fed = [[4, 8, 15], [16], [23, 2]]
    alone = []
    for prompt, tokens in zip(prompts, fed):
        kv = target.new_kv()
        target.forward(kv, prompt, last_only=True)
        alone.append(target.forward(kv, tokens).logits)
    group = target.new_kv_group(len(prompts))
    kvs = [group.new_kv() for _ in prompts]
    target.forward_batch(list(zip(kvs, prompts)), last_only=True)
    passes = target.forward_batch(list(zip(kvs, fed)))
    for i, (got, want) in enumerate(zip(passes, alone)):
        assert torch.equal(got.logits, want), i
