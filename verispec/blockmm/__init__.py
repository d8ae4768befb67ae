"""Matrix products on a GGUF file's own quantized blocks, for decoding's skinny passes (1 to ~64 rows).

``matmul(x, blocks, kind)`` computes y = x W^T where W is held as the file holds it (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q5_K, Q6_K: ``formats``). The native kernel (``_native.cpp``, built from source when verispec is installed) unpacks each
weight block once per call and applies it to every row of x; activations are quantized per 32 values to int8 as
llama.cpp quantizes them, and the products are exact integers combined in float32 in one fixed order, so row i of y
is the same bits whatever else is in the pass (row-invariant: speculation and batching change no answer).
``reference.matmul`` is the same arithmetic in plain PyTorch.

The instruction set is chosen at run time: AVX-512 VNNI where the CPU has it, else AVX2 + FMA, else portable code
(correct, slow). ``available()`` says whether the kernel was built here, ``why_unavailable()`` why not.
"""

from __future__ import annotations

import mmap
import os
from contextlib import contextmanager

import torch

from .formats import TYPES, BlockType, block_type



def _describe(error: ImportError) -> str:
    """Why the native module did not import, in words: Python words a missing extension module imported from its
    own package as a "partially initialized module ... (most likely due to a circular import)"."""
    text = str(error)
    if "_native" in text and "partially initialized" in text:
        return f"no compiled _native module in {os.path.dirname(__file__)}"
    return text


try:
    from . import _native
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # not built (no compiler at install, or another platform)
    _native = None
    _IMPORT_ERROR = _describe(e)

THREADS_ENV = "VERISPEC_BLOCKMM_THREADS"


def available() -> bool:
    """Whether the native kernel is built and runs fast on this CPU (AVX2 or better)."""
    return _native is not None and _native.best_isa() != "scalar"


def native_built() -> bool:
    """Whether the native module is built here (its portable routines run on any CPU; ``available()`` also asks for
    the fast instruction sets)."""
    return _native is not None


def why_unavailable() -> str | None:
    """None when ``available()``; else what is missing and how to get it."""
    if _native is None:
        return ("verispec's native block kernel is not built here (" + (_IMPORT_ERROR or "unknown") + "); it is "
                "compiled when verispec is installed: reinstall with a C++ compiler present "
                "(pip install --force-reinstall --no-deps -e .)")
    if _native.best_isa() == "scalar":
        return "this CPU has no AVX2: the native block kernel would run its slow portable code"
    return None


def isa() -> str:
    """The instruction set the kernel uses: avx512vnni, vnni256 (the AVX2 code with AVX-512 VNNI's dot products on
    256-bit registers), avx2 or scalar (``ISAS``)."""
    _require()
    return _native.isa()


def best_isa() -> str:
    _require()
    return _native.best_isa()


def set_isa(name: str) -> None:
    """Use another instruction set (``ISAS``, at most this CPU's best) for products of every width, the 16-row tiles
    off (``set_wide16`` puts them back) and no 16-row layout for models loaded after (matrices already in it keep the
    AVX-512 VNNI tiles): for tests and measurements. The results are the same bits on every one."""
    _require()
    _native.set_isa(name)
    _pack16_kinds.clear()


ISAS = ("scalar", "avx2", "vnni256", "avx512vnni")  # in order: a CPU that runs one runs those before it
WIDE_CANDIDATES = ("avx512vnni", "vnni256", "avx2")  # the sets choose_paths times for products of 3 or more rows
NARROW_CANDIDATES = ("avx512vnni", "vnni256")  # the sets choose_paths times for products of 1 or 2 rows


def isas() -> tuple[str, ...]:
    """Every instruction set this CPU runs, from the portable code up to ``best_isa()``."""
    return ISAS[:ISAS.index(best_isa()) + 1]


def wide_isa() -> str:
    """The instruction set of products over 3 or more rows (``isa()``'s unless ``set_wide_isa`` chose another)."""
    _require()
    return _native.wide_isa()


def set_wide_isa(name: str) -> None:
    """Products over 3 or more rows on ``name`` (at most this CPU's best), narrower ones on ``isa()``: on an AMD Zen 4
    the 256-bit tiles beat the AVX-512 ones there (docs/kernels.md). Speed only: every set computes the same bits.
    ``set_isa`` puts every width back on the set it names."""
    _require()
    _native.set_wide_isa(name)


def narrow_isa() -> str:
    """The instruction set of products over 1 or 2 rows (``isa()``'s unless ``set_narrow_isa`` chose another)."""
    _require()
    return _native.narrow_isa()


def set_narrow_isa(name: str) -> None:
    """Products over 1 or 2 rows on ``name`` (at most this CPU's best); attention and the other row kernels stay on
    ``isa()``. On an AMD Zen 4 the 256-bit one-row paths beat the AVX-512 ones (docs/kernels.md). Speed only: every set
    computes the same bits. ``set_isa`` puts every width back on the set it names."""
    _require()
    _native.set_narrow_isa(name)


def amx_usable() -> bool:
    """Whether this CPU and OS let the kernel multiply on AMX-INT8 tiles (an Intel Xeon from Sapphire Rapids on, with
    Linux's permission for the tile state): ``set_amx_rows`` then sends wide K-type products there."""
    _require()
    return _native.amx_usable()


def amx_rows() -> dict[str, int]:
    """Per K type (Q4_K, Q5_K, Q6_K), the fewest rows at which its products take the AMX tiles (0: never, the default
    until ``choose_paths`` times them on a model's matrices)."""
    _require()
    return {kind: _native.amx_rows(block_type(kind).ggml_id) for kind in K_TYPES}


