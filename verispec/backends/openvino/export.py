"""Export a transformers causal LM to OpenVINO IR, once, into verispec's cache.

optimum-intel (the usual exporter) pins transformers below the version verispec runs, so verispec exports with
OpenVINO's own converter: the model is traced (``openvino.convert_model``) through a wrapper whose inputs are
``input_ids``, ``attention_mask``, ``position_ids`` and the past keys and values, and whose outputs are the logits and
the new keys and values; the cache is then moved inside the model (``past_key_values.i.key`` ->
``present.i.key`` become state variables that start empty, behind a ``beam_idx`` gather), which is the layout
OpenVINO GenAI's ``LLMPipeline`` loads. The folder also gets the tokenizer as OpenVINO models
(``openvino_tokenizers``), the transformers config and generation config.

verispec's own backend runs a second graph of the same weights, ``verispec_model.xml``: its ``attention_mask`` is
the 4-D additive mask itself ([1, 1, fed, cached + fed], built by the caller: rolled-back positions masked out, token
trees as ``verispec.tree`` lays them out) it computes logits only at the rows of its ``logit_rows`` input (a prefill asks
for its last row and skips the lm_head over the prompt: 769 prompt tokens took 0.79 s with every row's logits); it
also returns ``hidden_states`` [1, fed, layers + 1, hidden], every layer's output (what EAGLE heads read); and the
projections of one input (q/k/v, gate/up) run as one matmul each (``fusion``). GenAI's 2-D graph stays as
optimum-intel lays it out, for the peers.

Weight formats: ``as-is`` (a GGUF source's own quantized blocks, held as OpenVINO compressed weights:
``gguf_blocks``; the model's own weights, not a re-quantization), ``fp32`` (as traced), ``bf16`` (fp32 weights computed in bfloat16, where the CPU has it),
``fp16`` (weights stored in half precision) and ``int8`` / ``int4`` (weight-only compression with NNCF, ``pip install nncf``),
which re-quantize: on a GGUF source they are a changed model (``CHANGES_MODEL``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ...errors import InvalidRequest
from ..references import cache_dir, resolve

log = logging.getLogger(__name__)

EXPORT_VERSION = 4  # bump when the exported graph changes: cached exports are then made again
WEIGHTS = ("as-is", "fp32", "bf16", "fp16", "int8", "int4")
# formats that round the source's weights again: on an already-quantized GGUF they run another model than the file's
# (re-quantized twice, int4 loops more often: docs/openvino.md), so every result made with one says so
CHANGES_MODEL = ("int8", "int4")
# where the projections of one input are fused in verispec's graph: every format but bf16, whose passes the fused
# matmuls would make width-dependent on CPUs where the unfused ones are not (AMD Zen 4, OpenVINO 2026.4.1); so bf16
# gets an export of its own (fp32 weights, unfused)
UNFUSED = ("bf16",)


def float_activations() -> dict:
    """On a CPU with VNNI (AVX-512 or AVX) OpenVINO quantizes the activations of compressed-weight matmuls to int8 on
    its own: on a Q4_0 file's own blocks that moved the logits by 15% of their range against the file's values on an
    AMD EPYC Zen 5 (0.4% without; tests/test_openvino_gguf_blocks.py). There it is switched off; an AVX2-only CPU,
    where the default leaves activations in float, keeps OpenVINO's defaults (setting the property there slowed wide
    passes, docs/openvino.md)."""
    from ..torch_cpu.cpu import cpu_info

    flags = set(cpu_info()["flags"])
    return {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0} if flags & {"avx512_vnni", "avx_vnni", "amx_int8"} else {}


def inference_precision(weights: str) -> str:
    """What the CPU plugin computes in for ``weights``: pinned, because OpenVINO's own default is bf16 on CPUs that
    have it (a different model than the f32 one on other CPUs) and f32 elsewhere. ``bf16`` on a CPU without bf16
    instructions is refused."""
    if weights != "bf16":
        return "f32"
    ov = import_openvino()
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        raise InvalidRequest("--weights bf16 needs a CPU with bf16 instructions (AVX-512 BF16 or AMX); this one has "
                             "none: choose fp32, int8 or int4")
    return "bf16"


MODEL_XML = "openvino_model.xml"  # 2-D mask, logits: what OpenVINO GenAI loads
VERISPEC_XML = "verispec_model.xml"  # 4-D mask, logits and hidden states: what verispec's backend runs
INSTALL = 'pip install "verispec[openvino]"'


def import_openvino():
    try:
        import openvino
    except ImportError:
        raise InvalidRequest(f"the OpenVINO backend and peers need openvino; {INSTALL}") from None
    return openvino


def _source_key(folder: Path, weights: str, gguf: Path | None = None) -> str:
    """Identifies an export: the source folder's config and weight files (names, sizes, times), the GGUF file whose
    blocks it holds (as-is), the format and the exporter's version."""
    h = hashlib.sha256(f"{EXPORT_VERSION}:{weights}:{folder.resolve()}:{gguf and gguf.resolve()}".encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def export_dir(ref: str, weights: str = "fp32") -> Path:
    """The cached OpenVINO export of ``ref`` in ``weights``, made on first use (~30 s for the built-in model)."""
    if weights not in WEIGHTS:
        raise InvalidRequest(f"unknown OpenVINO weight format {weights!r}; choose one of {', '.join(WEIGHTS)}")
    folder = resolve(ref)
    if folder is None:
        raise InvalidRequest(f"{ref!r} is a hub id; the OpenVINO export needs a local model (a transformers folder, "
                             "a .gguf file or a built-in name)")
    gguf = gguf_source(ref) if weights == "as-is" else None
    if weights == "as-is" and gguf is None:
        weights = "fp32"  # a transformers folder's own weights are its float32 ones
    name = Path(ref).stem if Path(ref).exists() else ref.replace("/", "--")
    out = cache_dir() / "openvino" / f"{name}-{weights}-{_source_key(folder, weights, gguf)}"
    if not _complete(out):
        from filelock import FileLock

        out.parent.mkdir(parents=True, exist_ok=True)
        # one exporter per entry: another process (a Ray replica on a fresh cache) waits here, then finds it done
        with FileLock(str(out) + ".lock"):
            if not _complete(out):
                from ..steps import size_of, step

                with step(f"exporting {name} to OpenVINO ({weights} weights; once)", f"openvino-export-{weights}",
                          size_of(gguf or folder)):
                    export(folder, out, weights, gguf)
                _remove_outdated(out, folder, weights)
    return out


def _complete(out: Path) -> bool:
    """An export is complete once its record is written: the last file, written after both graphs."""
    return (out / MODEL_XML).exists() and (out / VERISPEC_XML).exists() and (out / "verispec_export.json").exists()


def _remove_outdated(out: Path, folder: Path, weights: str) -> None:
    """Remove the exports of the same source and format that an older exporter made (the cache would otherwise keep
    every version's ~0.2-1 GB); exports of other sources under the same name stay."""
    for other in out.parent.glob(out.name.rsplit("-", 1)[0] + "-*"):
        try:
            record = json.loads((other / "verispec_export.json").read_text())
        except (OSError, ValueError):
            continue  # not an export, or one being written
        if other != out and record.get("source") == str(folder) and record.get("weights") == weights \
                and record.get("export_version") != EXPORT_VERSION:
            log.info("removing %s, made by an older exporter", other)
            shutil.rmtree(other, ignore_errors=True)


def gguf_source(ref: str) -> Path | None:
    """The GGUF file a reference was converted from (a built-in name or a .gguf path), or None."""
    from ..references import BUILTINS, builtin_gguf

    if ref in BUILTINS:
        return builtin_gguf(BUILTINS[ref])
    path = Path(ref).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def export(folder: Path, out: Path, weights: str = "fp32", gguf: Path | None = None) -> Path:
    """Export the transformers model in ``folder`` to ``out`` (written whole to a temporary folder of a unique name,
    then renamed into place: a reader never sees half an export); ``as-is`` replaces the float32 weights with
    ``gguf``'s own blocks (``gguf_blocks``). ``export_dir`` calls it holding the entry's lock."""
    from tqdm.auto import tqdm

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ov = import_openvino()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = None
    if weights == "as-is":
        if gguf is None:
            raise InvalidRequest("--weights as-is on OpenVINO holds a GGUF file's blocks; this source has none")
        from .gguf_blocks import GGUFRows

        rows = GGUFRows.read(gguf)
    held = {}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    progress = tqdm(total=2, desc=f"OpenVINO export ({weights})", unit="graph")
    try:
        for xml, custom_mask in ((MODEL_XML, False), (VERISPEC_XML, True)):
            # GenAI's graph keeps the layout optimum-intel exports; verispec's own runs each group of projections
            # of one input as one matmul (verispec.backends.openvino.fusion)
            ov_model = trace_fused(model, rows) if custom_mask and weights not in UNFUSED else \
                trace(model, custom_mask)
            make_stateful(ov_model, model.config.num_hidden_layers)
            if weights in ("int8", "int4"):
                ov_model = compress(ov_model, weights, group_size(model.config))
            if rows is not None:
                from .gguf_blocks import compress_from_gguf

                held[xml] = compress_from_gguf(ov_model, rows)
                log.warning("%s: %s", xml, held[xml].summary())
            ov.save_model(ov_model, tmp / xml, compress_to_fp16=weights == "fp16")
            del ov_model
            progress.update()
        _save_tokenizer(tokenizer, tmp)
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        for extra in ("chat_template.jinja",):
            if (folder / extra).exists():
                shutil.copy(folder / extra, tmp / extra)
        (tmp / "verispec_export.json").write_text(json.dumps(
            {"source": str(folder), "weights": weights, "export_version": EXPORT_VERSION,
             **({"gguf": str(gguf), "gguf_blocks": {x: {"kinds": h.kinds, "float32": h.float32}
                                                   for x, h in held.items()}} if held else {})}, indent=2))
        if out.exists():  # an incomplete export left by a stopped process: moved aside first, then removed
            stale = Path(tempfile.mkdtemp(prefix=out.name + ".stale.", dir=out.parent))
            out.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(out)
    finally:
        progress.close()
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _past_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return past, [n.replace("past_key_values", "present") for n in past]


def trace(model, custom_mask: bool = False):
    """The model as an OpenVINO graph with the cache as explicit inputs and outputs (stateless). ``custom_mask``:
    the mask input is 4-D and additive, and every layer's hidden states are a second output."""
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    ov = import_openvino()
    cfg = model.config
    layers = cfg.num_hidden_layers
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    class Stateless(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *rest):
            logit_rows, past = (rest[0], rest[1:]) if custom_mask else (None, rest)
            cache = DynamicCache(config=self.inner.config)
            # sliding-window layers as full ones: the graph keeps every position and the mask decides what a layer
            # sees (a sliding layer would count positions it was given directly as none, and cut its cache); the
            # backend caps a model's context at its window (``OpenVINOModel.context_length``), where both agree
            cache.layers[:layers] = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer
                                     for layer in cache.layers[:layers]]
            for i, layer in enumerate(cache.layers[:layers]):
                # set the past directly: DynamicLayer.update concatenates onto an empty 1-D tensor, which the
                # converter cannot shape
                layer.lazy_initialization(past[2 * i], past[2 * i + 1])
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
            extra = {"logits_to_keep": logit_rows, "output_hidden_states": True} if custom_mask else {}
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True, **extra)
            present = [t for layer in cache.layers[:layers] for t in (layer.keys, layer.values)]  # grown in place
            if custom_mask:
                return (out.logits, torch.stack(out.hidden_states, dim=2), *present)
            return (out.logits, *present)

    cached, fed = 3, 2
    mask = (torch.zeros(1, 1, fed, cached + fed).masked_fill_(torch.ones(fed, cached + fed).triu(cached + 1).bool(),
                                                              torch.finfo(torch.float32).min)
            if custom_mask else torch.ones(1, cached + fed, dtype=torch.long))
    example = (torch.ones(1, fed, dtype=torch.long), mask,
               torch.arange(cached, cached + fed).unsqueeze(0), *([torch.arange(fed)] if custom_mask else []),
               *[torch.zeros(1, heads, cached, head_dim) for _ in range(2 * layers)])
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about shapes it records as constants
        ov_model = ov.convert_model(Stateless(model), example_input=example)
    past, present = _past_names(layers)
    inputs = ["input_ids", "attention_mask", "position_ids", *(["logit_rows"] if custom_mask else [])]
    for port, name in zip(ov_model.inputs, [*inputs, *past]):
        port.get_tensor().set_names({name})
    outputs = ["logits", "hidden_states"] if custom_mask else ["logits"]
    for port, name in zip(ov_model.outputs, [*outputs, *present]):
        port.get_tensor().set_names({name})
    return ov_model


