"""The OpenVINO backend: the target exported once to OpenVINO IR (``export``), run by OpenVINO's CPU plugin.

Each sequence owns an infer request, whose state holds its keys and values (f32 by default: OpenVINO's own default,
u8, rounds the cache and is lossy). The graph run is the export's ``verispec_model.xml``: it takes the 4-D additive
attention mask itself and returns every layer's hidden states beside the logits. Rollback never copies the cache:
rejected positions stay in the state but are masked out of attention while the positions fed to the model
(``position_ids``) stay logical, so the next pass sees exactly the kept prefix. When masked positions outgrow the
live ones the state is compacted (one gather, amortized over many steps). A token tree is the same mask with each
node seeing its ancestors only (``verispec.tree``); its accepted path stays alive after it (``OpenVINOKV.keep``);
hidden states (EAGLE heads) are read from the second output.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ...errors import InvalidRequest
from ...options import Option
from ...tree import tree_inputs
from ..base import BorrowedEmbeddings, TargetPass
from .export import (CHANGES_MODEL, VERISPEC_XML, export_dir, float_activations, gguf_source, import_openvino,
                     inference_precision)
from .paged import BlockPool, BoundInputs, PagedKV, paged_model, pass_inputs, static_shapes
from ..registry import BackendSpec, register
from .export import WEIGHTS
from .widths import STATIC_WIDTHS, choose_static_widths, parse_static_widths

log = logging.getLogger(__name__)
MASKED = np.float32(np.finfo(np.float32).min)  # the additive mask's value for a position not attended to

KV_PRECISIONS = ("f32", "f16", "bf16", "u8")
ATTENTION = ("paged", "masked")  # paged attention (default; chains), or the stateful graph's 4-D mask everywhere
class OpenVINOKV:
    """One sequence's cache: an infer request's state plus which of its physical positions are alive."""
    keeps_positions = True  # keep(start, positions) moves a tree's accepted path (KVCache)

    def __init__(self, model: "OpenVINOModel") -> None:
        self.model = model
        self.request = model.masked.create_infer_request()
        self.alive: list[int] = []  # physical index of each logical position
        self.mask = np.full(64, MASKED, dtype=np.float32)  # 0 where a physical position is alive, else MASKED
        self.physical = 0

    def __len__(self) -> int:
        return len(self.alive)

    def truncate(self, length: int) -> None:
        if length > len(self.alive):
            raise ValueError(f"cannot keep {length} positions of a cache holding {len(self.alive)}")
        self.mask[self.alive[length:]] = MASKED
        del self.alive[length:]

    def keep(self, start: int, positions: list[int]) -> None:
        """Keep the first ``start`` positions and then ``positions`` (ascending, each >= ``start``; a token tree's
        accepted path), drop the rest: only which physical positions are alive changes, nothing is copied (the kept
        nodes' keys were computed at the positions they now hold)."""
        if positions and (positions[0] < start or positions[-1] >= len(self.alive)):
            raise ValueError(f"cannot keep positions {positions} after {start} of a cache holding {len(self.alive)}")
        kept = self.alive[:start] + [self.alive[p] for p in positions]
        self.mask[sorted(set(self.alive[start:]) - set(kept))] = MASKED
        self.alive = kept

    def close(self) -> None:
        self.request = None
        self.alive, self.physical = [], 0

    def _grow(self, block: np.ndarray) -> np.ndarray:
        """The 4-D additive attention mask for a pass of ``n`` new positions whose mask among themselves is
        ``block`` [n, n] (causal, or a tree's); the new positions are marked alive."""
        n = block.shape[0]
        past, need = self.physical, self.physical + n
        if need > len(self.mask):
            grown = np.full(max(need, 2 * len(self.mask)), MASKED, dtype=np.float32)
            grown[:len(self.mask)] = self.mask
            self.mask = grown
        mask = np.empty((1, 1, n, need), dtype=np.float32)
        mask[0, 0, :, :past] = self.mask[:past]
        mask[0, 0, :, past:] = block
        self.mask[past:need] = 0
        self.alive.extend(range(past, need))
        self.physical = need
        return mask

    def _compact(self) -> None:
        """Drop the masked positions from the state (a gather of the live ones)."""
        keep = np.asarray(self.alive, dtype=np.int64)
        ov = self.model.ov
        for state in self.request.query_state():
            data = state.state.data
            state.state = ov.Tensor(np.ascontiguousarray(data[:, :, keep]))
        self.physical = len(keep)
        self.alive = list(range(self.physical))
        self.mask[:] = MASKED
        self.mask[:self.physical] = 0


class OpenVINOKVGroup:
    def __init__(self, model: "OpenVINOModel", capacity: int) -> None:
        self.model, self.capacity = model, capacity

    def new_kv(self) -> "OpenVINOKV | PagedKV":
        return self.model.new_kv()

    def copy_prefix(self, source: OpenVINOKV, target: OpenVINOKV, length: int) -> None:
        if len(target):
            raise ValueError("copy_prefix needs an empty target cache")
        if length > len(source):
            raise ValueError(f"the source holds {len(source)} positions, not {length}")
        if isinstance(source, PagedKV):
            target.reserve(length)
            used = -(-length // source.pool.size)
            source.pool.copy(source.blocks[:used], target.blocks[:used])
            target.length = length
            return
        keep = np.asarray(source.alive[:length], dtype=np.int64)
        ov = self.model.ov
        states = {s.name: s for s in target.request.query_state()}
        for state in source.request.query_state():
            states[state.name].state = ov.Tensor(np.ascontiguousarray(state.state.data[:, :, keep]))
        target._grow(np.zeros((length, length), dtype=np.float32))


class OpenVINOModel(BorrowedEmbeddings):
    backend = "openvino"
    supports_trees = True
    host_threads = 1  # torch's share while this backend's own threads run passes (base.host_threads)
    supports_features = True
    dtype = torch.float32

    @property
    def changed_model(self) -> str:
        return f"OpenVINO {self.weights} re-quantizes the weights (NNCF)" if self.weights in CHANGES_MODEL else ""

    def __init__(self, folder: Path, tokenizer, config, name: str, weights: str, threads: int,
                 kv_precision: str = "f32", eos_token_ids=frozenset(), embedding_model_loader=None,
                 attention: str = "paged", min_width: int | None = None,
                 static_widths: tuple[int, ...] | str | None = None) -> None:
        if attention not in ATTENTION:
            raise InvalidRequest(f"unknown OpenVINO attention {attention!r}; choose one of {', '.join(ATTENTION)}")
        self.ov = import_openvino()
        self.folder, self.tokenizer, self.config, self.name = folder, tokenizer, config, name
        self.weights, self.threads, self.kv_precision = weights, threads, kv_precision
        self.eos_token_ids = frozenset(eos_token_ids)
        self._core = self.ov.Core()
        self._properties = {"INFERENCE_NUM_THREADS": threads, "KV_CACHE_PRECISION": kv_precision,
                            "INFERENCE_PRECISION_HINT": inference_precision(weights),
                            "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, **float_activations()}
        self._masked = None
        self.pool: BlockPool | None = None
        # (hidden-state layers (none: ()), static width or None) -> an infer request on the pool's blocks
        self._paged_requests = {}
        self._bound: dict = {}  # (layers, static width) -> paged.BoundInputs
        self._paged_graphs = {}  # hidden-state layers -> the paged graph (dynamic shapes), read once
        if attention == "paged" and self._properties["INFERENCE_PRECISION_HINT"] == "bf16" and kv_precision != "bf16":
            log.info("paged attention computing in bf16 takes a bf16 KV cache only; %s runs the stateful graph", name)
            attention = "masked"
        if attention == "paged":
            try:
                self._paged_graphs[()] = paged_model(self._core, folder / VERISPEC_XML)
                compiled = self._core.compile_model(self._paged_graphs[()], "CPU", self._properties)
            except Exception as exc:  # an architecture the transformation does not know: the stateful graph runs
                log.warning("paged attention is not available for %s (%s); running the stateful graph", name, exc)
                attention = "masked"
            else:
                self.pool = BlockPool(self.ov, compiled)
                self._paged_requests[(), None] = self.pool.attach(compiled.create_infer_request())
        self.attention = attention
        if min_width is None:
            min_width = 1 if self.pool is None else 2
        if isinstance(min_width, bool) or not isinstance(min_width, int) or not 1 <= min_width <= 64:
            raise InvalidRequest(f"min_width is a whole number of tokens from 1 to 64, got {min_width!r}")
        # OpenVINO's CPU kernels compute a one-token pass another way than wider ones (its matmuls' one-row path,
        # dynamic quantization of int8/int4 activations), and rows of every pass of 2 or more tokens are bitwise equal
        # to each other (tests/test_openvino_backend.py checks it per format). With min_width 2 no pass runs
        # one token (a padding token is added, past the cache's length), so a position's logits never depend on
        # the width of the pass that computed them: greedy speculation is token-identical to plain decoding by
        # construction. fp32 too: its one-token rows differ in the last bits, and padding costs little (measured
        # in docs/openvino.md), so fp32 pads as the other formats do: identity is not left to chance.
        self.min_width = min_width if self.pool is not None else 1
        self._lock = threading.Lock()
        self.static_widths_auto = static_widths is None or static_widths == "auto"
        self.static_widths = self._static_widths(None if self.static_widths_auto else static_widths)
        self.static_timings_ms = None  # what auto measured (or found stored)
        if self.static_widths_auto:
            self.static_widths, self.static_timings_ms = choose_static_widths(self)
        for width in self.static_widths[:1]:  # plain decoding's; the others when a decoder prepares (or first used)
            self._paged_request((), width)
        compiled = self._paged_requests[(), None].get_compiled_model() if self.pool else self.masked
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
        self.width_invariant = self.pool is not None and self._probe_widths()
        if self.min_width > 1 and not self.width_invariant:
            log.warning("on this CPU OpenVINO's %s passes give a position other logits at other widths: greedy "
                        "speculation may part from plain decoding (--weights fp32 stays within ~1e-4)", weights)
        self._embedding_model, self._embedding_model_loader = None, embedding_model_loader
        if self.context_length != getattr(config, "max_position_embeddings", None):
            log.warning("%s has sliding-window layers, whose window the OpenVINO export does not apply: contexts are "
                        "limited to the window (%d tokens) here; --backend transformers or llamacpp runs longer ones",
                        name, self.context_length)

    def _static_widths(self, widths) -> tuple[int, ...]:
        """The pass widths a one-sequence pass is padded up to and run at by a graph of static shapes (none with
        the stateful graph; for None ``STATIC_WIDTHS`` at or above ``min_width``, which auto may add to)."""
        if self.pool is None:
            return ()
        if widths is None:
            widths = tuple(w for w in STATIC_WIDTHS if w >= self.min_width)
            fits = self._graphs_that_fit()
            if fits < len(widths):
                log.info("static pass widths %s left out: each graph holds ~%d MB of weights (a quarter of the free "
                         "memory fits %d)", widths[fits:], self._graph_bytes() >> 20, fits)
                widths = widths[:fits]
        widths = tuple(sorted(set(widths)))
        if any(isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 64 for w in widths):
            raise InvalidRequest(f"static widths are whole numbers of tokens from 1 to 64, got {widths!r}")
        if widths and widths[0] < self.min_width:
            raise InvalidRequest(f"static width {widths[0]} is below min_width {self.min_width}: a pass that narrow "
                                 "never runs; drop it or lower min_width")
        return widths

    def _graph_bytes(self) -> int:
        """About what one more compiled graph holds: the CPU plugin keeps each graph's own copy of the weights in its
        layout, about the weights file in fp32 and up to twice it in int8/int4 (measured in docs/openvino.md)."""
        size = (self.folder / VERISPEC_XML).with_suffix(".bin").stat().st_size
        return int(1.1 * size) if self.weights == "fp32" else 2 * size

    def _graphs_that_fit(self) -> int:
        """How many static graphs a quarter of the free memory holds."""
        return available_memory() // 4 // self._graph_bytes()

    def _bucket(self, n: int) -> int | None:
        """The static width a one-sequence pass of ``n`` tokens runs at, or None (the dynamic graph)."""
        n = max(n, self.min_width)
        return next((w for w in self.static_widths if w >= n), None)

    def _probe_widths(self) -> bool:
        """Whether a pass of 8 tokens (or one past the widest static graph: the dynamic graph runs it) gives each
        position the very logits that one-token steps (padded to ``min_width``) give it, on this CPU and build:
        checked at load (9-12 passes)."""
        start = max(self.static_widths, default=3) + 1  # a prefill on the dynamic graph (no static one compiled)
        wide = max(8, start)
        ids = [(7 * i + 3) % self.vocab_size for i in range(start + wide)]
        kv = self.new_kv()
        self.forward(kv, ids[:start], last_only=True)
        wide = self.forward(kv, ids[start:]).logits
        kv.truncate(start)
        steps = torch.cat([self.forward(kv, [t]).logits for t in ids[start:]])
        kv.close()
        return torch.equal(wide, steps)

    @property
    def openvino_core(self):
        """The ``openvino.Core`` this model's graphs are compiled in (a drafter's graphs join it)."""
        return self._core

    @property
    def masked(self):
        """The stateful graph with the 4-D mask (token trees; every pass where paged attention is off), compiled on
        first use."""
        if self._masked is None:
            self._masked = self._core.compile_model(str(self.folder / VERISPEC_XML), "CPU", self._properties)
        return self._masked

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def context_length(self) -> int | None:
        """The model's context; for a model with sliding-window layers (Gemma 3), at most the window: the export's
        attention does not apply the window, which within it changes nothing, so longer contexts are refused with
        this length rather than computed wrong."""
        limit = getattr(self.config, "max_position_embeddings", None)
        window = getattr(self.config, "sliding_window", None)
        if window and "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            limit = min(limit, window) if limit else window
        return limit

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def kernel(self) -> str:
        from openvino import get_version

        return (f"OpenVINO {get_version().split('-')[0]} ({self.weights} weights, {self.inference_precision} "
                f"inference, {self.kv_precision} KV cache, {self.attention} attention"
                f"{', passes of 2+ tokens' if self.min_width > 1 else ''}"
                f"{', width-invariant' if self.width_invariant else ''}"
                f"{', static widths ' + '/'.join(map(str, self.static_widths)) if self.static_widths else ''}"
                f"{' (auto)' if self.static_widths_auto else ''}, "
                f"{self.threads} threads)")

    @property
    def cost_key(self) -> object:
        return self

    @property
    def measurement_key(self) -> dict:
        from openvino import get_version

        from .. import measurements

        return {**measurements.machine(), "backend": self.backend, "model": self.folder.name, "weights": self.weights,
                "threads": self.threads, "kv": self.kv_precision, "attention": self.attention,
                "min_width": self.min_width, "static_widths": list(self.static_widths),
                "openvino": get_version()}

    def new_kv(self, trees: bool = False) -> "OpenVINOKV | PagedKV":
        """A sequence's cache: blocks of the paged graph, or with ``trees`` (or paged attention off) the stateful
        graph's state, whose 4-D mask lets a token tree's nodes see their ancestors only."""
        if trees or self.pool is None:
            return OpenVINOKV(self)
        return PagedKV(self.pool)

    def new_kv_group(self, capacity: int) -> OpenVINOKVGroup:
        return OpenVINOKVGroup(self, capacity)

    def pass_width(self, widths) -> int:
        """The tokens a pass computes: a lone row padded to its static width where one fits; else no padding
        either way (the paged graph takes ragged rows in one pass; the stateful graph runs rows one after another,
        one infer request each) but a row of one token padded to ``min_width``."""
        bucket = self._bucket(widths[0]) if len(widths) == 1 else None
        if ((), bucket) not in self._paged_requests:  # not compiled: ``_paged`` runs it on the dynamic graph
            bucket = None
        return bucket if bucket is not None else sum(max(w, self.min_width) for w in widths)

    def forward(self, kv: "OpenVINOKV | PagedKV", tokens, *, parents=None, last_only: bool = False,
                feature_layers=()) -> TargetPass:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("forward needs at least one token")
        start, n = len(kv), len(tokens)
        if self.context_length and start + n > self.context_length:
            raise InvalidRequest(f"{start + n} positions exceed the model's context of {self.context_length}")
        if isinstance(kv, PagedKV):
            if parents is not None:
                raise ValueError("a token tree needs a cache made with new_kv(trees=True) (paged attention is causal)")
            return self._paged([(kv, tokens)], last_only, feature_layers)[0]
        if parents is None:
            block = _causal(n)
            positions = np.arange(start, start + n, dtype=np.int64)[None]
        else:
            fed = n - len(parents)
            tree_positions, tree_mask = tree_inputs(0, fed, list(parents), torch.float32)
            block = tree_mask[0, 0].numpy()
            positions = tree_positions.numpy().astype(np.int64) + start
        with self._lock:
            if kv.physical - start > max(64, start):
                kv._compact()
            # outputs shared, not copied: only the rows asked for are copied out below
            out = kv.request.infer({
                "input_ids": np.asarray([tokens], dtype=np.int64), "attention_mask": kv._grow(block),
                "position_ids": positions, "logit_rows": _rows(n, last_only), "beam_idx": np.zeros(1, dtype=np.int32)},
                share_outputs=True)
            logits = torch.from_numpy(np.array(out["logits"][0], dtype=np.float32))
            hidden = None
            if feature_layers:
                hidden = torch.from_numpy(np.array(out["hidden_states"][0][:, list(feature_layers)], dtype=np.float32))
        return TargetPass(logits, hidden)

    def forward_batch(self, items, *, feature_layers=()) -> list[TargetPass]:
        items = [(kv, [int(t) for t in tokens]) for kv, tokens in items]
        if items and all(isinstance(kv, PagedKV) for kv, _ in items):
            if any(not tokens for _, tokens in items):
                raise ValueError("forward_batch needs at least one token per item")
            longest = max(len(kv) + len(tokens) for kv, tokens in items)
            if self.context_length and longest > self.context_length:
                raise InvalidRequest(f"{longest} positions exceed the model's context of {self.context_length}")
            return self._paged(items, False, feature_layers)
        return [self.forward(kv, tokens, feature_layers=feature_layers) for kv, tokens in items]

    def prepare(self, feature_layers=(), width: int | None = None, trees: bool = False) -> None:
        """Compile now the graphs a decoder's passes of up to ``width`` tokens (None: any) will run: the static widths
        that cover them and, for a drafter that reads hidden states (EAGLE), the graphs returning ``feature_layers``
        (the dynamic one too); with ``trees``, the stateful graph its tree caches run on. Each costs ~1.3 s on the
        default model, which the first requests would otherwise wait for mid-answer; the load compiles only the
        narrowest static width (plain decoding's)."""
        if trees or self.pool is None:
            with self._lock:
                self.masked  # noqa: B018 - compiled on first use
            return
        limit = None if width is None else self._bucket(width) or width  # the widest static graph such passes run
        widths = [w for w in self.static_widths if limit is None or w <= limit]
        with self._lock:
            self._paged_requests_for([(layers, w) for layers in {(), tuple(feature_layers)}
                                      for w in ([None] if layers else []) + widths])  # None: prefills, longer passes

    def _paged_request(self, layers: tuple[int, ...], width: int | None = None):
        """The paged graph's infer request for the hidden states of ``layers`` (none: the graph chains run), of
        static shapes for one sequence of ``width`` tokens or dynamic (None), each compiled on first use."""
        if (layers, width) not in self._paged_requests:  # every pass asks: the common case is one lookup
            self._paged_requests_for([(layers, width)])
        return self._paged_requests[layers, width]

    def _paged_requests_for(self, keys: list[tuple[tuple[int, ...], int | None]]) -> None:
        """Compile the graphs of ``keys`` ((layers, width) as for ``_paged_request``), two at a time: the CPU
        plugin compiles a graph mostly on one core, so two at a time take about two thirds of the time one after
        another does (docs/openvino.md), and attach their infer requests; those compiled already are left as they
        are."""
        keys = [key for key in dict.fromkeys(keys) if key not in self._paged_requests]
        for layers in {layers for layers, _ in keys} - set(self._paged_graphs):
            self._paged_graphs[layers] = paged_model(self._core, self.folder / VERISPEC_XML, layers)

        def compiled(key):
            layers, width = key
            # a clone shares the graph's constants: the CPU plugin then keeps ~130 MB per static width rather than
            # ~220 (int4, the default model)
            graph = self._paged_graphs[layers] if width is None else static_shapes(self._paged_graphs[layers].clone(),
                                                                                    width)
            return self._core.compile_model(graph, "CPU", self._properties)

        if len(keys) > 1:
            with ThreadPoolExecutor(2, thread_name_prefix="verispec-openvino-compile") as pool:
                programs = list(pool.map(compiled, keys))
        else:
            programs = [compiled(key) for key in keys]
        for key, program in zip(keys, programs):
            self._paged_requests[key] = self.pool.attach(program.create_infer_request())

    def _paged(self, items, last_only: bool, feature_layers) -> list[TargetPass]:
        """One pass of the paged graph over every item's new tokens (one sequence each): a single sequence whose
        tokens fit a static width runs padded to it on that width's static graph, once compiled (``prepare``; the
        load compiles the narrowest); until then on the dynamic graph, so a short prompt's prefill never waits for a
        compile (~1.3 s) nor keeps a graph its decoder would not run."""
        layers = tuple(feature_layers)
        with self._lock:
            width = self._bucket(len(items[0][1])) if len(items) == 1 else None
            if (width is not None and (layers, width) not in self._paged_requests
                    and (layers, None) in self._paged_requests):
                width = None  # a static graph nobody prepared (a short prompt's prefill): the dynamic one, no compile
            inputs, rows, offsets, picks = pass_inputs(items, last_only, width or self.min_width, width is not None)
            request = self._paged_request(layers, width)
            if width is None:
                out = request.infer(inputs, share_inputs=True, share_outputs=True)
                logits = out["logits"]  # the infer request's own memory: each item copies only the rows it asked for
                hidden = out["hidden_states"] if feature_layers else None
            else:  # a static graph: its inputs bound once (paged.BoundInputs)
                bound = self._bound.get((layers, width))
                if bound is None or bound.request is not request:
                    bound = self._bound[layers, width] = BoundInputs(self.ov, request)
                bound.run(inputs)
                logits = bound.output("logits")
                hidden = bound.output("hidden_states") if feature_layers else None
            for kv, tokens in items:
                kv.length += len(tokens)  # a padding token stays past the length: written over by the next pass
            passes, row = [], 0
            for (_, tokens), picked, start, pick in zip(items, rows, offsets, picks):
                item_logits = torch.from_numpy(np.array(logits[row:row + len(picked), 0][pick], dtype=np.float32))
                item_hidden = None
                if hidden is not None:
                    item_hidden = torch.from_numpy(np.array(hidden[start:start + len(tokens), 0], dtype=np.float32))
                passes.append(TargetPass(item_logits, item_hidden))
                row += len(picked)
        return passes


def _rows(n: int, last_only: bool) -> np.ndarray:
    """The rows the graph computes logits at: the last one, or all ``n``."""
    return np.array([n - 1], dtype=np.int64) if last_only else np.arange(n, dtype=np.int64)


_CAUSAL: dict[int, np.ndarray] = {}


def available_memory() -> int:
    """Bytes of memory free for new allocations (Linux: MemAvailable; elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40  # unknown: no limit from here


def _causal(n: int) -> np.ndarray:
    """The additive causal mask among ``n`` new positions."""
    if n not in _CAUSAL:
        _CAUSAL[n] = np.where(np.tri(n, dtype=bool), np.float32(0), MASKED).astype(np.float32)
    return _CAUSAL[n]


AUTO_RECORD = "openvino-weights"  # the kind of record auto's timings are stored as (verispec.backends.measurements)


def auto_candidates() -> tuple[str, ...]:
    """What ``auto`` chooses between: the formats within half precision of the exported weights: fp32, fp16 (weights
    stored in half precision, computed in f32; the llama.cpp backend's ``auto`` weighs its f16 the same way) and
    bf16 compute where the CPU has it (a coarser rounding than fp16's). int8 and int4 quantize further and stay an
    explicit choice. Which is fastest differs from CPU to CPU more than the bytes each reads would say
    (docs/openvino.md), so ``auto`` measures rather than assumes."""
    from .export import import_openvino

    has_bf16 = "BF16" in import_openvino().Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return ("fp32", "fp16", "bf16") if has_bf16 else ("fp32", "fp16")


def choose_weights(ref: str, threads: int, kv_precision: str | None, attention: str = "paged"
                   ) -> tuple[str, dict | None]:
    """``--weights auto`` on OpenVINO: the candidate whose measured pass costs promise the most tokens/s for
    speculation here (``timing.auto_score``), stored per model, CPU, threads and versions; timed where none is. On a
    GGUF source its own blocks (as-is) are a candidate too."""
    from openvino import get_version

    from .. import measurements, timing

    candidates = auto_candidates()
    if gguf_source(ref) is not None:  # the file's own blocks: the model itself, usually the fewest bytes a pass
        candidates = ("as-is", *candidates)
    key = {**measurements.machine(), "model": export_dir(ref, "fp32").name, "threads": threads, "kv": kv_precision,
           "openvino": get_version(), "candidates": list(candidates), "attention": attention,
           "v": 3}  # 3: fp32 pads one-token passes too, and passes are timed on the static graphs decoders run
    known = measurements.load(AUTO_RECORD, key)
    if known is None:
        timings, skipped = {}, {}
        for fmt in timing.candidates_bar(candidates):
            crashed = format_crashes(ref, fmt, threads, kv_precision, attention)
            if crashed:  # a compile or pass that kills its process (bf16 on an Intel Xeon with AMX): not weighed
                skipped[fmt] = crashed
                continue
            model = load(ref, fmt, threads, kv_precision, attention)
            timings[fmt] = timing.time_widths(model)
            del model
        if not timings:
            raise InvalidRequest(f"every OpenVINO format crashed on this CPU: {skipped}")
        known = {"timings_ms": timings, "choice": min(timings, key=lambda f: timing.auto_score(timings[f])),
                 **({"skipped": skipped} if skipped else {})}
        measurements.save(AUTO_RECORD, key, known)
    return known["choice"], known["timings_ms"]


def format_crashes(ref: str, weights: str, threads: int, kv_precision: str | None, attention: str) -> str:
    """Why loading ``ref`` in ``weights`` and running a pass kills a child process on this CPU ("" when it does not;
    ``verispec.backends.probe``, once per CPU, OpenVINO version, model and format)."""
    from openvino import get_version

    from ..probe import probe

    code = (f"from verispec.backends.openvino.model import load\n"
            f"m = load({ref!r}, {weights!r}, {threads}, {kv_precision!r}, {attention!r}, static_widths=(), "
            f"probe=False)\n"
            f"m.forward(m.new_kv(), [1, 2, 3, 4])\n")
    key = {"openvino": get_version(), "model": export_dir(ref, "fp32").name, "weights": weights, "threads": threads,
           "kv": kv_precision, "attention": attention}
    result = probe(f"OpenVINO {weights}", key, code)
    return "" if result.ok else result.reason


def default_kv(weights: str) -> str:
    """The KV cache's precision unless asked: f32 for fp32 weights (the exact configuration); bf16 where the model
    computes in bf16 (OpenVINO's paged attention kernel takes no other there); f16 for the rounded weight formats
    (fp16, int8, int4), whose passes then read half the cache (cheaper wide passes on long contexts, docs/openvino.md)
    and stay width-invariant. OpenVINO's own default, u8, is never chosen."""
    return {"fp32": "f32", "bf16": "bf16"}.get(weights, "f16")


def load(ref: str, weights: str = "as-is", threads: int | None = None, kv_precision: str | None = None,
         attention: str = "paged", min_width: int | None = None,
         static_widths: tuple[int, ...] | str | None = None, probe: bool = True) -> OpenVINOModel:
    """A model reference exported once to OpenVINO (see ``verispec.load_model``); ``weights="auto"`` times fp32,
    fp16 and bf16 (where the CPU has it) once and runs the fastest for speculation. ``kv_precision`` defaults to
    ``default_kv(weights)``; ``attention="masked"`` runs the stateful graph for every pass (paged attention, the
    default, runs chains and batches; token trees run the stateful graph either way); ``min_width`` 2 (the default)
    pads one-token passes so that greedy speculation is bitwise identical to plain decoding (1 runs them unpadded;
    see ``OpenVINOModel``); ``static_widths`` are the widths one-sequence passes are padded up to and run on
    graphs of static shapes (default, or ``"auto"``: ``STATIC_WIDTHS``, and ``widths.AUTO_STATIC_EXTRA`` too where they
    measure cheaper on this CPU; ``()``: the dynamic graph runs every pass). bf16, which OpenVINO compiles with
    kernels that have killed the process on some CPUs, is first run in a child (``format_crashes``) unless ``probe``
    is False (that child's own load)."""
    from transformers import AutoConfig, AutoTokenizer

    from ..hf.model import _eos_ids
    from ..llamacpp import default_threads
    from ..references import transformers_progress_bars

    if kv_precision is not None and kv_precision not in KV_PRECISIONS:
        raise InvalidRequest(f"unknown KV precision {kv_precision!r}; choose one of {', '.join(KV_PRECISIONS)}")
    threads = threads or default_threads()
    timings = None
    if weights == "as-is" and gguf_source(ref) is None:
        weights = "fp32"  # a transformers folder's own weights are its float32 ones
    if weights == "auto":
        weights, timings = choose_weights(ref, threads, kv_precision, attention)
        log.info("weights auto -> %s (%s)", weights, timings)
    kv_precision = kv_precision or default_kv(weights)
    if weights == "bf16" and probe:
        crashed = format_crashes(ref, weights, threads, kv_precision, attention)
        if crashed:
            raise InvalidRequest(f"OpenVINO's bf16 compute kills its process on this CPU ({crashed}, seen in a child "
                                 "process); use --weights fp32 or fp16 (auto skips bf16 here)")
    folder = export_dir(ref, weights)
    with transformers_progress_bars(False):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = None
    holder = type("Holder", (), {"generation_config": generation, "config": config})()

    def embedding_model():
        from ..hf import load as load_transformers

        return load_transformers(ref, pack=False).model

    model = OpenVINOModel(folder, tokenizer, config, ref, weights, threads, kv_precision, _eos_ids(holder, tokenizer),
                          embedding_model, attention, min_width, static_widths)
    model.weight_timings_ms = timings
    return model


WEIGHT_ALIASES = {"f32": "fp32", "f16": "fp16"}  # llama.cpp's names for the same formats


def _load(ref: str, weights: str = "as-is", threads: int | None = None, static_widths=None,
          min_width: int | None = None, kv_precision: str | None = None, attention: str = "paged") -> OpenVINOModel:
    if isinstance(static_widths, str):  # from the command line, a serve option or a bench spec ("2+4+6" there)
        static_widths = parse_static_widths(static_widths, "+" if "+" in static_widths else ",")
    return load(ref, WEIGHT_ALIASES.get(weights, weights), threads, kv_precision, attention, min_width, static_widths)


def _runs_locally(ref: str) -> bool:
    from ..references import BUILTINS

    return ref in BUILTINS or Path(ref).expanduser().exists()


# OpenVINO holds a K-quant file's blocks as u4 / u8 groups with float32 scales (Q6_K's per 16 weights), which its CPU
# kernels run several times slower a byte than the 32-weight types' (docs/backends.md, "How auto chooses"): auto's estimate of a
# pass counts those bytes four times.
SLOW_TYPES = {"Q4_K": 4.0, "Q5_K": 4.0, "Q6_K": 4.0}


def _cost(mix) -> float:
    return sum(size * SLOW_TYPES.get(name, 1.0) for name, size in mix.items())


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


register(BackendSpec(
    "openvino",
    summary="OpenVINO on the model exported once (a GGUF's own quantized blocks): every drafter, trees included",
    load=_load,
    install='pip install "verispec[openvino]"',
    installed=_installed,
    runs_own_weights=_runs_locally,
    preference=2,
    cost=_cost,
    options=(
        Option("weights", str, "as-is", "as-is (default; a GGUF's own quantized blocks, a transformers folder's "
               "float32 weights), fp32, bf16 (fp32 weights computed in bfloat16, where the CPU has it), fp16, int8 "
               "or int4 (NNCF: these two re-quantize, a changed model), auto (the fastest of fp32, fp16 and bf16 here)",
               choices=(*WEIGHTS, "auto", *WEIGHT_ALIASES), metavar="FORMAT"),
        Option("threads", int, None, "CPU threads (default: the cores this process may use)"),
        Option("static_widths", str, None, "a one-sequence pass of up to the largest of these widths is padded to "
               "the next of them and runs on a graph of static shapes (default auto: 1,2,4,6, and 8,10 too where "
               "passes of 7-10 tokens measure cheaper on them, timed once per CPU; none: every pass on the dynamic "
               "graph). Static graphs cost load time and memory; measurements: docs/openvino.md",
               metavar="W,W,...|none|auto"),
        Option("min_width", int, None, "passes of fewer tokens are padded to it (default 2: greedy speculation is "
               "bitwise plain decoding)", exposed=False),
        Option("kv_precision", str, None, "the KV cache's element type (default: the weights' own)", exposed=False),
        Option("attention", str, "paged", "paged (chains and batches) or masked (the stateful graph for every pass)",
               exposed=False, choices=("paged", "masked")),
    ),
))