def set_amx_rows(rows: int, kind: str | None = None) -> None:
    """Products of ``rows`` or more rows of ``kind`` (every K type if None) on the AMX tiles (0: never). Speed only:
    the tiles compute the other paths' bits (whole-super-block integers, the same float steps). ValueError where
    ``amx_usable()`` is false, or for a type the tiles do not take."""
    _require()
    for name in K_TYPES if kind is None else (kind,):
        _native.set_amx_rows(block_type(name).ggml_id, int(rows))


_threads: int | None = None
_held: int | None = None  # default_threads worked out for a block (threads_held)


def set_threads(threads: int | None) -> None:
    """The kernel's threads from now on in this process (None: ``default_threads``'s rule)."""
    global _threads
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _threads = threads


@contextmanager
def threads_held():
    """Within this block the kernel's thread count is worked out once (``default_threads``), not at each product: a
    pass makes ~230 calls, and reading the environment and the CPU affinity each time cost ~1 ms of a 75 ms pass."""
    global _held
    before = _held
    _held = default_threads()
    try:
        yield
    finally:
        _held = before


def threads_now() -> int:
    """The threads a product started now runs on (what ``Matrix`` passes the kernel)."""
    return _threads or _held or default_threads()


def default_threads() -> int:
    """Threads: as set by ``set_threads``, else VERISPEC_BLOCKMM_THREADS, else the cores this process may use."""
    if _threads is not None:
        return _threads
    if _held is not None:
        return _held
    value = os.environ.get(THREADS_ENV)
    if value:
        return max(1, int(value))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _require() -> None:
    if _native is None:
        raise RuntimeError(why_unavailable())


def _check(blocks: torch.Tensor, t: BlockType, K: int) -> None:
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 tensor [rows, bytes a row]")
    if blocks.shape[1] != t.row_bytes(K):
        raise ValueError(f"x has {K} columns but each {t.name} row of the weight holds "
                         f"{blocks.shape[1] // t.bytes * t.weights}")


def matmul(x: torch.Tensor, blocks: torch.Tensor, kind: str | BlockType, threads: int | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] W^T, W [N, K] held as GGUF blocks ``blocks`` (uint8 [N, bytes a row]) of type ``kind``.

    x is read as float32; y is float32."""
    _require()
    t = block_type(kind) if isinstance(kind, str) else kind
    K = x.shape[-1]
    N = blocks.shape[0]
    _check(blocks, t, K)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    M = x2.shape[0]
    y = out if out is not None else torch.empty(M, N, dtype=torch.float32)
    _native.matmul(t.ggml_id, x2.data_ptr(), blocks.data_ptr(), y.data_ptr(), M, N, K, blocks.shape[1],
                   threads or default_threads())
    return y.reshape(*lead, N)


K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # one-row path for 1-2 rows beside the tiles; the 32-weight types' for 1-16 rows
ONE_ROW_MOST = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q8_0": 16, "Q4_K": 2, "Q5_K": 2, "Q6_K": 2}
ONE_ROW_TIMED = (1, 2, 4, 8, 16)  # the widths choose_paths times the one-row path at (those up to a type's most)


def one_row_limits() -> dict[str, int]:
    """Per block type, the widest pass (0 up to ``ONE_ROW_MOST``) that takes the one-weight-row path; wider ones take
    the tiles (K types) or the buffered path."""
    _require()
    return {name: _native.one_row(block_type(name).ggml_id) for name in ONE_ROW_MOST}


def set_one_row_limit(kind: str, rows: int) -> None:
    """Passes of at most ``rows`` rows (0 .. ``ONE_ROW_MOST[kind]``) take the one-weight-row path for ``kind``. Speed
    only: every path computes the same bits."""
    _require()
    if kind not in ONE_ROW_MOST:
        raise ValueError(f"{kind} has no one-row path; the types are {', '.join(ONE_ROW_MOST)}")
    if not 0 <= rows <= ONE_ROW_MOST[kind]:
        raise ValueError(f"{kind}'s one-row path takes 0..{ONE_ROW_MOST[kind]} rows, not {rows}")
    _native.set_one_row(block_type(kind).ggml_id, rows)


def q6k_tiles() -> bool:
    """Whether Q6_K passes wider than its one-row limit take the tiles (else the buffered path; AVX-512 only: the AVX2
    build always takes the tiles)."""
    _require()
    return _native.q6k_tiles()


def set_q6k_tiles(on: bool) -> None:
    """Q6_K passes wider than its one-row limit on the tiles (True) or the buffered path. Speed only (same bits)."""
    _require()
    _native.set_q6k_tiles(bool(on))


def wide16_rows() -> dict[str, int]:
    """{K type: the rows from which its passes take the 16-row tiles (AVX-512 VNNI only; 0: never)}."""
    _require()
    return {kind: _native.wide16(block_type(kind).ggml_id) for kind in K_TYPES}


def set_wide16(rows: int, kind: str | None = None) -> None:
    """Passes of ``kind`` (every K type if None) of at least ``rows`` rows on the 16-row tiles (AVX-512 VNNI, whatever
    set ``set_narrow_isa`` / ``set_wide_isa`` gave their width; 0: never, else at least 2). Speed only (the same
    bits)."""
    _require()
    for name in K_TYPES if kind is None else (kind,):
        if name not in K_TYPES:
            raise ValueError(f"{name} has no 16-row tiles; the types are {', '.join(K_TYPES)}")
        _native.set_wide16(block_type(name).ggml_id, int(rows))


def pack16(blocks: torch.Tensor, kind: str | BlockType, unpack: bool = False, threads: int | None = None) -> None:
    """Lay a matrix (uint8 [N, bytes a row], N a multiple of 16) out 16 rows at a time, in place, or back
    (``unpack``): each run of 16 rows keeps its bytes, block by block with row r's dword k at dword 16 k + r (a
    32-weight block's leading float16 factors as 16 halves side by side), so the 16-row tiles load four weights of
    all 16 rows as one vector (the file's layout needs transposes for that). Q8_0's weights are stored plus 128 and
    Q5_0's high bits reordered, both undone by unpacking. Only ``Matrix(..., packed=True)`` reads it (on the tiles at
    every width: every type on AVX-512 VNNI CPUs, the 32-weight types and Q4_K on AVX2 ones); the products keep their
    bits."""
    _require()
    t = block_type(kind) if isinstance(kind, str) else kind
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 tensor [rows, bytes a row]")
    _native.pack16(t.ggml_id, blocks.data_ptr(), blocks.shape[0], blocks.shape[1], bool(unpack),
                   threads or default_threads())


def can_pack16(kind: str, rows: int) -> bool:
    """Whether ``pack16`` takes a matrix of ``rows`` rows of ``kind`` on this CPU."""
    return rows % 16 == 0 and _pack16_served(kind)


def _pack16_served(kind: str) -> bool:
    """Whether this CPU's code reads ``kind`` in the 16-row layout: every type on AVX-512 VNNI, the 32-weight types
    and Q4_K on AVX2 (256-bit tiles)."""
    if not available() or kind not in TYPES:
        return False
    best = best_isa()
    return best == "avx512vnni" or (best in ("avx2", "vnni256") and kind not in AVX512_LAYOUT_ONLY)


# the types whose 16-row layout only AVX-512 VNNI code reads (Q6_K's AVX2 reading was no faster than its own paths
# at 4 rows on a Zen 3: docs/kernels.md)
AVX512_LAYOUT_ONLY = ("Q5_K", "Q6_K")


PREFETCH = 4096  # bytes ahead the one-row paths request weights when prefetching is on (the native default)
# the distances choose_paths times, in order of preference on a tie (0: off); 4 KB was the AMD EPYC Zen 3's best, 2 KB
# the Intel Sapphire Rapids' (figures: docs/kernels.md)
PREFETCH_CANDIDATES = (PREFETCH, 2048, 0)


def prefetch() -> int:
    """How far ahead (bytes) the one-row paths request the weights they stream; 0: off (the hardware's prefetcher
    alone)."""
    _require()
    return _native.prefetch()


def set_prefetch(nbytes: int) -> None:
    """The one-row paths request the weights ``nbytes`` ahead (0..1 MB; 0: off). Speed only: the same bits."""
    _require()
    if not 0 <= nbytes <= 1 << 20:
        raise ValueError(f"prefetch distance must be 0..1048576 bytes, not {nbytes}")
    _native.set_prefetch(int(nbytes))


def packed_prefetch() -> int:
    """How far ahead (bytes) the 16-row layout's readers request each block into L2; 0: off (the hardware's prefetcher
    alone)."""
    _require()
    return _native.packed_prefetch()


def set_packed_prefetch(nbytes: int) -> None:
    """The 16-row layout's readers request each block ``nbytes`` ahead (0..1 MB; 0: off). Speed only: the same bits."""
    _require()
    if not 0 <= nbytes <= 1 << 20:
        raise ValueError(f"packed prefetch distance must be 0..1048576 bytes, not {nbytes}")
    _native.set_packed_prefetch(int(nbytes))


