"""The blocks backend: the transformers model with every linear layer computed by verispec's native kernel on the GGUF
file's own quantized blocks (``verispec.blockmm``), its attention and Llama / Qwen2 RMSNorms on the same native module
(each row alone, in a fixed order); the KV cache and the rest of the step stay the transformers backend's.

A matrix is held as the file holds it (about the file's size, not 4x in float32): each ``nn.Linear`` whose rows the
file stores in a type the kernel multiplies becomes a ``BlockLinear`` over those rows' bytes. The model is built
straight from the file (``gguf_model``: transformers' own tensor names and per-architecture row reorderings, nothing
converted to float32 on disk). Where transformers' loader does more to a matrix than reorder its rows, the rows are
found by value instead (``on_blocks``: each row of the float32 conversion looked up among the file's dequantized
rows, ``verispec.backends.openvino.gguf_blocks.GGUFRows``). Matrices of other types (F16, Q2_K, ...) stay float32
linears and the load says so.

Numbers: activations are quantized per 32 values to int8 (as llama.cpp quantizes them) and every product is exact
integer arithmetic combined in one fixed order, so a row's logits do not depend on the pass width; attention runs
each row alone on the native kernel (``verispec.backends.hf.row_attention``), so a verify pass's rows are the bits of
one-token steps and greedy speculation equals plain decoding by construction. Quality against the file's float32
values and llama.cpp's: docs/kernels.md.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .. import blockmm
from . import block_layers, block_stack, measurements
from .block_layers import fusable
from .block_modules import BlockLinear, RowRMSNorm
from ..errors import InvalidRequest, ModelNotFound
from ..options import Option
from .gguf_model import NotRowOrder
from .hf.model import LoadedModel
from .references import is_gguf
from .registry import BackendSpec, register

log = logging.getLogger(__name__)


def swap_norms(model: nn.Module) -> int:
    """Replace each RMSNorm module of ``model`` that computes ``RowRMSNorm``'s formula with a ``RowRMSNorm``; which
    do is found by value (each candidate and its replacement on the same random rows, within float32 rounding), not
    by class name: Gemma's ``(1 + weight)`` norms keep their own. Returns how many were replaced."""
    swapped = 0
    probe = torch.Generator().manual_seed(0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not type(child).__name__.endswith("RMSNorm"):  # first: a BlockLinear's weight is dequantized on reading
                continue
            weight, eps = getattr(child, "weight", None), getattr(child, "variance_epsilon", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
                continue
            norm = RowRMSNorm(weight, eps)
            x = torch.randn(3, weight.shape[0], generator=probe)
            with torch.no_grad():
                if not torch.allclose(norm(x), child(x).float(), rtol=1e-5, atol=1e-6):
                    continue
            setattr(parent, name, norm)
            swapped += 1
    return swapped


@dataclass
class Swapped:
    """What ``swap_linears`` did: linear layers per block type, and those left float32 (with why)."""

    kinds: dict[str, int]
    left: list[str]

    def summary(self) -> str:
        held = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) or "no linear layer"
        left = f"; {len(self.left)} left float32 ({', '.join(self.left[:3])}{' ...' if len(self.left) > 3 else ''})"
        return f"{held} on the file's blocks" + (left if self.left else "")


def swap_linears(model: nn.Module, rows) -> Swapped:
    """Replace every ``nn.Linear`` of ``model`` whose rows ``rows`` (a ``GGUFRows``) holds in one supported block type
    with a ``BlockLinear`` over the file's bytes for those rows, in the matrix's row order (found by value)."""
    return place_linears(model, rows.raw, rows.kinds,
                         lambda name, linear: rows.locate(linear.weight.detach().float().numpy()))


def place_linears(model: nn.Module, raw, kinds, locate) -> Swapped:
    """Replace each ``nn.Linear`` of ``model`` (``name``: its qualified name) for which ``locate(name, linear)`` gives
    the file rows it holds (a list of (tensor, row), all of one supported block type) with a ``BlockLinear`` over
    those rows' bytes (``raw``: tensor -> uint8 [rows, bytes a row]; ``kinds``: tensor -> GGUF type). The matrices
    share one buffer in the order the layers run (``blockmm.weight_buffer``: huge pages where Linux offers them)."""
    done = Swapped({}, [])
    found = []  # (parent, name, linear, kind, places), in the modules' order
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            places = locate(f"{prefix}.{name}" if prefix else name, child)
            found_kinds = {kinds[t] for t, _ in places} if places else set()
            kind = found_kinds.pop() if len(found_kinds) == 1 else None
            if kind not in blockmm.TYPES:
                done.left.append(f"{name} ({kind or 'rows not in the file'})")
                continue
            found.append((parent, name, child, kind, places))
    sizes = [len(places) * raw[places[0][0]].shape[1] for *_, places in found]
    # each matrix starts on a page, but siblings that read the same input (q / k / v, gate / up) in one block type
    # follow one another with no gap: the decoder layers run them as one product over the joined rows (block_layers)
    starts, end = [], 0
    for i, (parent, name, child, kind, places) in enumerate(found):
        before = found[i - 1] if i else None
        joins = (before is not None and before[0] is parent and before[3] == kind
                 and before[2].in_features == child.in_features and fusable(parent, name) is not None
                 and fusable(parent, name) == fusable(parent, before[1]))
        starts.append(end if joins else _aligned(end))
        end = starts[-1] + sizes[i]
    buffer = blockmm.weight_buffer(_aligned(end))
    for (parent, name, child, kind, places), start, size in zip(found, starts, sizes):
        blocks = buffer[start: start + size].view(len(places), -1)
        # rows of one file tensor in order are one slice of it; a reordered matrix (a fused q/k/v split) is gathered
        for tensor in dict.fromkeys(t for t, _ in places):
            where = [i for i, (t, _) in enumerate(places) if t == tensor]
            picked = [r for t, r in places if t == tensor]
            run = picked == list(range(picked[0], picked[0] + len(picked)))  # a slice: read straight from the file
            part = raw[tensor][picked[0]: picked[0] + len(picked)] if run else raw[tensor][picked]
            blocks.numpy()[where] = part  # one copy, straight from the file's pages
        setattr(parent, name, BlockLinear(blocks, kind, child.in_features, child.bias))
        done.kinds[kind] = done.kinds.get(kind, 0) + 1
    return done


def _aligned(nbytes: int, to: int = 4096) -> int:
    return -(-nbytes // to) * to


_CPU = torch.device("cpu")


@dataclass
class BlocksModel(LoadedModel):
    """A ``LoadedModel`` whose linear layers run on the GGUF's blocks (``BlockLinear``)."""

    swapped: Swapped | None = None
    stack: block_stack.NativeStack | None = None  # the decoder layers in one native call, where the probe allowed
    gguf_path: str = ""  # the file a model built straight from it came from (its measurements' key)
    backend = "blocks"
    compiles_steps = False

    @property
    def device(self) -> torch.device:
        return _CPU  # the kernel's memory (the generic property walks the model's parameters on every pass)

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return head.out_features if isinstance(head, BlockLinear) else super().vocab_size

    @property
    def linear_kernel(self) -> str:
        isa = blockmm.isa() if blockmm.available() else "unavailable"
        paths = "".join(f"; {path}" for path in blockmm.paths_in_use(self.swapped.kinds if self.swapped else ()))
        return f"verispec block kernel ({isa}{paths})" + ("; native row attention" if self.width_invariant else "")

    def compile_step(self, cached_only: bool = False) -> bool:
        return False  # nothing compiled: the kernel is the step's cost

    def weights_source(self) -> str:
        return self.gguf_path or super().weights_source()

    @property
    def measurement_key(self) -> dict | None:
        key = super().measurement_key
        # the kernel's threads, not torch's (one during this model's passes): a curve timed on one thread is not two's
        return None if key is None else {**key, "threads": blockmm.default_threads()}

    def run_model(self, **inputs):
        # the stack serves this model only, not a view of it with layers left out (without_layers shares the field)
        if self.stack is not None and self.stack.model is self.model:
            out = self.stack(**inputs)
            if out is not None:
                return out
        return self.model(**inputs)

    # The kernel runs on its own threads; torch's ops between its calls (attention, norms) take one thread during
    # this model's passes, so the two pools never spin against each other on the same cores (they did: a pass took
    # 8x as long). Only during them: other models in the process keep torch's threads.
    def forward(self, *args, **kwargs):
        with _torch_threads(1):
            return super().forward(*args, **kwargs)

    def forward_batch(self, *args, **kwargs):
        with _torch_threads(1):
            return super().forward_batch(*args, **kwargs)


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with blockmm.threads_held():
            yield
    finally:
        torch.set_num_threads(before)


def load(ref: str, threads: int | None = None) -> BlocksModel:
    from .references import gguf_file

    reason = blockmm.why_unavailable()
    if reason:
        raise InvalidRequest(f"the blocks backend cannot run here: {reason}; use --backend llamacpp, openvino or "
                             "transformers")
    try:
        path = gguf_file(ref)
    except ModelNotFound as exc:
        raise InvalidRequest(f"the blocks backend runs GGUF files: {exc}") from exc
    if threads is not None:
        if threads < 1:
            raise InvalidRequest(f"threads must be >= 1, got {threads}")
        blockmm.set_threads(threads)
    try:
        model = from_file(ref, path)
    except NotRowOrder as exc:  # an architecture whose matrices transformers' loader rewrites: find rows by value
        log.warning("%s: %s; building the model from its float32 conversion instead", path.name, exc)
        from .hf import load as load_transformers
        from .openvino.gguf_blocks import GGUFRows

        model = on_blocks(load_transformers(ref, "float32", None, False, "off"), GGUFRows.read(path), name=path.name)
    log.info("%s: %s", ref, model.swapped.summary())
    return model


def from_file(ref: str, path) -> BlocksModel:
    """The model in GGUF file ``path`` built straight from it (``gguf_model``): its matrices the file's rows, never
    converted to float32 on disk."""
    from transformers import AutoTokenizer

    from .gguf_model import read
    from .references import ensure_tokenizer, transformers_progress_bars

    folder = ensure_tokenizer(ref)  # the file's tokenizer, converted once; its configuration is kept beside it
    with transformers_progress_bars(False):
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    file = read(path, cache=folder)
    swapped = place_linears(file.model, file.raw, file.kinds, file.locate)
    file.fill_rest()
    loaded = LoadedModel(model=file.model, tokenizer=tokenizer, name=ref, dtype=torch.float32, pack_requested=False)
    model = _finish(loaded, swapped, path.name)
    model.gguf_path = str(path)
    return model


def on_blocks(loaded: LoadedModel, rows, name: str = "the model") -> BlocksModel:
    """``loaded`` (a float32 transformers model whose matrices hold the file's values) with its linear layers on the
    file's blocks (``rows``, a ``GGUFRows``, found by value) and width-invariant attention."""
    return _finish(loaded, swap_linears(loaded.model, rows), name)


def _finish(loaded: LoadedModel, swapped: Swapped, name: str) -> BlocksModel:
    """``loaded``, its linear layers on blocks (``swapped``), with the native norms and width-invariant attention."""
    from .hf.row_attention import ROW_ATTENTION

    if not swapped.kinds:
        raise InvalidRequest(f"{name}: none of its matrices is in a block type the native kernel multiplies "
                             f"({', '.join(blockmm.TYPES)}); use --backend llamacpp or openvino")
    # rows independent of the pass width: the native row attention beside the row-invariant kernel, on
    # sliding-window layers too (each row over its window's keys: row_attention); soft-capped attention keeps SDPA
    _choose_paths(loaded.model)
    packed = _pack16(loaded.model)
    if packed:
        log.info("%s: %d matrices laid out 16 rows at a time", name, packed)
    norms = swap_norms(loaded.model)
    log.info("%s: %d RMSNorm layers on the native row kernel", name, norms)
    config = loaded.model.config
    invariant = not getattr(config, "attn_logit_softcapping", None)
    if invariant:
        loaded.model.set_attn_implementation(ROW_ATTENTION)
    lean = block_layers.install(loaded.model)
    fronts, whole = block_layers.native_fronts(loaded.model)
    log.info("%s: %d decoder layers on the lean forward (joined products, native rotary), %d with their attention "
             "half in one native call (%d of them the whole layer)", name, lean, fronts, whole)
    stack = block_stack.install(loaded.model)  # where every layer runs whole natively
    if stack is not None:
        log.info("%s: its %d decoder layers in one native call a pass", name, lean)
    blockmm.link(_matrices(loaded.model))
    return BlocksModel(model=loaded.model, tokenizer=loaded.tokenizer, name=loaded.name, dtype=torch.float32,
                       eos_token_ids=loaded.eos_token_ids, pack_requested=False, width_invariant=invariant,
                       swapped=swapped, stack=stack)


def _matrices(model: nn.Module) -> list[blockmm.Matrix]:
    """Every ``blockmm.Matrix`` a pass of ``model`` multiplies by: each ``BlockLinear``'s and the lean layers' joined
    products."""
    found = [m._matrix for m in model.modules() if isinstance(m, BlockLinear)]
    for module in model.modules():
        lean = module.__dict__.get("forward")
        if isinstance(lean, block_layers.LeanForward):
            found += [matrix for products in (lean.qkv, lean.gate_up) for matrix, _, _ in products.runs]
    return found


def _pack16(model: nn.Module) -> int:
    """Lay out in place, 16 rows at a time, each ``BlockLinear`` of a type ``blockmm.pack16_kinds`` names (the load's
    choice); before the lean layers join siblings' rows (a joined product reads one layout). Returns how many."""
    kinds = blockmm.pack16_kinds()
    done = 0
    for m in model.modules():
        if isinstance(m, BlockLinear) and m.kind.name in kinds and blockmm.can_pack16(m.kind.name, m.out_features):
            m.pack()
            done += 1
    return done


PATHS_RECORD = "block-paths"  # the measurement store's kind for choose_paths' choice


def _paths_key(matrices: list[blockmm.Matrix]) -> dict:
    """What choose_paths' choice depends on: the CPU and software (``measurements.machine``), the kernel build, its
    instruction set and threads, and the model's matrices (type and shape, in order)."""
    from ..blockmm import _native

    shapes = "|".join(f"{m.type.name}:{m.N}x{m.K}" for m in matrices)
    kinds = ", ".join(sorted({m.type.name for m in matrices}))
    return {**measurements.machine(), "what": f"block kernel paths for {len(matrices)} matrices ({kinds})",
            "kernel": measurements.file_fingerprint(_native.__file__), "isa": blockmm.isa(),
            "threads": blockmm.default_threads(), "matrices": hashlib.sha256(shapes.encode()).hexdigest()[:24],
            "v": 1}


def _choose_paths(model: nn.Module) -> None:
    """Pick the kernel's faster paths per block type on this model's own matrices (``blockmm.choose_paths``: seconds
    on 2 cores; the same bits either way), and log what was timed. The choice is stored (the measurement store:
    ``VERISPEC_COST_CACHE``, ``--no-cost-cache``) and a later load of a model of the same matrices on this CPU, kernel
    and thread count restores it instead of timing again."""
    matrices = [m._matrix for m in model.modules() if isinstance(m, BlockLinear)]
    kinds = {m.type.name for m in matrices}
    key = _paths_key(matrices) if matrices else None
    stored = measurements.load(PATHS_RECORD, key)
    if stored is not None:
        try:
            blockmm.set_path_settings(stored)
        except ValueError as exc:
            log.warning("ignoring the stored block kernel paths (%s); timing them again", exc)
        else:
            log.info("block kernel paths as timed before on this CPU (stored; VERISPEC_COST_CACHE=0 times them again)")
            return
    found = blockmm.choose_paths(matrices)
    measurements.save(PATHS_RECORD, key, blockmm.path_settings(kinds))
    for name, what, candidates, kept in (("prefetch", "one row", blockmm.PREFETCH_CANDIDATES, blockmm.prefetch()),
                                         ("packed_prefetch", "one row in the 16-row layout",
                                          blockmm.PACKED_PREFETCH_CANDIDATES, blockmm.packed_prefetch())):
        if name in found:  # the prefetch distances timed (0: none)
            took, = found.pop(name).values()
            log.info("block kernel, %s: %s a pass (%s kept)", what, ", ".join(
                f"prefetching {ahead} B ahead {ms:.1f} ms" if ahead else f"without prefetching {ms:.1f} ms"
                for ahead, ms in zip(candidates, took)), f"{kept} B" if kept else "off")
    if "narrow" in found:
        took, = found.pop("narrow").values()
        log.info("block kernel, 1 + 2 rows: %s a pass (%s kept)", ", ".join(
            f"{name} {ms:.1f} ms" for name, ms in zip(blockmm.NARROW_CANDIDATES, took)), blockmm.narrow_isa())
    if "wide" in found:
        took, = found.pop("wide").values()
        log.info("block kernel, 4 + 8 rows: %s a pass (%s kept)", ", ".join(
            f"{name} {ms:.1f} ms" for name, ms in zip(blockmm.WIDE_CANDIDATES, took)), blockmm.wide_isa())
    for kind, timed in found.pop("wide16", {}).items():
        kept = blockmm.wide16_rows()[kind]
        log.info("block kernel, %s on 16-row tiles: %s (%s)", kind, "; ".join(
            f"{rows} rows {on:.1f} ms against {off:.1f}" for rows, (on, off) in timed.items()),
            f"kept from {kept} rows" if kept else "not kept")
    for kind, timed in found.pop("pack16", {}).items():
        log.info("block kernel, %s laid out 16 rows at a time: %s (%s)", kind, "; ".join(
            f"{rows} row{'s' if rows > 1 else ''} {on:.1f} ms against {off:.1f}" for rows, (on, off) in timed.items()),
            "kept" if kind in blockmm.pack16_kinds() else "not kept")
    again = found.pop("amx_packed", {})  # the types laid out 16 rows at a time whose layout the tiles read too
    for kind, timed in found.pop("amx", {}).items():
        kept = blockmm.amx_rows()[kind]
        verdict = f"kept from {kept} rows" if kept else "not kept"
        rounds = [("the file's layout", timed, "timed again in the 16-row layout" if kind in again else verdict)]
        if kind in again:
            rounds.append(("the 16-row layout", again[kind], verdict))
        for layout, took, said in rounds:
            log.info("block kernel, %s on AMX tiles in %s: %s (%s)", kind, layout, "; ".join(
                f"{rows} rows {on:.1f} ms against {off:.1f}" for rows, (on, off) in took.items()), said)
    for kind, widths in found.items():
        log.info("block kernel, %s: %s", kind, "; ".join(
            f"{rows} rows: tiles {a:.1f} ms, buffered path {b:.1f} ms a pass" if rows > blockmm.ONE_ROW_MOST[kind] else
            f"{rows} row{'s' if rows > 1 else ''}: one-row path {a:.1f} ms, "
            f"{'tiles' if kind in blockmm.K_TYPES else 'buffered path'} {b:.1f} ms a pass"
            for rows, (a, b) in widths.items()))


# --backend auto's estimate of a pass before anything is timed, in the unit llama.cpp declares (the bytes a pass reads;
# backends.choice): each block type's bytes times its factor (the timed score a byte against llama.cpp's, whose passes
# of several tokens cost more), float32 bytes for matrices the kernel does not multiply. Fitted to the built-in files'
# timed scores (experiments/auto_scores.py, docs/kernels.md: "--backend auto weighs the blocks backend", and "the
# 32-weight types laid out 16 rows at a time"). The 32-weight types' factor depends on the CPU: on AVX-512 VNNI their
# matrices are laid out 16 rows at a time and their passes of several tokens cost little more than one (a Zen 4 timed
# blocks 0.40x / 0.41x / 0.75x llama.cpp's score on SmolLM2 / the 0.5B / Gemma 3, and ahead of OpenVINO on all three);
# elsewhere their wide passes cost more (on an AVX2 Zen 3 the kernel tied llama.cpp on them).
K_PER_BYTE = 0.63
PER_BYTE_32 = {"avx512vnni": 0.6, "other": 0.8}


def declared_cost(mix) -> float:
    """What ``--backend auto`` estimates a pass on a file holding ``mix`` (bytes per GGUF tensor type) costs here,
    before timing anything, in llama.cpp's unit."""
    from .references import float32_bytes

    per_32 = PER_BYTE_32["avx512vnni" if blockmm.best_isa() == "avx512vnni" else "other"]
    factor = {kind: K_PER_BYTE if kind in blockmm.K_TYPES else per_32 for kind in blockmm.TYPES}
    return sum(size * factor[kind] if kind in factor else float32_bytes({kind: size}) for kind, size in mix.items())


def arithmetic_floor(model, widths, context):
    """The products each pass runs, timed with their weights in cache (``block_floor``)."""
    from .block_floor import products_in_cache

    return products_in_cache(model, widths, context)


register(BackendSpec(
    "blocks",
    summary="verispec's native kernel on the GGUF file's own quantized blocks (row-invariant; attention in float32)",
    load=load,
    installed=lambda: blockmm.available(),
    runs_own_weights=is_gguf,
    preference=0.5,  # a tie goes to llama.cpp (faster to load), not to transformers (4x the memory)
    cost=declared_cost,
    arithmetic_floor=arithmetic_floor,
    options=(Option("threads", int, None, "the kernel's threads (default: the cores this process may use)"),),
))