def trace_fused(model, rows=None):
    """verispec's graph (``trace(model, custom_mask=True)``) with the projections that share an input fused; traced
    as it is where the model's layers call them otherwise (``fusion.FusionError``). With a GGUF file's ``rows``
    (as-is) only groups stored in one block type are fused (Q4_K_M files keep some v projections in Q6_K)."""
    from .fusion import FusionError, fused_projections

    allow = None
    if rows is not None:
        def allow(linears):
            import torch

            return rows.kind_of(torch.cat([lin.weight.detach() for lin in linears]).numpy()) is not None
    try:
        with fused_projections(model, allow) as groups:
            ov_model = trace(model, custom_mask=True)
        log.info("exported with %d groups of projections fused", groups)
        return ov_model
    except FusionError as exc:
        log.warning("projections not fused (%s); exporting them one by one", exc)
        return trace(model, custom_mask=True)


def make_stateful(ov_model, layers: int) -> None:
    """Move the cache inside the model: each past input / present output pair becomes one state variable, read
    through a gather on a new ``beam_idx`` input (GenAI reorders beams with it; verispec passes 0) and starting as
    an empty [batch, heads, 0, head_dim] tensor after a reset."""
    import numpy as np
    from openvino import opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    ov = import_openvino()
    past, present = _past_names(layers)
    batch = ov_model.input("input_ids").get_partial_shape()[0]
    beam_idx = ops.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([batch]))
    beam_idx.output(0).get_tensor().add_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in past:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()  # before the gather becomes one
        gathered = ops.gather(port, beam_idx, ops.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    ov_model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ov_model, dict(zip(past, present)))
    # the state starts as zeros shaped [batch of input_ids, heads, 0, head_dim]
    ids_batch = ops.gather(ops.shape_of(ov_model.input("input_ids"), output_type="i64"), ops.constant([0]),
                           ops.constant(0))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in op.get_output_partial_shape(0)]
            parts = [ids_batch if i == 0 else ops.constant(np.array([d], dtype=np.int64)) for i, d in enumerate(dims)]
            zeros = ops.broadcast(ops.constant(0.0, dtype=op.get_output_element_type(0)), ops.concat(parts, axis=0))
            op.set_arguments([zeros])
    ov_model.validate_nodes_and_infer_types()