def lookahead() -> tuple[int, int]:
    """(own, other): the bytes of the next matrix each kernel worker fetches between two calls (its own rows; worker 1
    also the calling thread's), while the framework runs; (0, 0): off."""
    _require()
    return tuple(_native.lookahead())


def row_chunks() -> int:
    """About how many runs of rows each thread takes, one after another, in a call past the one-row paths (0: one
    fixed share a thread)."""
    _require()
    return _native.row_chunks()


def set_row_chunks(n: int) -> None:
    """Calls past the one-row paths hand out their weight rows in about ``n`` runs a thread, a thread taking the next
    run when it is done (0: one fixed share a thread, as one-row calls keep). Speed only: the same bits."""
    _require()
    if not 0 <= n <= 64:
        raise ValueError(f"row chunks must be 0..64, not {n}")
    _native.set_row_chunks(int(n))


def set_lookahead(own: int, other: int = 0) -> None:
    """Between calls, each worker thread fetches the first ``own`` bytes of its rows of the matrix the last product
    named as next (``link``), worker 1 also ``other`` bytes of the calling thread's rows. Speed only: the same bits."""
    _require()
    for name, value in (("own", own), ("other", other)):
        if not 0 <= value <= 1 << 26:
            raise ValueError(f"lookahead {name} must be 0..{1 << 26} bytes, not {value}")
    _native.set_lookahead(int(own), int(other))


def link(matrices: list["Matrix"]) -> int:
    """Name each matrix's successor in memory as what its products fetch ahead for (``set_lookahead``): the matrix
    whose blocks start first at or after its own end, the first one after the last. A model whose matrices lie in one
    buffer in the order its layers run (the blocks backend's) thus fetches, during the framework's work after each
    product, the product that comes next. Where several start at one address (joined siblings and their members) the
    largest counts. Returns how many matrices were linked. A successor whose buffer was since replaced is harmless:
    its address is only prefetched, and a prefetch never faults."""
    regions: dict[int, Matrix] = {}
    for m in matrices:
        start = m.blocks.data_ptr()
        if start not in regions or regions[start].N < m.N:
            regions[start] = m
    starts = sorted(regions)
    if len(starts) < 2:
        return 0
    import bisect

    for m in matrices:
        end = m.blocks.data_ptr() + m.N * m._args[4]
        nxt = regions[starts[bisect.bisect_left(starts, end) % len(starts)]]
        m._next = (nxt.blocks.data_ptr(), nxt.N, nxt._args[4])
    return len(matrices)


