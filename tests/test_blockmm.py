"""The native block kernel (verispec.blockmm) against its PyTorch reference: every block type, M = 1..64, bit for bit;
rows invariant to M, to the other rows, to the thread count and to the instruction set; the block layouts against
gguf's own dequantization."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from verispec import blockmm
from verispec.blockmm import reference
from verispec.blockmm.formats import TYPES

pytestmark = pytest.mark.skipif(not blockmm.available(), reason=str(blockmm.why_unavailable()))

# where each type keeps its float16 factors (the rest of a block is integers: any byte is valid)
def test_the_one_row_paths_at_the_integers_extremes_give_the_same_bits():
    """Q6_K's one-row paths multiply its unsigned values (q = w + 32, up to 63) and take the offset back through the
    activations' sums per 16: at the extremes (every q 63 or 0, sub-scales -128 and 127, every activation +-127 after
    quantization) no intermediate saturates, so every instruction set gives the reference's bits."""
    K, rows = 512, 6
    raw = random_blocks("Q6_K", rows, K, seed=41).numpy().reshape(rows, K // 256, 210).copy()
    raw[0:3, :, :192] = 0xFF  # q = 63 everywhere
    raw[3:6, :, :192] = 0x00  # q = 0 (w = -32) everywhere
    raw[::2, :, 192:208] = np.uint8(0x80)  # sub-scales -128
    raw[1::2, :, 192:208] = np.uint8(127)
    raw = torch.from_numpy(raw.reshape(rows, -1))
    x = torch.ones(2, K) * 3.0
    x[1, ::2] = -3.0  # +-127 after quantization
    want = reference.matmul(x, raw, "Q6_K")
    before, best = blockmm.one_row_limits()["Q6_K"], blockmm.best_isa()
    try:
        for name in blockmm.isas()[1:]:
            blockmm.set_isa(name)
            for limit in (0, 2):
                blockmm.set_one_row_limit("Q6_K", limit)
                for M in (1, 2):
                    assert torch.equal(blockmm.matmul(x[:M], raw, "Q6_K"), want[:M]), (name, limit, M)
    finally:
        blockmm.set_one_row_limit("Q6_K", before)
        blockmm.set_isa(best)


HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Valid random blocks: random integers and sub-scales, float16 factors of realistic size and either sign."""
    t = TYPES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, columns // t.weights, t.bytes), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = (rng.uniform(0.002, 0.05, size=raw.shape[:2]) * rng.choice([-1, 1], size=raw.shape[:2]))
        raw[..., at:at + 2] = halves.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def at_extremes(raw: torch.Tensor, kind: str, rows: slice) -> torch.Tensor:
    """A copy of ``raw`` whose ``rows`` hold bytes of all ones (every integer and sub-scale at its largest) but for
    their float16 factors."""
    factors = torch.isin(torch.arange(raw.shape[1]) % TYPES[kind].bytes,
                         torch.tensor([at + i for at in HALVES[kind] for i in (0, 1)]))
    extreme = raw.clone()
    extreme[rows] = torch.where(factors, raw[rows], torch.full_like(raw[rows], 0xFF))
    return extreme


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 3
    x[:, 5] = 0.0  # a zero inside a chunk
    if M > 2:
        x[1, :32] = 0.0  # a whole chunk of zeros (d = 0)
        x[2, 40] = 1e4  # an outlier
    return x


@pytest.mark.parametrize("kind", list(TYPES))
def test_layouts_match_gguf(kind):
    """The reference reads each block type as gguf (llama.cpp's Python package) dequantizes it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(kind, 6, 512)
    ours = reference.dequantize(raw, kind, 512)
    theirs = dequantize(raw.numpy(), GGMLQuantizationType[kind]).reshape(6, 512)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", list(TYPES))
def test_kernel_equals_reference_bit_for_bit(kind):
    # K: several groups, and for the 32-weight types a tail group of two blocks (576 = 2 * 256 + 2 * 32, SmolLM2's
    # width); N not a multiple of the kernel's 4-row tiles
    K = 576 if TYPES[kind].weights == 32 else 512
    raw = random_blocks(kind, 22, K, seed=3)
    x = activations(64, K)
    want = reference.matmul(x, raw, kind)
    for M in (1, 2, 3, 7, 8, 9, 16, 17, 33, 64):
        got = blockmm.matmul(x[:M], raw, kind)
        assert torch.equal(got, want[:M]), (kind, M, (got - want[:M]).abs().max())


@pytest.mark.parametrize("kind", list(TYPES))
def test_rows_handed_out_in_runs_give_the_same_bits(kind):
    """Past the one-row paths a call hands out its weight rows in runs as threads free up (``set_row_chunks``): any
    number of runs, or one fixed share a thread, gives the reference's bits on any thread count (the 16-row layout's
    test runs the default, one 16-row run at a time)."""
    K = 512
    raw = random_blocks(kind, 77, K, seed=3)
    x = activations(33, K, seed=4)
    want = reference.matmul(x, raw, kind)
    before = blockmm.row_chunks()
    try:
        for chunks in (0, 1, 3, 64):
            blockmm.set_row_chunks(chunks)
            assert blockmm.row_chunks() == chunks
            for M in (3, 8, 17, 33):
                for threads in (2, 3):
                    got = blockmm.matmul(x[:M], raw, kind, threads=threads)
                    assert torch.equal(got, want[:M]), (chunks, M, threads)
        with pytest.raises(ValueError, match="row chunks must be 0..64"):
            blockmm.set_row_chunks(65)
    finally:
        blockmm.set_row_chunks(before)


@pytest.mark.parametrize("kind", list(TYPES))
def test_rows_invariant(kind):
    """Row i is the same bits alone, among 64 rows, after other rows, with any thread count and instruction set."""
    K = 512
    raw = random_blocks(kind, 37, K, seed=5)
    x = activations(64, K, seed=7)
    full = blockmm.matmul(x, raw, kind)
    for i in (0, 1, 2, 31, 63):
        assert torch.equal(blockmm.matmul(x[i:i + 1], raw, kind), full[i:i + 1])
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(blockmm.matmul(x[shuffled], raw, kind), full[shuffled])
    for threads in (1, 2, 3, 5):
        assert torch.equal(blockmm.matmul(x, raw, kind, threads=threads), full)
    best = blockmm.best_isa()
    try:
        for name in blockmm.ISAS:
            try:
                blockmm.set_isa(name)
            except ValueError:
                continue  # not on this CPU
            assert torch.equal(blockmm.matmul(x[:9], raw, kind), full[:9]), name
    finally:
        blockmm.set_isa(best)


@pytest.mark.parametrize("kind", list(TYPES))
def test_the_one_row_path_and_the_others_give_the_same_bits(kind):
    """One row up to one past the one-weight-row path's most (K types 2, 32-weight types 16) on that path or on the
    tiles / buffered path (what ``choose_paths`` picks between per CPU): the reference's bits, on every instruction set
    this CPU has (K: a tail group for 32-weight types)."""
    K = 576 if TYPES[kind].weights == 32 else 512
    raw = random_blocks(kind, 23, K, seed=11)
    x = activations(blockmm.ONE_ROW_MOST[kind] + 1, K, seed=13)
    want = reference.matmul(x, raw, kind)
    before, best, ahead = blockmm.one_row_limits()[kind], blockmm.best_isa(), blockmm.prefetch()
    try:
        for name in blockmm.ISAS[1:]:
            try:
                blockmm.set_isa(name)
            except ValueError:
                continue
            for limit in range(blockmm.ONE_ROW_MOST[kind] + 1):
                blockmm.set_one_row_limit(kind, limit)
                assert blockmm.one_row_limits()[kind] == limit
                for nbytes in {0, 64, *blockmm.PREFETCH_CANDIDATES}:  # requesting weights ahead changes no bit
                    blockmm.set_prefetch(nbytes)
                    for rows in range(1, len(x) + 1):
                        assert torch.equal(blockmm.matmul(x[:rows], raw, kind), want[:rows]), (name, limit, nbytes, rows)
    finally:
        blockmm.set_one_row_limit(kind, before)
        blockmm.set_isa(best)
        blockmm.set_prefetch(ahead)


def test_q6k_wide_passes_give_the_same_bits_on_the_tiles_and_the_buffered_path():
    K = 512
    raw = random_blocks("Q6_K", 23, K, seed=17)
    x = activations(19, K, seed=19)
    want = reference.matmul(x, raw, "Q6_K")
    before = blockmm.q6k_tiles()
    try:
        for on in (True, False):
            blockmm.set_q6k_tiles(on)
            assert blockmm.q6k_tiles() is on
            for M in (3, 4, 8, 9, 19):
                assert torch.equal(blockmm.matmul(x[:M], raw, "Q6_K"), want[:M]), (on, M)
    finally:
        blockmm.set_q6k_tiles(before)


@pytest.mark.skipif(blockmm.available() and blockmm.best_isa() != "avx512vnni",
                    reason="the 16-row tiles are AVX-512 VNNI code; this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("kind", blockmm.K_TYPES)
def test_the_16_row_tiles_give_the_reference_bits_and_keep_rows_invariant(kind):
    """The 16-row tiles (``set_wide16``): widths from 2 to 40 rows against the reference, over 53 weight rows (three
    tiles and a rest on the fused tiles) and three super-blocks, at the integers' extremes too (weights of all ones
    bits, activations at the quantization's bounds), on 1 to 3 threads: the same bits as the other paths."""
    K = 768
    raw = random_blocks(kind, 53, K, seed=23)
    x = activations(40, K, seed=29)
    x[3] = torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)  # every value at +-127 after quantization
    extreme = at_extremes(raw, kind, slice(0, 16))  # the first tile
    before, wide, narrow = blockmm.wide16_rows()[kind], blockmm.wide_isa(), blockmm.narrow_isa()
    try:
        blockmm.set_wide_isa("vnni256")  # the tiles are AVX-512 code whatever set the widths have otherwise
        blockmm.set_narrow_isa("vnni256")
        for blocks in (raw, extreme):
            want = reference.matmul(x, blocks, kind)
            for limit in (2, 0):
                blockmm.set_wide16(limit, kind)
                named = f"16-row tiles for {kind} from 2 rows" in blockmm.paths_in_use([kind])
                assert named == (limit == 2)
                for M in (2, 3, 4, 7, 8, 9, 13, 16, 22, 33, 40):  # past 8: tiles of up to 8 rows in turn
                    for threads in (1, 2, 3):
                        got = blockmm.matmul(x[:M], blocks, kind, threads=threads)
                        assert torch.equal(got, want[:M]), (limit, M, threads, (got - want[:M]).abs().max())
        blockmm.set_wide16(2, kind)
        blockmm.set_isa(blockmm.best_isa())  # every width on one set: the tiles off too
        assert blockmm.wide16_rows()[kind] == 0
    finally:
        blockmm.set_wide16(before, kind)
        blockmm.set_wide_isa(wide)
        blockmm.set_narrow_isa(narrow)


@pytest.mark.parametrize("kind", list(TYPES))
def test_the_16_row_layout_gives_the_reference_bits_at_every_width_and_packs_back(kind):
    """``pack16``: 48 weight rows (three tiles) laid out 16 rows at a time and multiplied at 1 to 40 rows on 1 to 3
    threads (``Matrix(..., packed=True)``, every width on the 16-row tiles whatever the other settings: AVX-512 VNNI's
    for every type, 256-bit ones for the 32-weight types and Q4_K on AVX2) and three prefetch distances, the integers
    at their extremes too: the reference's bits; unpacking gives the file's bytes back. Three K-type super-blocks a
    row; 27 blocks of a 32-weight type (three groups of eight float lanes, the last of three)."""
    if not blockmm.can_pack16(kind, 16):
        pytest.skip(f"this CPU (best set {blockmm.best_isa()}) has no code that reads {kind} in the 16-row layout")
    K = 768 if kind in blockmm.K_TYPES else 27 * 32
    raw = random_blocks(kind, 48, K, seed=31)
    x = activations(40, K, seed=37)
    x[5] = torch.where(torch.arange(K) % 3 == 0, 1.0, -1.0)  # every value at +-127 after quantization
    extreme = at_extremes(raw, kind, slice(16, 32))  # the second tile
    with kernel_settings_restored():
        blockmm.set_wide16(0)  # the file's layout elsewhere: the packed matrix takes its tiles anyway
        for blocks in (raw, extreme):
            want = reference.matmul(x, blocks, kind)
            packed = blocks.clone()
            blockmm.pack16(packed, kind)
            assert not torch.equal(packed, blocks)
            matrix = blockmm.Matrix(packed, kind, K, packed=True)
            try:  # each thread count at another prefetch distance of the layout's readers (0: none)
                for threads, ahead in ((1, blockmm.PACKED_PREFETCH), (2, 0), (3, 2048)):
                    blockmm.set_threads(threads)
                    blockmm.set_packed_prefetch(ahead)
                    for M in (1, 2, 3, 4, 5, 8, 9, 16, 25, 40):
                        got = matrix(x[:M])
                        assert torch.equal(got, want[:M]), (M, threads, (got - want[:M]).abs().max())
            finally:
                blockmm.set_threads(None)
            blockmm.pack16(packed, kind, unpack=True)
            assert torch.equal(packed, blocks)


def test_the_16_row_layout_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        blockmm.Matrix(random_blocks("Q4_K", 40, 256), "Q4_K", 256, packed=True)
    with pytest.raises(ValueError, match="cannot be read in the 16-row layout|multiple of 16 rows"):
        blockmm.Matrix(random_blocks("Q8_0", 24, 256), "Q8_0", 256, packed=True)
    with pytest.raises(ValueError, match="takes the block types Q4_0"):
        blockmm.set_pack16_kinds(["Q3_K"])
    if blockmm.best_isa() != "avx512vnni":
        with pytest.raises((ValueError, RuntimeError), match="AVX-512 VNNI"):
            blockmm.pack16(random_blocks("Q6_K", 32, 256), "Q6_K")
        with pytest.raises(ValueError, match="Q6_K is read by AVX-512 VNNI code"):
            blockmm.set_pack16_kinds(["Q4_K", "Q6_K", "Q4_0"])
        with pytest.raises(ValueError, match="Q5_K / Q6_K need AVX-512 VNNI"):
            blockmm.Matrix(random_blocks("Q5_K", 32, 256), "Q5_K", 256, packed=True)
    else:
        with pytest.raises(ValueError, match="multiple of 16 rows"):
            blockmm.pack16(random_blocks("Q4_K", 40, 256), "Q4_K")


def test_the_instruction_sets_this_cpu_runs_are_a_prefix_of_the_list_up_to_its_best():
    names = blockmm.isas()
    assert names == blockmm.ISAS[:len(names)] and names[-1] == blockmm.best_isa() and names[0] == "scalar"
    for name in blockmm.ISAS[len(names):]:  # the sets above the best are refused with the reason
        with pytest.raises(ValueError, match=f"instruction set {name} is not available on this CPU"):
            blockmm.set_isa(name)


@pytest.mark.parametrize("kind", list(TYPES))
def test_wide_passes_on_another_instruction_set_give_the_same_bits(kind):
    """Products of 3 or more rows on another instruction set than the narrow ones (``set_wide_isa``, what
    ``choose_paths`` picks on AVX-512 CPUs): the reference's bits at every width, the narrow ones untouched; and
    ``set_isa`` puts every width back on one set."""
    K = 512
    raw = random_blocks(kind, 29, K, seed=23)
    x = activations(17, K, seed=29)
    want = reference.matmul(x, raw, kind)
    best = blockmm.best_isa()
    names = blockmm.isas()  # every set this CPU runs
    try:
        for narrow in names:
            for wide in names:
                blockmm.set_isa(narrow)
                blockmm.set_wide_isa(wide)
                assert (blockmm.isa(), blockmm.wide_isa()) == (narrow, wide)
                assert (f"{wide} past 2 rows" in blockmm.paths_in_use([kind])) == (wide != narrow)
                for M in (1, 2, 3, 4, 8, 9, 17):
                    assert torch.equal(blockmm.matmul(x[:M], raw, kind), want[:M]), (narrow, wide, M)
        blockmm.set_isa(best)
        assert blockmm.wide_isa() == best
    finally:
        blockmm.set_isa(best)
    with pytest.raises(ValueError, match="not available on this CPU"):
        blockmm.set_wide_isa("nonsense")


@pytest.mark.parametrize("kind", list(TYPES))
def test_narrow_passes_on_another_instruction_set_give_the_same_bits(kind):
    """Products of 1 or 2 rows on another instruction set than the rest (``set_narrow_isa``, what ``choose_paths``
    picks on AVX-512 CPUs): the reference's bits at every width; ``set_isa`` puts every width back on one set."""
    K = 512
    raw = random_blocks(kind, 29, K, seed=31)
    x = activations(9, K, seed=37)
    want = reference.matmul(x, raw, kind)
    best = blockmm.best_isa()
    names = blockmm.isas()
    try:
        for narrow in names:
            for wide in names:
                blockmm.set_isa(best)
                blockmm.set_narrow_isa(narrow)
                blockmm.set_wide_isa(wide)
                assert (blockmm.isa(), blockmm.narrow_isa(), blockmm.wide_isa()) == (best, narrow, wide)
                assert (f"{narrow} at 1-2 rows" in blockmm.paths_in_use([kind])) == (narrow != best)
                for M in (1, 2, 3, 9):
                    assert torch.equal(blockmm.matmul(x[:M], raw, kind), want[:M]), (narrow, wide, M)
        blockmm.set_isa(best)
        assert blockmm.narrow_isa() == best == blockmm.wide_isa()
    finally:
        blockmm.set_isa(best)
    with pytest.raises(ValueError, match="not available on this CPU"):
        blockmm.set_narrow_isa("nonsense")


def test_the_kernel_string_names_a_prefetch_distance_other_than_the_default():
    """``verispec costs`` and ``bench`` name the kernel's paths: a distance choose_paths moved off the default is
    named, the default is not."""
    ahead, limit = blockmm.prefetch(), blockmm.one_row_limits()["Q4_K"]
    try:
        blockmm.set_one_row_limit("Q4_K", 1)
        for nbytes, named in ((blockmm.PREFETCH, None), (2048, "prefetching 2048 B ahead"), (0, "no prefetching")):
            blockmm.set_prefetch(nbytes)
            words = blockmm.paths_in_use(["Q4_K"])
            assert "one-row path for Q4_K" in words
            assert (not any("prefetch" in w for w in words)) if named is None else named in words, (nbytes, words)
    finally:
        blockmm.set_prefetch(ahead)
        blockmm.set_one_row_limit("Q4_K", limit)


def test_link_names_the_matrix_that_follows_in_memory_and_wraps_around():
    """Each matrix fetches ahead for the one whose blocks start first at or after its end (the blocks backend lays a
    model's matrices out in the order its layers run); joined siblings at one address count as the largest."""
    row_bytes = TYPES["Q4_0"].bytes * 2
    buffer = blockmm.weight_buffer(4 * 8192)
    a, b, c = (buffer[at: at + 16 * row_bytes].view(16, row_bytes) for at in (0, 8192, 16384))
    joined = buffer[8192: 8192 + 32 * row_bytes].view(32, row_bytes)  # b and the rows after it, as one product
    ma, mb, mc, mj = (blockmm.Matrix(blocks, "Q4_0", 64) for blocks in (a, b, c, joined))
    assert blockmm.link([ma, mb, mc, mj]) == 4
    assert ma._next == (joined.data_ptr(), 32, row_bytes)  # the joined product, not its first member
    assert mb._next == mj._next == (c.data_ptr(), 16, row_bytes)
    assert mc._next == (a.data_ptr(), 16, row_bytes)  # after the last: the first (the next pass starts there)
    assert blockmm.link([ma]) == 0 and ma._next[0] == joined.data_ptr()  # one matrix alone: left as it was


def test_fetching_ahead_between_products_changes_no_bit():
    """The look-ahead only asks for memory: every setting gives the products' bits, on two threads, one row or many."""
    before = blockmm.lookahead()
    assert before[0] > 0  # on by default
    w1, w2 = random_blocks("Q4_K", 96, 512, seed=3), random_blocks("Q6_K", 64, 512, seed=4)
    m1, m2 = blockmm.Matrix(w1, "Q4_K", 512), blockmm.Matrix(w2, "Q6_K", 512)
    blockmm.link([m1, m2])
    try:
        outs = []
        for own, other in ((0, 0), (1 << 20, 0), (1 << 16, 1 << 16)):
            blockmm.set_lookahead(own, other)
            assert blockmm.lookahead() == (own, other)
            named = any("next matrix fetched" in words for words in blockmm.paths_in_use(["Q4_K"]))
            assert named == bool(own)  # the kernel string that bench and costs record says whether it was on
            with blockmm.threads_held():
                blockmm.set_threads(2)
                outs.append([m(activations(M, 512)) for M in (1, 5) for m in (m1, m2, m1)])
                blockmm.set_threads(None)
        assert all(torch.equal(x, y) for other in outs[1:] for x, y in zip(outs[0], other))
        with pytest.raises(ValueError, match="lookahead own must be"):
            blockmm.set_lookahead(-1)
    finally:
        blockmm.set_lookahead(*before)


@contextlib.contextmanager
def kernel_settings_restored():
    """What ``choose_paths`` sets (instruction sets, one-row limits, Q6_K tiles, prefetch, AMX, the 16-row tiles and
    layout) put back after."""
    before, q6k_before, ahead = blockmm.one_row_limits(), blockmm.q6k_tiles(), blockmm.prefetch()
    rows16, packed, packed_ahead = blockmm.wide16_rows(), blockmm.pack16_kinds(), blockmm.packed_prefetch()
    try:
        yield
    finally:
        blockmm.set_isa(blockmm.best_isa())
        blockmm.set_pack16_kinds(packed)
        for kind, rows in before.items():
            blockmm.set_one_row_limit(kind, rows)
        for kind, rows in rows16.items():
            blockmm.set_wide16(rows, kind)
        blockmm.set_q6k_tiles(q6k_before)
        blockmm.set_prefetch(ahead)
        blockmm.set_packed_prefetch(packed_ahead)
        blockmm.set_threads(None)
        if blockmm.amx_usable():
            blockmm.set_amx_rows(0)


def test_choose_paths_compares_the_one_row_path_at_the_prefetch_distance_it_keeps(monkeypatch):
    """The one-row paths are timed against the others on the narrow instruction set and at the distance kept (timed at
    the default first, Q4_K's one-row path lost to its tiles on a Sapphire Rapids and one-token passes ran ~20%
    slower); the one-row limits of types without matrices here (another model's choice) are left as they were."""
    matrices = [blockmm.Matrix(random_blocks("Q4_K", 64, 1024, seed=1), "Q4_K", 1024)]
    slow, fast = blockmm.PREFETCH_CANDIDATES[0], blockmm.PREFETCH_CANDIDATES[1]
    seen = []

    narrow = blockmm.NARROW_CANDIDATES[-1] if blockmm.isa() == "avx512vnni" else blockmm.isa()

    def fake_rounds(settings, apply, mats, rows, rounds):
        if apply is blockmm.set_narrow_isa:  # the last candidate runs narrow products fastest
            return {name: 1.0 if name == narrow else 2.0 for name in settings}
        if apply is blockmm.set_prefetch:  # the second candidate streams fastest
            seen.append(("prefetch timed on", blockmm.narrow_isa()))
            return {ahead: 1.0 if ahead == fast else 2.0 for ahead in settings}
        seen.append((blockmm.prefetch(), blockmm.narrow_isa()))
        return {setting: 1.0 for setting in settings}

    monkeypatch.setattr(blockmm, "_time_rounds", fake_rounds)
    with kernel_settings_restored():
        blockmm.set_prefetch(slow)
        blockmm.set_one_row_limit("Q4_0", 3)
        blockmm.choose_paths(matrices, rounds=1)
        assert seen[0] == ("prefetch timed on", narrow) and set(seen[1:]) == {(fast, narrow)}
        assert blockmm.prefetch() == fast and blockmm.one_row_limits()["Q4_0"] == 3


@pytest.mark.parametrize("fast", [0.95, 0.99])
def test_the_layouts_prefetch_distance_moves_off_the_default_only_when_clearly_faster(monkeypatch, fast):
    """Timed on the laid-out copies where they hold ``PACKED_PREFETCH_TIMED_BYTES`` (here lowered to let small ones
    count), at one row; another distance than the default is kept only if ``PACKED_PREFETCH_MARGIN`` times its time
    or less (a cached copy's timings differ by noise)."""
    if not blockmm.can_pack16("Q4_0", 16):
        pytest.skip(f"this CPU (best set {blockmm.best_isa()}) reads no Q4_0 in the 16-row layout")
    matrices = [blockmm.Matrix(random_blocks("Q4_0", 64, 1024, seed=i), "Q4_0", 1024) for i in range(2)]
    other = blockmm.PACKED_PREFETCH_CANDIDATES[1]
    real = blockmm._time_rounds

    def fake_rounds(settings, apply, mats, rows, rounds):
        if apply is blockmm.set_packed_prefetch:
            assert rows == 1 and all(m.packed for m in mats)
            return {ahead: fast if ahead == other else 1.0 for ahead in settings}
        return real(settings, apply, mats, rows, rounds)

    monkeypatch.setattr(blockmm, "_time_rounds", fake_rounds)
    monkeypatch.setattr(blockmm, "PACKED_PREFETCH_TIMED_BYTES", 1)
    with kernel_settings_restored():
        found = blockmm.choose_paths(matrices, rounds=1)
        assert found["packed_prefetch"][1] == tuple(fast if a == other else 1.0 for a in blockmm.PACKED_PREFETCH_CANDIDATES)
        kept = other if fast < blockmm.PACKED_PREFETCH_MARGIN else blockmm.PACKED_PREFETCH
        assert blockmm.packed_prefetch() == kept
        assert blockmm.path_settings(["Q4_0"])["packed_prefetch"] == kept
        named = " ".join(blockmm.paths_in_use(["Q4_0"]))  # the distance is named where a type is laid out
        if "Q4_0 laid out" in named:
            assert (f"the layout fetched {other} B ahead" in named) == (kept != blockmm.PACKED_PREFETCH)


def test_choose_paths_times_both_paths_per_k_type_and_keeps_the_faster():
    matrices = [blockmm.Matrix(random_blocks(kind, 64, 1024, seed=i), kind, 1024)
                for i, kind in enumerate(("Q4_K", "Q6_K", "Q4_0"))]
    matrices.append(blockmm.Matrix(random_blocks("Q8_0", 64, 1024, seed=9), "Q8_0", 1024))
    with kernel_settings_restored():
        found = blockmm.choose_paths(matrices, rounds=3)
        paths = {"Q4_K", "Q6_K", "Q4_0", "Q8_0", "prefetch"}
        assert set(found) - {"wide", "narrow", "amx", "wide16", "pack16", "amx_packed", "packed_prefetch"} == paths

        def won(took):  # the narrowest width from which the first path wins at every wider one
            wins = [rows for rows in took if all(took[w][0] < took[w][1] for w in took if w >= rows)]
            return wins[0] if wins else 0

        timed = found.pop("pack16", {})
        # the layout's prefetch distance is timed only on copies big enough to stream from memory: these sit in a cache
        assert "packed_prefetch" not in found and blockmm.packed_prefetch() == blockmm.PACKED_PREFETCH
        for kind, took in timed.items():  # every type among the matrices that this CPU reads in the layout
            assert tuple(took) == blockmm.PACK16_WIDTHS and min(min(pair) for pair in took.values()) > 0
            one, wide = took[1], took[blockmm.PACK16_WIDTHS[-1]]
            kept = wide[0] < wide[1] and one[0] <= one[1] * blockmm.PACK16_ONE_ROW_SLACK
            assert (kind in blockmm.pack16_kinds()) == kept
            assert (f"{kind} laid out 16 rows at a time" in " ".join(blockmm.paths_in_use([kind]))) == kept
        if blockmm.isa() == "avx512vnni":
            # every type among the matrices, but those whose AMX tiles won on the file's layout and read that alone
            on_file = {kind for kind, took in found.get("amx", {}).items() if won(took)} - set(blockmm.AMX_PACKED)
            assert set(timed) == {"Q4_K", "Q6_K", "Q4_0", "Q8_0"} - on_file
            rows16 = found.pop("wide16")
            assert set(rows16) == {"Q4_K", "Q6_K"}  # the K types among the matrices
            for kind, took in rows16.items():
                assert tuple(took) == blockmm.WIDE16_WIDTHS and min(min(pair) for pair in took.values()) > 0
                assert blockmm.wide16_rows()[kind] == won(took)
        else:
            assert "wide16" not in found and set(blockmm.wide16_rows().values()) == {0}
            assert set(timed) == {"Q4_K", "Q4_0", "Q8_0"}  # AVX2: the 32-weight types and Q4_K
        if blockmm.isa() == "avx512vnni" and blockmm.amx_usable():
            amx, again = found.pop("amx"), found.pop("amx_packed", {})
            assert set(amx) == {"Q4_K", "Q6_K"}  # the K types among the matrices
            # timed again on the 16-row layout: the types kept in it whose layout the tiles read
            assert set(again) == set(blockmm.pack16_kinds()) & set(blockmm.AMX_PACKED)
            for kind, took in (amx | again).items():
                assert tuple(took) == blockmm.AMX_WIDTHS and min(min(pair) for pair in took.values()) > 0
                assert blockmm.amx_rows()[kind] == won(took)
        else:
            assert not {"amx", "amx_packed"} & set(found) and set(blockmm.amx_rows().values()) == {0}
        took = found["prefetch"][1]
        assert len(took) == len(blockmm.PREFETCH_CANDIDATES) and min(took) > 0
        fastest = min(range(len(took)), key=lambda i: (took[i], i))
        assert blockmm.prefetch() == blockmm.PREFETCH_CANDIDATES[fastest]
        for kind in ("Q4_K", "Q6_K", "Q4_0", "Q8_0"):  # kept up to the widest width up to which it wins at every one
            timed = [rows for rows in blockmm.ONE_ROW_TIMED if rows <= blockmm.ONE_ROW_MOST[kind]]
            assert set(found[kind]) - ({8} if kind == "Q6_K" else set()) == set(timed)
            assert min(min(found[kind][rows]) for rows in timed) > 0
            losing = [rows for rows in timed if found[kind][rows][0] > found[kind][rows][1]]
            want = max([0] + [rows for rows in timed if not losing or rows < losing[0]])
            assert blockmm.one_row_limits()[kind] == want
        if blockmm.isa() == "avx512vnni":
            tiles, buffered = found["Q6_K"][8]
            assert blockmm.q6k_tiles() == (tiles < buffered)
            took = found.pop("wide")[8]
            fastest = min(range(len(took)), key=lambda i: (took[i], i))
            assert blockmm.wide_isa() == blockmm.WIDE_CANDIDATES[fastest]
            took = found.pop("narrow")[2]
            assert len(took) == len(blockmm.NARROW_CANDIDATES) and min(took) > 0
            fastest = min(range(len(took)), key=lambda i: (took[i], i))
            assert blockmm.narrow_isa() == blockmm.NARROW_CANDIDATES[fastest]
        else:
            assert 8 not in found["Q6_K"] and "wide" not in found and "narrow" not in found
            assert blockmm.wide_isa() == blockmm.isa() == blockmm.narrow_isa()
    with pytest.raises(ValueError, match="prefetch distance must be 0..1048576 bytes"):
        blockmm.set_prefetch(-1)
    with pytest.raises(ValueError, match="packed prefetch distance must be 0..1048576 bytes"):
        blockmm.set_packed_prefetch(1 << 21)
    with pytest.raises(ValueError, match="F16 has no one-row path"):
        blockmm.set_one_row_limit("F16", 1)
    with pytest.raises(ValueError, match="0..16 rows"):
        blockmm.set_one_row_limit("Q4_0", 17)
    with pytest.raises(ValueError, match="0..2 rows"):
        blockmm.set_one_row_limit("Q4_K", 3)
    with pytest.raises(ValueError, match="Q4_0 has no 16-row tiles"):
        blockmm.set_wide16(3, "Q4_0")
    with pytest.raises(ValueError, match="0 \\(never\\) or at least 2 rows"):
        blockmm.set_wide16(1, "Q4_K")


@pytest.mark.parametrize("kind", list(TYPES))
def test_close_to_float_product(kind):
    """Quantizing activations per 32 values costs little: close to x times the dequantized weights."""
    K = 1024
    raw = random_blocks(kind, 16, K, seed=11)
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ reference.dequantize(raw, kind, K).double().T
    got = blockmm.matmul(x, raw, kind).double()
    err = (got - exact).norm() / exact.norm()
    assert err < 0.01, err


def test_leading_dimensions_and_out():
    raw = random_blocks("Q4_K", 8, 256)
    x = torch.randn(2, 3, 256)
    y = blockmm.matmul(x, raw, "Q4_K")
    assert y.shape == (2, 3, 8)
    assert torch.equal(y.reshape(6, 8), blockmm.matmul(x.reshape(6, 256), raw, "Q4_K"))
    assert torch.equal(blockmm.matmul(x.double(), raw, "Q4_K"), y)  # read as float32


def test_bad_input_is_named():
    raw = random_blocks("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="64"):
        blockmm.matmul(torch.randn(1, 96), raw, "Q4_0")
    with pytest.raises(ValueError, match="no native kernel"):
        blockmm.matmul(torch.randn(1, 64), raw, "Q2_K")
    with pytest.raises(ValueError, match="uint8"):
        blockmm.matmul(torch.randn(1, 64), raw.float(), "Q4_0")
    with pytest.raises(ValueError, match="not available on this CPU|scalar"):
        blockmm.set_isa("nonsense")


def test_a_missing_native_module_is_named_as_missing_not_as_a_circular_import():
    from verispec.blockmm import _describe

    missing = ImportError("cannot import name '_native' from partially initialized module 'verispec.blockmm' (most "
                          "likely due to a circular import) (/x/verispec/blockmm/__init__.py)")
    assert _describe(missing).startswith("no compiled _native module in ")
    other = ImportError("libstdc++.so.6: version `GLIBCXX_3.4.32' not found")
    assert _describe(other) == str(other)


def test_rms_norm_is_the_formula_and_each_rows_bits_are_its_own():
    torch.manual_seed(5)
    for H in (32, 37, 1536):
        x, w = 3 * torch.randn(9, H), torch.randn(H)
        y = blockmm.rms_norm(x, w, 1e-6)
        x64 = x.double()
        want = w.double() * x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + 1e-6)
        assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6), H
        for i in range(9):
            assert torch.equal(blockmm.rms_norm(x[i:i + 1], w, 1e-6), y[i:i + 1]), (H, i)
        assert torch.equal(blockmm.rms_norm(x.flip(0), w, 1e-6), y.flip(0))
        assert torch.equal(blockmm.rms_norm(x.view(3, 3, H), w, 1e-6), y.view(3, 3, H))
    with pytest.raises(ValueError, match="weight must be a contiguous float32 vector of 8 values"):
        blockmm.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


def test_silu_mul_gives_torchs_silu_bits_on_every_instruction_set():
    """The native layers' SiLU (``blockmm.silu_mul``) against ``F.silu(g) * u`` on values of every sign and exponent,
    those around SiLU's cut-offs (exp(-x) is 0 below x = -100 and infinite past x = 104) and random ones, on each
    instruction set and the scalar steps past a multiple of 8; torch's reference taken in pieces below its parallel
    grain, each a whole number of its vectors (its scalar tail calls std::exp, another rounding)."""
    bits = torch.arange(0, 1 << 32, 40009, dtype=torch.int64).to(torch.int32).view(torch.float32)
    g = torch.cat([bits[torch.isfinite(bits)], torch.linspace(-110.0, 110.0, 8192), 6 * torch.randn(8192),
                   torch.tensor([0.0, -0.0, 100.0, -100.0, 104.0, -104.0, 1e-38, -1e-38])])
    g = g[: g.numel() // 32 * 32].contiguous()
    u = 1.5 * torch.randn(g.numel())
    want = torch.cat([torch.nn.functional.silu(piece) for piece in g.split(8192)]) * u
    best = blockmm.best_isa()
    try:
        for name in blockmm.isas():
            blockmm.set_isa(name)
            assert torch.equal(blockmm.silu_mul(g, u), want), name
            assert torch.equal(blockmm.silu_mul(g[:37], u[:37]), want[:37]), name  # 4 vectors and 5 scalar steps
    finally:
        blockmm.set_isa(best)
    with pytest.raises(ValueError, match="one shape"):
        blockmm.silu_mul(torch.randn(4), torch.randn(5))


def test_rope_is_transformers_rotary_embedding_to_the_bit():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(6)
    for B, H, R, D, cos_batch in ((1, 12, 1, 128, 1), (1, 2, 5, 128, 1), (2, 3, 4, 64, 2), (2, 3, 4, 64, 1)):
        # the layout the decoder layers hand it: heads of a projection's output, a view with a row stride of its own
        x = torch.randn(B, R, H * D + 40, generator=g)[..., :H * D].view(B, R, H, D).transpose(1, 2)
        cos, sin = torch.randn(cos_batch, R, D, generator=g), torch.randn(cos_batch, R, D, generator=g)
        want, _ = apply_rotary_pos_emb(x, x, cos, sin)
        got = blockmm.rope(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, want), (B, H, R, D, cos_batch)
    with pytest.raises(ValueError, match=r"cos and sin must be \[2 or 1, 4, 64\]"):
        blockmm.rope(torch.randn(2, 3, 4, 64), torch.randn(2, 4, 32), torch.randn(2, 4, 32))


def test_row_digests_tell_rows_apart_by_their_exact_bytes():
    torch.manual_seed(7)
    x = torch.randn(4000, 96)
    near = x[:500].clone()
    near.view(torch.int32)[:, 37] ^= 1  # one bit of one value
    sign = x[:500].clone()
    sign[:, 0] = -sign[:, 0]
    top = x[:500].clone()
    top.view(torch.int32)[:, 95] ^= -2 ** 31  # the highest bit of the last word
    every = torch.cat([x, near, sign, top])
    digests = blockmm.row_digests(every)
    assert len(digests) == len(every) and all(len(d) == 16 for d in digests)
    assert len(set(digests)) == len(every)  # no two different rows share one
    assert blockmm.row_digests(x[123:124]) == [digests[123]]  # a row's digest is its own, wherever it sits
    assert blockmm.row_digests(x.flip(0)) == digests[:4000][::-1]
    assert blockmm.row_digests(torch.zeros(3, 5)) == blockmm.row_digests(torch.zeros(3, 5))[:1] * 3
    assert blockmm.row_digests(torch.zeros(1, 5)) != blockmm.row_digests(torch.zeros(1, 6))  # the length counts
    with pytest.raises(ValueError, match="2-D"):
        blockmm.row_digests(torch.zeros(5))


NO_AMX = "this CPU or OS gives no AMX-INT8 tiles (an Intel Xeon from Sapphire Rapids on); the other tests cover its paths"


@pytest.mark.skipif(not blockmm.available() or not blockmm.amx_usable(), reason=NO_AMX)
@pytest.mark.parametrize("kind", blockmm.K_TYPES)
def test_amx_tiles_give_the_reference_bits(kind):
    """The K types on the AMX tiles: 16 weight rows and up to 16 activation rows a tile product, the rows past the
    last whole 16 of a thread's share on the AVX-512 paths; every width (one tile block, several, a tail) and thread
    count gives the reference's bits, so a row is the same whichever path took it."""
    K = 768
    x = activations(64, K, seed=31)
    try:
        for rows in (16, 37, 64):
            raw = random_blocks(kind, rows, K, seed=rows)
            want = reference.matmul(x, raw, kind)
            blockmm.set_amx_rows(1, kind)
            assert blockmm.amx_rows()[kind] == 1
            assert f"AMX tiles for {kind} from 1 rows" in blockmm.paths_in_use([kind])
            for M in (1, 2, 3, 8, 15, 16, 17, 33, 40, 64):
                for threads in (1, 2, 3):
                    got = blockmm.matmul(x[:M], raw, kind, threads=threads)
                    assert torch.equal(got, want[:M]), (kind, rows, M, threads)
            blockmm.set_amx_rows(9, kind)  # narrower products stay on the AVX paths: the same bits
            assert torch.equal(blockmm.matmul(x[:8], raw, kind), want[:8])
    finally:
        blockmm.set_amx_rows(0)
    assert not any("AMX" in words for words in blockmm.paths_in_use([kind]))


@pytest.mark.skipif(not blockmm.available() or not blockmm.amx_usable(), reason=NO_AMX)
def q6_scales_at_ends(raw: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """Q6_K: copies of ``raw`` whose first 16 rows' weights are all 63 and sub-scales all -128, then all 127 (the
    ends of the digits the AMX tiles split a sub-scale into); other types: none."""
    if kind != "Q6_K":
        return []
    scales = torch.isin(torch.arange(raw.shape[1]) % TYPES[kind].bytes, torch.arange(192, 208))
    weights = (torch.arange(raw.shape[1]) % TYPES[kind].bytes) < 192
    out = []
    for scale in (0x80, 0x7F):
        ends = raw.clone()
        ends[:16] = torch.where(scales, torch.full_like(raw[:16], scale), torch.where(weights, 0xFF, raw[:16]))
        out.append(ends)
    return out


@pytest.mark.parametrize("kind", blockmm.AMX_PACKED)
def test_amx_tiles_on_the_16_row_layout_give_the_reference_bits(kind):
    """A type laid out 16 rows at a time (``pack16``) on the AMX tiles, which read that layout as their weight operand:
    one block of 16 activation rows, two, an odd count (a last block alone), a part block, 1-3 threads over 1-4 runs of
    16 weight rows, the integers at their extremes (Q6_K's sub-scales at both ends): the reference's bits."""
    K = 768
    x = activations(64, K, seed=41)
    x[5] = torch.where(torch.arange(K) % 3 == 0, 1.0, -1.0)  # every value at +-127 after quantization
    with kernel_settings_restored():
        for rows in (16, 64):
            raw = random_blocks(kind, rows, K, seed=rows + 1)
            for blocks in (raw, at_extremes(raw, kind, slice(0, 16)), *q6_scales_at_ends(raw, kind)):
                want = reference.matmul(x, blocks, kind)
                packed = blocks.clone()
                blockmm.pack16(packed, kind)
                matrix = blockmm.Matrix(packed, kind, K, packed=True)
                blockmm.set_amx_rows(1, kind)
                for M in (1, 3, 15, 16, 17, 33, 48, 64):
                    for threads in (1, 2, 3):
                        blockmm.set_threads(threads)
                        got = matrix(x[:M])
                        assert torch.equal(got, want[:M]), (rows, M, threads, (got - want[:M]).abs().max())


@pytest.mark.skipif(not blockmm.available(), reason="the native kernel is not built")
def test_set_amx_rows_takes_the_tiles_only_where_they_exist():
    with pytest.raises(ValueError, match="takes 0 .off. or the fewest rows"):
        blockmm.set_amx_rows(-1)
    with pytest.raises(ValueError, match="the AMX tiles take the K types"):
        blockmm.set_amx_rows(8, "Q8_0")
    if blockmm.amx_usable():
        blockmm.set_amx_rows(8, "Q6_K")
        assert blockmm.amx_rows() == {"Q4_K": 0, "Q5_K": 0, "Q6_K": 8}
        assert blockmm.paths_in_use(["Q4_K", "Q6_K"])[-1] == "AMX tiles for Q6_K from 8 rows"
        blockmm.set_amx_rows(0)
    else:
        with pytest.raises(ValueError, match="no AMX-INT8 tiles"):
            blockmm.set_amx_rows(8)
    assert set(blockmm.amx_rows().values()) == {0}