def group_size(config) -> int:
    """int4's group: 128 (NNCF's default) where every input width divides by it, else 64 or 32 (SmolLM2-135M's
    hidden size is 576)."""
    widths = [config.hidden_size, getattr(config, "intermediate_size", config.hidden_size)]
    return next((g for g in (128, 64, 32) if all(w % g == 0 for w in widths)), -1)  # -1: per channel


def compress(ov_model, weights: str, group: int = 128):
    """Weight-only compression with NNCF: int8 (asymmetric, per channel) or int4 (symmetric, in groups of
    ``group`` input channels)."""
    try:
        import nncf
    except ImportError:
        raise InvalidRequest(f"--weights {weights} on OpenVINO compresses with NNCF; {INSTALL} (or pip install "
                             "nncf)") from None
    if weights == "int8":
        return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group)


def _save_tokenizer(tokenizer, out: Path) -> None:
    """The tokenizer and detokenizer as OpenVINO models (what GenAI pipelines read), and its transformers files."""
    ov = import_openvino()
    tokenizer.save_pretrained(out)
    try:
        from openvino_tokenizers import convert_tokenizer
    except ImportError:
        log.warning("openvino-tokenizers is not installed: the export has no OpenVINO tokenizer (GenAI needs one)")
        return
    try:
        ov_tok, ov_detok = convert_tokenizer(tokenizer, with_detokenizer=True)
    except Exception as exc:  # a tokenizer type openvino-tokenizers cannot convert: token ids still work
        log.warning("openvino-tokenizers could not convert the tokenizer (%s); the export takes token ids only", exc)
        return
    ov.save_model(ov_tok, out / "openvino_tokenizer.xml")
    ov.save_model(ov_detok, out / "openvino_detokenizer.xml")