def paths_in_use(kinds) -> list[str]:
    """The non-default paths the kernel takes now for the block types ``kinds`` (a model's), in words, for the kernel
    string that ``verispec costs`` and ``bench`` print: ["one-row path for Q6_K", "Q6_K tiles"]."""
    if not available():
        return []
    limits = one_row_limits()
    one_row = [kind for kind in sorted(kinds) if limits.get(kind) and kind not in _pack16_kinds]  # (the layout: tiles)
    named = [f"one-row path for {', '.join(one_row)}"] if one_row else []
    if "Q6_K" in kinds and isa() == "avx512vnni" and q6k_tiles():
        named.append("Q6_K tiles")
    if one_row and prefetch() != PREFETCH:
        named.append(f"prefetching {prefetch()} B ahead" if prefetch() else "no prefetching")
    own, _ = lookahead()
    if own:
        named.append(f"next matrix fetched between calls ({own // 1024} KB a worker)")
    if narrow_isa() != isa():
        named.append(f"{narrow_isa()} at 1-2 rows")
    if wide_isa() != isa():
        named.append(f"{wide_isa()} past 2 rows")
    rows16 = wide16_rows() if isa() == "avx512vnni" else {}
    on = [f"{kind} from {rows16[kind]} rows" for kind in sorted(kinds) if rows16.get(kind)]
    if on:
        named.append(f"16-row tiles for {', '.join(on)}")
    tiles = amx_rows() if isa() == "avx512vnni" else {}
    on = [f"{kind} from {tiles[kind]} rows" for kind in sorted(kinds) if tiles.get(kind)]
    if on:
        named.append(f"AMX tiles for {', '.join(on)}")
    packed = [kind for kind in sorted(kinds) if kind in _pack16_kinds]
    if packed:
        readers = "16-row and AMX tiles" if any(tiles.get(kind) for kind in packed) else "16-row tiles at every width"
        named.append(f"{', '.join(packed)} laid out 16 rows at a time ({readers})")
        if packed_prefetch() != PACKED_PREFETCH:
            named.append(f"the layout fetched {packed_prefetch()} B ahead" if packed_prefetch()
                         else "the layout left to the hardware's prefetcher")
    return named


def _time_rounds(settings: dict, apply, matrices: list["Matrix"], rows: int, rounds: int) -> dict:
    """Median ms of one product per matrix at ``rows`` rows under each setting (``apply(setting)``), interleaved."""
    return _time_sets({setting: matrices for setting in settings}, rows, rounds, apply)


def _time_sets(sets: dict, rows: int, rounds: int, apply=lambda setting: None) -> dict:
    """Median ms of one product per matrix of each list of ``sets`` ({setting: matrices}) at ``rows`` rows, after
    ``apply(setting)``, interleaved."""
    import statistics
    import time

    xs = {m.K: torch.randn(rows, m.K) for matrices in sets.values() for m in matrices}
    took: dict = {setting: [] for setting in sets}
    for _ in range(rounds):
        for setting, matrices in sets.items():
            apply(setting)
            start = time.perf_counter()
            for m in matrices:
                m(xs[m.K])
            took[setting].append((time.perf_counter() - start) * 1e3)
    return {setting: statistics.median(times) for setting, times in took.items()}


PACK16_WIDTHS = (1, 4)  # the widths choose_paths times the 16-row layout at
PACKED_PREFETCH = 8192  # bytes ahead the 16-row layout's readers request each block (the native default)
# the distances choose_paths times for it, in order of preference on a tie (0: off); 8 KB was a Zen 4's best, 2 KB a
# Sapphire Rapids VM's (the 1.5B's passes 8-9% faster than at 8 KB, 4% without any: docs/kernels.md)
PACKED_PREFETCH_CANDIDATES = (PACKED_PREFETCH, 2048, 0)
# timed only on copies of at least this many bytes, and another distance kept only if 3% faster than the default: a
# small model's copies sit in a cache, where no distance matters (SmolLM2's timed "off" fastest, 1.4 against 1.5 ms,
# while its whole one-token passes ran 6.1 ms off against 5.3 at 8 KB on the same Sapphire Rapids VM; the 1.5B's ~250 MB
# of copies timed 2 KB 9-10% faster, as its passes did: docs/kernels.md)
PACKED_PREFETCH_TIMED_BYTES = 64 << 20
PACKED_PREFETCH_MARGIN = 0.97
# kept if at most 35% slower at one row timed so: there, products timed back to back read the layout slower than
# whole passes do (on a Zen 4 Q4_K up to 19%, Q6_K 16-27% slower so, 0.98x / 1.01x in one-token passes;
# docs/kernels.md)
PACK16_ONE_ROW_SLACK = 1.35
_pack16_kinds: set[str] = set()


def pack16_kinds() -> tuple[str, ...]:
    """The block types whose matrices a model loaded now lays out 16 rows at a time (``choose_paths``' choice, or
    ``set_pack16_kinds``'); the blocks backend packs them (``BlockLinear.pack``)."""
    return tuple(sorted(_pack16_kinds))


def set_pack16_kinds(kinds) -> None:
    """Lay out the matrices of these block types 16 rows at a time in models loaded from now on (every type on AVX-512
    VNNI, the 32-weight types and Q4_K on AVX2). Speed only: the same bits."""
    kinds = set(kinds)
    if kinds - set(TYPES):
        raise ValueError(f"the 16-row layout takes the block types {', '.join(TYPES)}, "
                         f"not {', '.join(sorted(kinds - set(TYPES)))}")
    unserved = sorted(kind for kind in kinds if not _pack16_served(kind))
    if unserved:
        raise ValueError(f"the 16-row layout of {', '.join(unserved)} is read by "
                         f"{'AVX-512 VNNI' if set(unserved) & set(AVX512_LAYOUT_ONLY) else 'AVX2'} code; this CPU's best set is "
                         f"{best_isa() if available() else 'unknown (no native kernel)'}")
    _pack16_kinds.clear()
    _pack16_kinds.update(kinds)


