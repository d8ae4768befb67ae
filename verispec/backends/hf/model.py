"""The transformers backend's model: a PyTorch causal LM with its tokenizer behind ``TargetModel``
(``verispec.backends.base``), with its KV caches (``.cache``), compiled passes (``.compiled``), layer-skipping views
(``.layers``) and width-invariant bfloat16 passes (``.invariant``). ``load`` in ``verispec.backends.hf`` builds it."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ...errors import InvalidRequest
from ...hidden_states import select_layers
from ...tree import tree_inputs
from .. import measurements
from ..base import TargetModelBase, TargetPass
from ..torch_cpu.cpu import linear_kernel
from .cache import BatchKV, RowKV, TorchKV
from .compiled import VERIFY_WIDTHS, CompiledStep, FixedKV
from .invariant import keys_by_layer
from .layers import decoder_layers, skipping_view
from .masks import for_layers

log = logging.getLogger(__name__)

COMPILED_VERIFY_ENV = "VERISPEC_COMPILED_VERIFY"  # 0 / 1: verify passes eager / compiled (default: if memory allows)
SWITCHED_OFF = ("0", "false", "no", "off")  # how an environment switch is turned off (or on, below)
SWITCHED_ON = ("1", "true", "yes", "on")


@dataclass
class LoadedModel(TargetModelBase):
    """A transformers causal LM with its tokenizer: the transformers backend of ``verispec.backends.base.TargetModel``."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    dtype: torch.dtype = torch.float32
    eos_token_ids: frozenset[int] | None = None  # None: read from the generation config and tokenizer
    packed_layers: int = 0  # linear layers whose weights are prepacked for oneDNN (verispec.backends.torch_cpu.packing)
    pack_requested: bool = True  # packing was asked for (False: VERISPEC_PACK=0 or pack=False)
    compiles_steps = True
    step: CompiledStep | None = None  # compiled one-token step (``compile_step``), or None: every pass eager
    verify: CompiledStep | None = None  # compiled verify passes of VERIFY_WIDTHS tokens (``compile_step``), or None
    _verify_thread: threading.Thread | None = field(default=None, init=False, repr=False, compare=False)
    skipped_layers: tuple[int, ...] = ()  # decoder layers this model leaves out (a view made by ``without_layers``)
    width_invariant: bool = False  # bfloat16 passes whose rows do not depend on the width (hf.invariant)
    backend = "transformers"
    supports_trees = True
    supports_features = True
    supports_layer_skipping = True

    def __post_init__(self) -> None:
        if self.eos_token_ids is None:
            self.eos_token_ids = frozenset(_eos_ids(self.model, self.tokenizer))
        self.model.eval()

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's size when the embedding is padded)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def cost_key(self) -> object:
        return self.model

    @property
    def kernel(self) -> str:
        return self.linear_kernel

    @property
    def cost_state(self) -> object:
        return (self.step is not None, self.verify is not None)

    @property
    def programs_loading(self) -> bool:
        return self._verify_thread is not None and self._verify_thread.is_alive()

    def weights_source(self) -> str:
        """Where the weights came from (a folder, file or hub id), for measurement keys; empty when unknown."""
        return str(self.model.config._name_or_path or "")

    @property
    def measurement_key(self) -> dict | None:
        """What a pass's cost depends on here (``verispec.backends.measurements``); None for a model that was not
        loaded from a folder or the hub (its costs are never stored)."""
        source = self.weights_source()
        if not source or self.skipped_layers:  # a view's costs belong to the drafter using it, not to the model
            return None
        model = measurements.file_fingerprint(source) if Path(source).exists() else source
        return {**measurements.machine(), "backend": self.backend, "model": model, "dtype": str(self.dtype),
                "device": str(self.device), "compiled": self.step is not None,
                "compiled_verify": self.verify is not None, "kernel": self.linear_kernel,
                "attention": getattr(self.model.config, "_attn_implementation", None),
                "threads": torch.get_num_threads()}

    @property
    def embedding_model(self) -> torch.nn.Module:
        return self.model

    @property
    def num_layers(self) -> int:
        """Decoder layers this model runs."""
        return len(decoder_layers(self.model))

    def without_layers(self, skip) -> "LoadedModel":
        """This model with the decoder layers ``skip`` (indices) left out: a view sharing every weight, run eagerly,
        with KV caches of its own (``verispec.backends.hf.layers``); a self-speculative draft model."""
        if self.skipped_layers:
            raise ValueError("without_layers is taken from the whole model, not from a view of it")
        skip = tuple(sorted(set(skip)))
        view = skipping_view(self.model, skip)
        return replace(self, model=view, name=f"{self.name} without layers {','.join(map(str, skip))}", step=None,
                       verify=None, skipped_layers=skip)

    def new_kv(self, trees: bool = False) -> TorchKV | FixedKV:
        return FixedKV() if self.step is not None else TorchKV()

    def compile_step(self, cached_only: bool = False) -> bool:
        """Use the compiled passes (``verispec.backends.hf.compiled``): the one-token step and the verify program for
        passes of ``VERIFY_WIDTHS`` tokens; each loaded from the compile cache on disk (seconds), else compiled now
        and stored (about two minutes each on a 2-core CPU for the default model). With ``cached_only`` nothing is
        compiled: returns whether a stored step was found, and a stored verify program loads in a background thread
        (``wait_compiled``) so that decoding starts as soon as the step is there. Returns False, with a warning,
        where compiling the step fails (no C++ compiler, an unsupported operator, ...): decoding then stays eager; a
        verify program that fails leaves verify passes eager. The verify program holds its own copy of the weights
        (measured: ~4x their size at peak while it loads), so it is used where that fits in half the available
        memory (``verify_memory``), or always / never with VERISPEC_COMPILED_VERIFY=1 / 0."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise InvalidRequest(f"the compiled one-token step is for float32 on CPU (what it was measured on), not "
                                 f"{str(self.dtype).removeprefix('torch.')} on {self.device.type}; drop --compile")
        step = self._compiled((1, 1), cached_only)
        if step is None:
            return False
        self.step = step
        if self.verify is None and self._verify_wanted():
            if cached_only:
                # not a daemon: a process that ends while the program loads waits for it (~2 s) rather than
                # leave C++ loading code running into the interpreter's shutdown (it aborted the process)
                self._verify_thread = threading.Thread(target=self._load_verify, name="verispec-load-verify",
                                                       daemon=False)
                self._verify_thread.start()
            else:
                self.verify = self._compiled(VERIFY_WIDTHS, cached_only)
        return True

    def _load_verify(self) -> None:
        self.verify = self._compiled(VERIFY_WIDTHS, cached_only=True)

    def wait_compiled(self, timeout: float | None = None) -> None:
        """Wait for a verify program that ``compile_step`` is loading in the background (at most ``timeout`` s)."""
        if self._verify_thread is not None:
            self._verify_thread.join(timeout)

    def _verify_wanted(self) -> bool:
        setting = os.environ.get(COMPILED_VERIFY_ENV, "auto").strip().lower()
        if setting in SWITCHED_OFF:
            return False
        if setting in SWITCHED_ON:
            return True
        need, available = verify_memory(self.model)
        if available is not None and need > available / 2:
            log.info("verify passes stay eager: their compiled program needs ~%.1f GB more memory, %.1f GB are "
                     "available (%s=1 uses it anyway)", need / 1e9, available / 1e9, COMPILED_VERIFY_ENV)
            return False
        return True

    def _compiled(self, widths: tuple[int, int], cached_only: bool) -> CompiledStep | None:
        step = widths == (1, 1)
        try:
            built = CompiledStep.build(self.model, self.name, cached_only=cached_only, widths=widths)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
            log.warning("compiling %s failed (%s: %s); %s", "the one-token step" if step else "the verify passes",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                        "decoding stays eager" if step else "verify passes stay eager")
            return None
        if built is not None:
            log.info("%s compiled (%s in %.1f s)", "one-token steps" if step else built.what,
                     "loaded" if built.loaded else "compiled", built.seconds)
        return built

    def new_kv_group(self, capacity: int) -> BatchKV:
        return BatchKV(capacity)

    def pass_width(self, widths) -> int:
        """Rows a batched pass computes: every row is padded to the widest."""
        return len(widths) * max(widths, default=0)

    def run_model(self, **inputs):
        """The transformers model's forward on ``inputs`` (``forward`` and ``forward_batch``'s one call of it); a
        backend may serve some passes another way (the blocks backend: ``verispec.backends.block_stack``)."""
        return self.model(**inputs)

    @torch.no_grad()  # the target is never trained through: a pass called outside the engine builds no graph
    def forward_batch(self, items, *, feature_layers=(), last_only: bool = False) -> list[TargetPass]:
        """One forward over several sequences of one ``BatchKV`` (``verispec.backends.base.TargetModel``). With
        ``last_only`` each sequence gets the logits of its last token only, and the lm_head runs on those columns
        only (a prompt's prefill would otherwise spend most of its time on logits it throws away)."""
        kvs = [kv for kv, _ in items]
        batch = kvs[0].batch if kvs and isinstance(kvs[0], RowKV) else None
        if batch is None or any(not isinstance(kv, RowKV) or kv.batch is not batch for kv in kvs):
            raise ValueError("forward_batch needs the caches of one group (new_kv_group().new_kv())")
        if any(not tokens for _, tokens in items):
            raise ValueError("every sequence of a batched pass needs at least one token")
        width = max(len(tokens) for _, tokens in items)
        span, starts = batch.begin_pass(kvs, width)
        try:
            fill = self.tokenizer.pad_token_id or 0
            ids = torch.full((span.stop - span.start, width), fill, dtype=torch.long)
            for kv, tokens in items:
                ids[kv.index - span.start, : len(tokens)] = torch.tensor(list(tokens))
            positions = starts[:, None] + torch.arange(width)  # [rows, width]: each row at its own positions
            mask = None  # one row: the plain causal case, which transformers builds (and SDPA runs) as usual
            extra = {}
            if len(starts) > 1:
                columns = torch.arange(batch.pass_end)
                allowed = columns[None, None, :] <= positions[:, :, None]  # [rows, width, columns]
                mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
                mask = for_layers(self.model.config, mask[:, None].to(self.device), positions.to(self.device),
                                  columns.to(self.device))
                if self.width_invariant:  # each row attends as if alone (verispec.backends.hf.invariant)
                    extra = dict(verispec_keys=keys_by_layer(self.model.config, allowed, positions, columns))
            keep = sorted({len(tokens) - 1 for _, tokens in items}) if last_only else None
            out = self.run_model(input_ids=ids.to(self.device), cache=batch.cache, use_cache=True,
                                 position_ids=positions.to(self.device), attention_mask=mask,
                                 output_hidden_states=bool(feature_layers),
                                 logits_to_keep=torch.tensor(keep, device=self.device) if keep else 0, **extra)
        finally:
            batch.end_pass()
        passes = []
        for kv, tokens in items:
            row, n = kv.index - span.start, len(tokens)
            hidden = (torch.stack([out.hidden_states[i][row, :n] for i in feature_layers], dim=1)
                      if feature_layers else None)
            logits = out.logits[row, keep.index(n - 1)][None] if keep else out.logits[row, :n]
            passes.append(TargetPass(logits, hidden))
            kv.length += n
        return passes

    @torch.no_grad()
    def forward(self, kv: TorchKV | FixedKV, tokens, *, parents=None, last_only: bool = False,
                feature_layers=()) -> TargetPass:
        """One forward over ``tokens`` after the cached positions (see ``verispec.backends.base.TargetModel``); hidden
        states come for every fed token, logits for the last one only when ``last_only``."""
        if isinstance(kv, RowKV):
            if parents is not None:
                raise InvalidRequest("token trees run one sequence per pass; verify them outside a batch")
            return self.forward_batch([(kv, tokens)], feature_layers=feature_layers, last_only=last_only)[0]
        n, fixed = len(tokens), isinstance(kv, FixedKV)
        compiled = self.step if n == 1 else self.verify
        if (fixed and compiled is not None and compiled.widths[0] <= n <= compiled.widths[1] and _initialized(kv)
                and (parents is None or not self.width_invariant)):
            logits, hidden = compiled(kv, [int(t) for t in tokens], None if parents is None else list(parents))
            return TargetPass(logits[-1:] if last_only else logits,
                              select_layers(hidden, tuple(feature_layers)) if feature_layers else None)
        with kv.eager(n) if fixed else nullcontext():
            extra = {}
            if parents is not None:
                past = len(kv)
                positions, mask = tree_inputs(past, n - len(parents), list(parents), self.dtype, self.device)
                keys = torch.cat([torch.arange(past, device=self.device), positions[0]])
                extra = dict(position_ids=positions, attention_mask=for_layers(self.model.config, mask, positions[0],
                                                                              keys))
                if self.width_invariant:  # each node attends as its own chain would (verispec.backends.hf.invariant)
                    extra["verispec_keys"] = keys_by_layer(self.model.config, mask[0, :1] == 0, positions, keys)
            elif fixed:  # the buffer's columns past the sequence hold stale keys: mask them explicitly
                extra = dict(position_ids=torch.arange(len(kv), len(kv) + n, device=self.device)[None],
                             attention_mask=kv.mask(n, self.dtype, self.device, self.model.config))
            out = self.run_model(input_ids=torch.tensor([list(tokens)], device=self.device), cache=kv.cache,
                                 use_cache=True, logits_to_keep=1 if last_only else 0,
                                 output_hidden_states=bool(feature_layers), **extra)
        hidden = select_layers(out.hidden_states, tuple(feature_layers)) if feature_layers else None
        return TargetPass(out.logits[0], hidden)

    @property
    def linear_kernel(self) -> str:
        """The kernel the linear layers run on ("oneDNN-packed", "F.linear (MKL)", ...), for reports."""
        compiled = "; one-token steps compiled (AOTInductor)" if self.step is not None else ""
        if self.verify is not None:
            compiled += f", verify passes and token trees of {self.verify.widths[0]}-{self.verify.widths[1]} tokens too"
        if self.packed_layers:
            return "oneDNN-packed" + ("; width-invariant attention" if self.width_invariant else "") + compiled
        kernel = linear_kernel(self.dtype, pack=False)
        kernel = kernel if self.pack_requested or self.device.type != "cpu" else f"{kernel}, packing off"
        return kernel + compiled


def verify_memory(model: torch.nn.Module) -> tuple[int, int | None]:
    """(bytes the compiled verify program needs at peak, bytes of memory available now or None where unknown): ~4x
    the weights (measured with the default model: 5.7 against 3.6 GB peak for a process with and without it, 538 MB
    of float32 weights)."""
    weights = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    return 4 * weights, _available_memory()


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo (free memory plus what the kernel can reclaim), in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _initialized(kv: FixedKV) -> bool:
    """Whether ``kv``'s buffers exist (an eager pass lays them out; the compiled step only writes into them)."""
    return bool(kv.cache.layers) and all(layer.is_initialized for layer in kv.cache.layers)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
