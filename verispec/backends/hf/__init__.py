"""The transformers backend: a PyTorch causal LM with its tokenizer behind ``verispec.backends.base.TargetModel``.

Its KV cache grows in place and rolls back through transformers' public Cache API (``.cache``); linear weights are
prepacked for oneDNN where this CPU runs that kernel (``.packing``, probed by ``.cpu``); ``compiled=True`` compiles
the one-token step with inductor (``.compiled``).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ...errors import InvalidRequest, ModelNotFound
from ...features import select_layers
from ...tree import tree_inputs
from ...options import Option
from .. import measurements
from ..base import DTYPES, TargetModelBase, TargetPass, parse_dtype
from ..registry import BackendSpec, register
from ..references import BUILTINS, resolve, transformers_progress_bars
from .attention import use_grouped_sdpa
from .cache import BatchKV, RowKV, TorchKV
from .compiled import VERIFY_WIDTHS, CompiledStep, FixedKV
from ..torch_cpu.cpu import linear_kernel
from .layers import decoder_layers, skipping_view
from .masks import for_layers
from .invariant import make_width_invariant, row_keys
from ..torch_cpu.packing import pack_linear_layers

log = logging.getLogger(__name__)

PACK_ENV = "VERISPEC_PACK"  # 0 turns off prepacked oneDNN weights (verispec.backends.torch_cpu.packing)
COMPILED_VERIFY_ENV = "VERISPEC_COMPILED_VERIFY"  # 0 / 1: verify passes eager / compiled (default: if memory allows)
INVARIANT_ENV = "VERISPEC_WIDTH_INVARIANT"  # 0 turns off width-invariant bfloat16 passes (verispec.backends.hf.invariant)
SWITCHED_OFF = ("0", "false", "no", "off")  # how an environment switch is turned off (or on, below)
SWITCHED_ON = ("1", "true", "yes", "on")

COMPILE_MODES = ("auto", "on", "off")  # --compile: a stored compiled step if any / compile now / eager


COMPILE_ENV = "VERISPEC_COMPILE"  # the command line's default --compile (auto unless set)


def default_compile_mode() -> str:
    """The command line's default ``--compile``: $VERISPEC_COMPILE (auto, on or off), else auto."""
    return compile_mode(os.environ.get(COMPILE_ENV, "").strip().lower() or "auto")