def _samples(matrices: list["Matrix"], kind: str) -> list["Matrix"]:
    """The matrices of ``kind`` in the file's layout that the 16-row layout can hold (every fourth of 32 or more)."""
    mine = [m for m in matrices if m.type.name == kind and not m.packed and can_pack16(kind, m.N)]
    return mine[::4] if len(mine) >= 32 else mine


def _packed_copies(mine: list["Matrix"]) -> list["Matrix"]:
    """Copies of ``mine`` laid out 16 rows at a time, on huge pages where the originals are (the blocks backend's
    weight_buffer: small pages made the copies ~20% slower at one row)."""
    copies, at = [], 0
    buffer = weight_buffer(sum(m.blocks.numel() for m in mine))
    for m in mine:
        blocks = buffer[at: at + m.blocks.numel()].view(m.blocks.shape)
        at += m.blocks.numel()
        blocks.copy_(m.blocks)
        pack16(blocks, m.type)
        copies.append(Matrix(blocks, m.type, m.K, packed=True))
    return copies


def _choose_pack16(matrices: list["Matrix"], rounds: int) -> tuple[dict, tuple[float, ...]]:
    """Per block type, its matrices (every fourth of 32 or more) laid out 16 rows at a time (copies): first the
    layout's prefetch distance, each of ``PACKED_PREFETCH_CANDIDATES`` on all the copies at one row (where memory
    binds; ``set_packed_prefetch``; only where they hold ``PACKED_PREFETCH_TIMED_BYTES``, another than the default kept
    only if ``PACKED_PREFETCH_MARGIN`` times its time), then each type's copies at that distance against the paths
    chosen for the file's layout at ``PACK16_WIDTHS``; kept (``set_pack16_kinds``) where faster at 4 rows and within
    ``PACK16_ONE_ROW_SLACK`` at one. Returns ({type: {rows: (ms in the 16-row layout, ms without)}}, the ms at each
    distance, () where not timed); ({}, ()) where no matrix can be laid out."""
    timed, kept = {}, set()
    tiles = amx_rows() if amx_usable() else {}
    samples = {kind: _samples(matrices, kind) for kind in TYPES}
    copies = {kind: _packed_copies(mine) for kind, mine in samples.items()
              if mine and not (tiles.get(kind) and kind not in AMX_PACKED)}  # (their AMX tiles read the file's layout)
    if not copies:
        set_pack16_kinds(())
        return {}, ()
    streamed = [c for cs in copies.values() for c in cs]
    distances: tuple[float, ...] = ()
    set_packed_prefetch(PACKED_PREFETCH)
    if sum(c.blocks.numel() for c in streamed) >= PACKED_PREFETCH_TIMED_BYTES:
        took = _time_rounds(PACKED_PREFETCH_CANDIDATES, set_packed_prefetch, streamed, 1, rounds)
        distances = tuple(took[ahead] for ahead in PACKED_PREFETCH_CANDIDATES)
        best = min(PACKED_PREFETCH_CANDIDATES, key=lambda ahead: took[ahead])  # ties: the first
        set_packed_prefetch(best if took[best] < took[PACKED_PREFETCH] * PACKED_PREFETCH_MARGIN else PACKED_PREFETCH)
    for kind, copies_of_kind in copies.items():
        mine = samples[kind]
        timed[kind] = {}
        for rows in PACK16_WIDTHS:
            took = _time_sets({True: copies_of_kind, False: mine}, rows, rounds)
            timed[kind][rows] = (took[True], took[False])
        one, wide = timed[kind][PACK16_WIDTHS[0]], timed[kind][PACK16_WIDTHS[-1]]
        if wide[0] < wide[1] and one[0] <= one[1] * PACK16_ONE_ROW_SLACK:
            kept.add(kind)
    set_pack16_kinds(kept)
    return timed, distances


def _widths_won(timed: dict[int, tuple[float, float]], widths) -> int:
    """The narrowest of ``widths`` from which the first path ({rows: (first's ms, second's)}) wins at every wider one
    (0: none)."""
    wins = [rows for rows in widths if all(timed[w][0] < timed[w][1] for w in widths if w >= rows)]
    return wins[0] if wins else 0


AMX_WIDTHS = (4, 8, 16, 32)  # the widths choose_paths times the AMX tiles at
AMX_PACKED = ("Q4_K", "Q6_K")  # the types whose 16-row layout (pack16) the AMX tiles read too (the others': the file's)
WIDE16_WIDTHS = (2, 3, 4, 6, 8)  # the widths choose_paths times the 16-row tiles at (wider passes take them too)


def _choose_amx(kind: str, mine: list["Matrix"], rounds: int) -> dict[int, tuple[float, float]]:
    """``kind``'s AMX tiles against the paths chosen without them at each of ``AMX_WIDTHS``, on ``mine``; kept from the
    narrowest width from which they win at every wider one (``set_amx_rows``). Returns {rows: (ms on the tiles, ms
    without)}."""
    timed = {}
    for rows in AMX_WIDTHS:
        took = _time_rounds((1, 0), lambda on: set_amx_rows(on, kind), mine, rows, rounds)
        timed[rows] = (took[1], took[0])
    set_amx_rows(_widths_won(timed, AMX_WIDTHS), kind)
    return timed


def choose_paths(matrices: list["Matrix"], rounds: int = 3) -> dict[str, dict[int, tuple[float, float]]]:
    """Time the kernel's interchangeable paths on ``matrices`` (a model's own) and keep the faster of each: per type,
    the one-weight-row path against the tiles (K types, at 1 and 2 rows) or the buffered path (32-weight types, at
    ``ONE_ROW_TIMED`` up to 16 rows: each group decoded once per 8 rows; ``set_one_row_limit``, kept up to the widest
    timed width up to which it wins at every timed width), on AVX-512 Q6_K's tiles against its buffered path at 8 rows
    (``set_q6k_tiles``), the one-row paths' software prefetching at each distance of ``PREFETCH_CANDIDATES``
    (``set_prefetch``; 0: off), and on AVX-512 the code for products of 1 or 2 rows (``set_narrow_isa``:
    ``NARROW_CANDIDATES`` at 1 and 2 rows together) and of 3 or more rows (``set_wide_isa``: ``WIDE_CANDIDATES`` at 4
    and 8 rows together). Which wins depends on the CPU (docs/kernels.md); every path computes the same bits. The
    narrow instruction set and then the prefetch distance are timed first (every type on its one-row path), so the
    paths are compared on the set and at the distance that are kept. Returns {type: {rows: (first path's ms,
    second's)}}: at the widths of ``ONE_ROW_TIMED`` up to ``ONE_ROW_MOST[type]`` the one-row path and the other, for
    Q6_K's 8 the tiles and the buffered path; under "prefetch" {1: (ms at each of PREFETCH_CANDIDATES)}; where timed,
    under "narrow" {2: (ms on each of NARROW_CANDIDATES)} and under "wide" {8: (ms on each of WIDE_CANDIDATES)}; on
    CPUs with AMX-INT8, under "amx" {type: {rows: (ms on the tiles, ms without)}} per K type at each of
    ``AMX_WIDTHS``, and a type's tiles kept from the narrowest of those widths from which they win at every wider one
    (``set_amx_rows``); on AVX-512 VNNI, each K type's 16-row tiles against the paths chosen for each width of
    ``WIDE16_WIDTHS`` (under "wide16" {type: {rows: (ms on the 16-row tiles, ms without)}}), kept from the narrowest of
    those widths from which they win at every wider one (``set_wide16``); then each type's matrices laid out 16 rows at
    a time (``pack16``: every type on AVX-512 VNNI, the 32-weight types and Q4_K on AVX2) against all of that
    (``_choose_pack16``; under "pack16" {type: {rows: (ms in that layout, ms without)}}, ``pack16_kinds``; the
    layout's prefetch distance timed first where the copies are big enough, under "packed_prefetch" {1: (ms at each
    of PACKED_PREFETCH_CANDIDATES)}), and
    for a type so laid out whose layout the AMX tiles read (``AMX_PACKED``) its tiles again on that layout (under
    "amx_packed", as under "amx"); medians of interleaved rounds; ties go to the earlier candidate (the AVX paths, for
    the tiles)."""
    _require()
    set_wide_isa(isa())  # every width on one set while the other paths are timed (a model loaded before may have
    # put wide products on AVX2, where the Q6_K tiles setting below changes nothing)
    set_narrow_isa(isa())
    found: dict[str, dict[int, tuple[float, float]]] = {}
    if matrices:
        # first the one-row paths' instruction set and prefetch distance, every type on them, on all the matrices:
        # they are then timed against the other paths at their best (timed at the default first, Q4_K's one-row
        # path lost to its tiles on a Sapphire Rapids, making one-token passes ~20% slower: docs/kernels.md)
        present = {m.type.name for m in matrices}
        for kind, most in ONE_ROW_MOST.items():
            if kind in present:  # (the others' limits are left as they are: another model's choice)
                set_one_row_limit(kind, most)
        if isa() == "avx512vnni":
            took = [_time_rounds(NARROW_CANDIDATES, set_narrow_isa, matrices, rows, rounds) for rows in (1, 2)]
            found["narrow"] = {2: tuple(sum(t[name] for t in took) for name in NARROW_CANDIDATES)}
            set_narrow_isa(min(NARROW_CANDIDATES, key=lambda name: sum(t[name] for t in took)))  # ties: the first
        took = _time_rounds(PREFETCH_CANDIDATES, set_prefetch, matrices, 1, rounds)
        found["prefetch"] = {1: tuple(took[ahead] for ahead in PREFETCH_CANDIDATES)}
        set_prefetch(min(PREFETCH_CANDIDATES, key=lambda ahead: took[ahead]))  # ties: the first
    for kind, most in ONE_ROW_MOST.items():
        mine = [m for m in matrices if m.type.name == kind]
        if not mine:
            continue
        found[kind] = {}
        widths = [rows for rows in ONE_ROW_TIMED if rows <= most]
        for rows in widths:  # limit `most`: passes up to it on the one-row path; 0: none
            took = _time_rounds((most, 0), lambda limit: set_one_row_limit(kind, limit), mine, rows, rounds)
            found[kind][rows] = (took[most], took[0])
        limit = 0  # the widest timed width up to which the one-row path wins at every timed width
        for rows in widths:
            if found[kind][rows][0] > found[kind][rows][1]:
                break
            limit = rows
        set_one_row_limit(kind, limit)
        if kind == "Q6_K" and isa() == "avx512vnni":
            took = _time_rounds((True, False), set_q6k_tiles, mine, 8, rounds)
            found[kind][8] = (took[True], took[False])
            set_q6k_tiles(took[True] < took[False])
    if matrices and isa() == "avx512vnni":
        set_amx_rows(0)
        took = [_time_rounds(WIDE_CANDIDATES, set_wide_isa, matrices, rows, rounds) for rows in (4, 8)]
        found["wide"] = {8: tuple(sum(t[name] for t in took) for name in WIDE_CANDIDATES)}
        set_wide_isa(min(WIDE_CANDIDATES, key=lambda name: sum(t[name] for t in took)))  # ties: the first
        for kind in K_TYPES:  # each K type's 16-row tiles against the paths chosen above for each width
            mine = [m for m in matrices if m.type.name == kind]
            mine = mine[::4] if len(mine) >= 32 else mine
            if not mine:
                continue
            timed = {}
            for rows in WIDE16_WIDTHS:
                took = _time_rounds((rows, 0), lambda limit: set_wide16(limit, kind), mine, rows, rounds)
                timed[rows] = (took[rows], took[0])
            found.setdefault("wide16", {})[kind] = timed
            set_wide16(_widths_won(timed, WIDE16_WIDTHS), kind)
    if isa() == "avx512vnni" and amx_usable():
        set_amx_rows(0)  # every type off while another's tiles are timed
        for kind in K_TYPES:  # each K type's tiles against the wide set just chosen
            mine = [m for m in matrices if m.type.name == kind]
            mine = mine[::4] if len(mine) >= 32 else mine  # a big model's every fourth: ~5 s on all of the 1.5B's
            if not mine:
                continue
            found.setdefault("amx", {})[kind] = _choose_amx(kind, mine, rounds)
    if isa() == "avx512vnni" or (isa() != "scalar" and best_isa() != "avx512vnni"):  # the layout's readers run
        timed, distances = _choose_pack16(matrices, rounds)
        if timed:
            found["pack16"] = timed
        if distances:
            found["packed_prefetch"] = {1: distances}
        for kind in sorted(set(pack16_kinds()) & set(AMX_PACKED)) if amx_usable() else ():
            # the AVX tiles win up to more rows on the layout than on the file's: its AMX tiles timed again on it
            found.setdefault("amx_packed", {})[kind] = _choose_amx(kind, _packed_copies(_samples(matrices, kind)), rounds)
    else:
        set_pack16_kinds(())
    return found