def compile_mode(compiled: bool | str) -> str:
    """``load_model``'s ``compiled`` as one of COMPILE_MODES (True is "on", False "off")."""
    mode = {True: "on", False: "off"}.get(compiled, compiled) if isinstance(compiled, bool) else compiled
    if mode not in COMPILE_MODES:
        raise InvalidRequest(f"compile takes {', '.join(COMPILE_MODES)} (or True / False), got {compiled!r}")
    return mode


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

    @property
    def measurement_key(self) -> dict | None:
        """What a pass's cost depends on here (``verispec.backends.measurements``); None for a model that was not
        loaded from a folder or the hub (its costs are never stored)."""
        source = str(self.model.config._name_or_path or "")
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
                    extra = dict(verispec_keys=row_keys(allowed.to(self.device)))
            keep = sorted({len(tokens) - 1 for _, tokens in items}) if last_only else None
            out = self.model(input_ids=ids.to(self.device), cache=batch.cache, use_cache=True,
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
                    extra["verispec_keys"] = row_keys(mask[0, :1] == 0)
            elif fixed:  # the buffer's columns past the sequence hold stale keys: mask them explicitly
                extra = dict(position_ids=torch.arange(len(kv), len(kv) + n, device=self.device)[None],
                             attention_mask=kv.mask(n, self.dtype, self.device, self.model.config))
            out = self.model(input_ids=torch.tensor([list(tokens)], device=self.device), cache=kv.cache,
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


def load(ref: str, dtype: str | torch.dtype = "float32", device: str | None = None, pack: bool | None = None,
         compiled: str = "off") -> LoadedModel:
    """Load a model reference (``verispec.backends.references``) with transformers; see ``verispec.load_model``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    compiles = torch_dtype == torch.float32 and (device or "cpu") == "cpu"
    if compiled == "on" and not compiles:
        raise InvalidRequest(f"--compile is for float32 on CPU (what it was measured on), not {dtype} on "
                             f"{device or 'cpu'}; drop --compile or use --dtype float32")
    folder = resolve(ref)
    source = str(folder) if folder is not None else ref
    try:
        with transformers_progress_bars(folder is None):  # a hub id may download: show it; a local load is quiet
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        if folder is None:
            raise ModelNotFound(
                f"could not load {ref!r} from the Hugging Face hub ({exc}). Without a network, use a local "
                f"directory, a .gguf file or a built-in name ({', '.join(BUILTINS)})"
            ) from exc
        raise ModelNotFound(f"could not load the model in {source}: {exc}") from exc
    if device:
        model = model.to(device)
    if pack is None:
        pack = pack_from_environment()
    packed = pack_linear_layers(model) if pack else 0
    invariant = invariant_from_environment() and make_width_invariant(model)
    if not invariant:
        use_grouped_sdpa(model)  # eager passes attend without copying each key/value head (.attention)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=ref, dtype=torch_dtype, packed_layers=packed,
                         pack_requested=pack, width_invariant=invariant)
    if compiled == "on":
        loaded.compile_step()
    elif compiled == "auto" and compiles:
        loaded.compile_step(cached_only=True)
    log.info("%s in %s: linear layers run on %s", ref, dtype, loaded.linear_kernel)
    return loaded


def _switched_on(variable: str) -> bool:
    """An on-by-default switch: on unless the environment variable is 0/false/no/off."""
    return os.environ.get(variable, "1").strip().lower() not in SWITCHED_OFF


def invariant_from_environment() -> bool:
    """Width-invariant bfloat16 passes (``verispec.backends.hf.invariant``) are on unless VERISPEC_WIDTH_INVARIANT is
    0/false/no/off."""
    return _switched_on(INVARIANT_ENV)


def pack_from_environment() -> bool:
    """Packing is on unless VERISPEC_PACK is 0/false/no/off."""
    return _switched_on(PACK_ENV)


def _load(ref: str, dtype="float32", compiled="off", threads: int | None = None, device: str | None = None,
          pack: bool | None = None) -> LoadedModel:
    if threads is not None:
        if threads < 1:
            raise InvalidRequest(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)  # torch's threads are the process's: every model it runs uses them
    return load(ref, dtype, device, pack, compile_mode(compiled))


register(BackendSpec(
    "transformers",
    summary="PyTorch on the model's values (a GGUF's dequantized once): every drafter, token trees, hidden states",
    load=_load,
    preference=0,
    options=(
        Option("dtype", str, "float32", "weights and activations; float32 (default) guarantees greedy output "
               "identical to plain decoding, bfloat16 only approximately (rounding differs between wide and narrow "
               "passes)", choices=tuple(DTYPES)),
        Option("compiled", str, "off", "one-token decoding steps and verify passes of 2-12 tokens compiled ahead of "
               "time (AOTInductor; float32 on CPU; prefills, trees and wider passes stay eager). auto: use the "
               "compiled programs stored by an earlier process, else decode eagerly (a server with --max-batch 1 "
               "compiles them in the background and switches when ready); on: compile now if none is stored (a few "
               "minutes once per model and machine, then seconds to load; needs a C++ compiler); off: always eager. "
               f"The command line's default is auto, or ${COMPILE_ENV}. What it buys per CPU: docs/kernels.md",
               flag="compile", choices=COMPILE_MODES, metavar="auto|on|off", const="on", neutral=("auto",),
               cli_default=default_compile_mode),
        Option("threads", int, None, "torch's CPU threads in this process (default: torch's choice)"),
        Option("device", str, None, "torch device (default: cpu)", exposed=False),
        Option("pack", bool, None, "prepacked oneDNN weights (default: where this CPU runs them, unless "
               f"${PACK_ENV}=0)", exposed=False),
    ),
))