def path_settings(kinds) -> dict:
    """What ``choose_paths`` set for the block types ``kinds`` (a model's), as plain values: the blocks backend stores
    it with the CPU, the kernel and the model's matrices, and a later load there restores it (``set_path_settings``)
    instead of timing again. Speed only: every path computes the same bits."""
    _require()
    kinds = set(kinds)
    return {"one_row": {k: v for k, v in one_row_limits().items() if k in kinds}, "prefetch": prefetch(),
            "narrow": narrow_isa(), "wide": wide_isa(), "q6k_tiles": q6k_tiles(), "packed_prefetch": packed_prefetch(),
            "wide16": {k: v for k, v in wide16_rows().items() if k in kinds},
            "amx": {k: v for k, v in amx_rows().items() if k in kinds} if amx_usable() else {},
            "pack16": sorted(set(pack16_kinds()) & kinds)}


def set_path_settings(settings: dict) -> None:
    """Apply what ``path_settings`` returned (on the same CPU and kernel; each setter checks its value). ValueError
    (naming the setting) for a record that does not fit this CPU or kernel: the caller times the paths again."""
    _require()
    try:
        for kind, rows in settings["one_row"].items():
            set_one_row_limit(kind, int(rows))
        set_prefetch(int(settings["prefetch"]))
        set_packed_prefetch(int(settings["packed_prefetch"]))
        for name, setter in (("narrow", set_narrow_isa), ("wide", set_wide_isa)):
            if settings[name] not in isas():
                raise ValueError(f"{name} instruction set {settings[name]!r} is not one this CPU runs")
            setter(settings[name])
        set_q6k_tiles(bool(settings["q6k_tiles"]))
        for kind, rows in settings["wide16"].items():
            set_wide16(int(rows), kind)
        if settings["amx"] and not amx_usable():
            raise ValueError("the record sends products to AMX tiles, which this CPU or OS does not give")
        for kind, rows in settings["amx"].items():
            set_amx_rows(int(rows), kind)
        set_pack16_kinds(settings["pack16"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a record of path_settings ({exc!r})") from exc


HUGE_PAGE = 2 << 20


def weight_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed uint8 memory for matrices the kernel streams through, advised to Linux as transparent huge
    pages (2 MB instead of 4 KB: a one-token pass reads every weight once, and with small pages it also walks ~250,000
    page-table entries, costly in a virtual machine; measured in docs/kernels.md). Where the advice is not available
    (another OS, THP switched off) it is plain memory. The tensor keeps the mapping alive."""
    size = nbytes + HUGE_PAGE  # room to start on a 2 MB boundary, where the kernel can back it with huge pages
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if hasattr(mmap, "MAP_ANONYMOUS") \
        else mmap.mmap(-1, size)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            area.madvise(advice)
        except OSError:  # THP not built into this kernel
            pass
    whole = torch.frombuffer(area, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start: start + nbytes]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x ** 2, -1) + eps))`` over the last dimension, in float32, as transformers' Llama and
    Qwen2 RMSNorm compute it, in one native call (six torch operations there). Each row's sum of squares is taken in
    a fixed order (``_native.cpp``), so a row's bits depend on that row alone."""
    _require()
    H = x.shape[-1]
    if weight.shape != (H,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous float32 vector of {H} values, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    y = torch.empty(x.shape, dtype=torch.float32)
    _native.rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // H, H, float(eps))
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in float32 with torch's bits where torch computes SiLU on its vectorized loop (ATen's
    kernel: ``x / (1 + exp(-x))``, exp by SLEEF's expf u10), on every instruction set alike: element by element, so
    each value's bits are its own. The blocks backend's native layers call it (``backends/block_step.py``, which checks
    it against ``F.silu`` once a process)."""
    _require()
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    gate, up = gate.float().contiguous(), up.float().contiguous()
    y = torch.empty(gate.shape, dtype=torch.float32)
    _native.silu_mul(gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``cos`` / ``sin`` [B, R, D] broadcast over x's heads (x [B, H, R, D],
    float32, its last dimension contiguous): transformers' rotary embedding of the Llama / Qwen2 form, in one native
    call with the same roundings (the same bits). Returns a new contiguous [B, H, R, D] tensor."""
    _require()
    B, H, R, D = x.shape
    if cos.shape != (B, R, D) and cos.shape != (1, R, D) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{B} or 1, {R}, {D}] for x {tuple(x.shape)}, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if x.dtype != torch.float32 or x.stride(3) != 1:
        x = x.float().contiguous()
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    cb = 0 if cos.shape[0] == 1 else R * D
    out = torch.empty(B, H, R, D, dtype=torch.float32)
    _native.rope(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(), cb, D,
                 out.data_ptr(), B, H, R, D)
    return out


def row_digests(values: torch.Tensor) -> list[bytes]:
    """A 16-byte digest of each row's exact bytes (a 2-D tensor, any dtype): equal rows give equal digests, and two
    different rows the same one with odds of about 2^-128 (xxHash64 rounds, ``_native.cpp``). For finding rows by
    value among millions (the blocks backend's load) at memory speed."""
    _require()
    if values.dim() != 2:
        raise ValueError(f"row_digests takes a 2-D tensor, not {values.dim()}-D")
    values = values.contiguous()
    rows, row_bytes = values.shape[0], values.shape[1] * values.element_size()
    out = torch.empty(rows, 16, dtype=torch.uint8)
    _native.row_hashes(values.data_ptr(), rows, row_bytes, out.data_ptr())
    flat = out.numpy().tobytes()
    return [flat[16 * i: 16 * i + 16] for i in range(rows)]


class Matrix:
    """One matrix checked once for many products (a decoding pass makes ~200: ``matmul``'s checks cost more than a
    small one's arithmetic): ``Matrix(blocks, kind, K)(x)`` is ``matmul(x, blocks, kind)``."""

    def __init__(self, blocks: torch.Tensor, kind: str | BlockType, in_features: int, packed: bool = False):
        _require()
        self.type = block_type(kind) if isinstance(kind, str) else kind
        _check(blocks, self.type, in_features)
        if packed and not can_pack16(self.type.name, blocks.shape[0]):
            raise ValueError(f"a {self.type.name} matrix of {blocks.shape[0]} rows cannot be read in the 16-row layout "
                             f"here (a multiple of 16 rows; Q5_K / Q6_K need AVX-512 VNNI, the other types AVX2: "
                             f"this CPU's best set is {best_isa()})")
        self.blocks, self.K, self.N, self.packed = blocks, in_features, blocks.shape[0], bool(packed)
        self._args = (self.type.ggml_id, blocks.data_ptr(), self.N, self.K, blocks.shape[1])
        self._next = (0, 0, 0)  # the matrix fetched ahead after each product (link)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kind, w, N, K, row_bytes = self._args
        if x.shape[-1] != K:
            raise ValueError(f"x has {x.shape[-1]} columns; this matrix multiplies {K}")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = torch.empty(x.shape[:-1] + (N,), dtype=torch.float32)
        _native.matmul(kind, x.data_ptr(), w, y.data_ptr(), x.numel() // K, N, K, row_bytes,
                       _threads or _held or default_threads(), *self._next, self.packed)
        return y


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, counts: torch.Tensor,
           index: torch.Tensor | None = None, scale: float | None = None, threads: int | None = None) -> torch.Tensor:
    """Causal attention computed one query row at a time, each over its own keys: row i of a pass gets the same bits
    whatever the other rows, the thread count or the instruction set (``attend_body.inc``).

    ``query`` [B, H, R, D], ``key`` / ``value`` [B, Hkv, L, D] float32 (H a multiple of Hkv: query head h reads KV
    head h // (H // Hkv)); row (b, r) sees ``counts[b, r]`` keys: the first ones, or those at ``index[b, r, :count]``
    in that order. Returns [B, R, H, D] (transformers' attention output layout)."""
    _require()
    B, H, R, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    if key.shape != value.shape or key.shape[0] != B or key.shape[3] != D or H % Hkv:
        raise ValueError(f"attention shapes do not match: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    if any(t.dtype != torch.float32 for t in (query, key, value)) or key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("attend needs float32 query, key and value with contiguous rows")
    counts = counts.to(torch.int32).reshape(B, R).contiguous()
    longest = int(counts.max())
    if int(counts.min()) < 1 or (index is None and longest > L):
        raise ValueError(f"each row must see 1..{L} keys (counts {counts.tolist()})")
    if index is not None:
        index = index.to(torch.int32).reshape(B, R, -1).contiguous()
        if index.shape[2] < longest or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= L)):
            raise ValueError(f"index must name each row's keys among the {L} columns")
    return attend_unchecked(query, key, value, counts, index, scale, threads)


def attend_unchecked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, counts: torch.Tensor,
                     index: torch.Tensor | None, scale: float | None, threads: int | None = None) -> torch.Tensor:
    """``attend`` without its checks, for callers whose inputs are built right: float32, contiguous rows, int32
    ``counts`` [B, R] and ``index`` [B, R, n] (the blocks backend's attention, ~30 calls a pass, where the checks cost
    more than a short row's arithmetic)."""
    B, H, R, D = query.shape
    Hkv = key.shape[1]
    q = query.contiguous()
    out = torch.empty(B, R, H, D, dtype=torch.float32)
    _native.attend(q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), B, H, Hkv, R, D, key.stride(0),
                   key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2), counts.data_ptr(),
                   0 if index is None else index.data_ptr(), 0 if index is None else index.shape[2],
                   float(D ** -0.5 if scale is None else scale), threads or _threads or _held or default_threads())
    return out


__all__ = ["TYPES", "Matrix", "attend", "attend_unchecked", "available", "best_isa", "block_type", "default_threads",
           "isa", "isas", "link", "lookahead", "matmul", "native_built", "pack16", "pack16_kinds", "prefetch", "rms_norm",
           "rope", "row_chunks", "row_digests", "set_isa", "silu_mul", "set_lookahead", "set_narrow_isa",
           "set_row_chunks", "set_pack16_kinds", "set_prefetch", "set_threads", "set_wide_isa", "threads_now",
           "why_unavailable", "narrow_isa", "wide_isa", "path_settings", "set_path_settings"]
