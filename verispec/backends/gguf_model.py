"""A transformers model built straight from a GGUF file, for the blocks backend: its matrices left as the file's rows
(``FileModel.locate`` names them), its token embedding kept as the file's blocks (``BlockEmbedding``), every other
tensor (norms, biases) dequantized, and nothing written to disk: the float32 conversion of the whole model that the
transformers backend needs (6.7 GB and half a minute for the 1.5B) is skipped. That conversion is built here too
(``dequantized``: every tensor as transformers' loader computes it, the metadata read once).

Names and reorderings are transformers' own: its GGUF loader's tensor-name map (``get_gguf_hf_weights_map``) and its
per-architecture processors (Llama's q / k row permutation, Gemma's norms stored as ``w + 1``), applied to the values
of the small tensors and, for a matrix, to its row indices (a processor that does more to a matrix than reorder its
rows makes ``read`` refuse with ``NotRowOrder``; the blocks backend then finds the rows by value instead).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import blockmm
from ..errors import InvalidRequest
from .block_modules import BlockEmbedding
from .gguf_header import GGUF_CONFIG_FILE, read_header


def _embedding_classes() -> tuple[type, ...]:
    """Embedding modules whose forward reads ``weight`` through ``nn.Embedding``'s own (``BlockEmbedding`` wraps those
    alone): the plain one and Gemma 3's scaled one."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    return nn.Embedding, Gemma3TextScaledWordEmbedding


class NotRowOrder(Exception):
    """The file's tensors do not map onto the model by name and row order alone."""


@dataclass
class FileModel:
    """A model skeleton whose small tensors hold the file's values; its matrices wait on the meta device."""

    model: nn.Module
    raw: dict[str, np.ndarray] = field(default_factory=dict)  # 2-D tensor -> its bytes [rows, bytes a row]
    kinds: dict[str, str] = field(default_factory=dict)  # 2-D tensor -> GGUF type name
    rows: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # linear layer -> (tensor, its row order)
    _tensors: dict[str, object] = field(default_factory=dict, repr=False)  # parameter -> the reader's tensor
    _process: object = field(default=None, repr=False)

    def locate(self, name: str, linear: nn.Module) -> list[tuple[str, int]] | None:
        """The file rows linear layer ``name`` holds, in its row order (``blocks.place_linears``'s ``locate``)."""
        if name not in self.rows:
            return None
        tensor, order = self.rows[name]
        return [(tensor, int(r)) for r in order]

    def fill_rest(self) -> None:
        """Every parameter still on the meta device (a matrix left float32, a tied output layer) given its values."""
        from accelerate.utils import set_module_tensor_to_device

        head = self.model.get_output_embeddings()
        tied = self.model.config.tie_word_embeddings and next(
            (f"{n}.weight" for n, m in self.model.named_modules() if m is head), None)
        for name, param in list(self.model.named_parameters(remove_duplicate=False)):
            if not param.is_meta:
                continue
            if name == tied:  # an output layer left float32: the embedding's values (a BlockEmbedding dequantizes)
                head.weight = nn.Parameter(self.model.get_input_embeddings().weight, requires_grad=False)
                continue
            if name not in self._tensors:
                kind = type(self.model).__name__
                raise InvalidRequest(f"the GGUF file has no tensor for {name}: it does not hold a whole {kind}; use "
                                     "--backend llamacpp")
            set_module_tensor_to_device(self.model, name, "cpu", value=self._process(self._tensors[name], param))


def _skeleton(path: Path, cache: Path | None):
    """The model of GGUF file ``path`` on the meta device (rotary buffers computed), with what reading its tensors
    the way transformers' loader does takes: ``(model, parsed, names, header, processed, processor)``.
    ``processed(tensor)`` is what that loader makes of one tensor (gguf's dequantization, then the architecture's
    processor): its ``name`` (the file's name to look up in ``names``) and ``weights``."""
    from accelerate import init_empty_weights
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    parsed = {"config": _settings(path, cache)}
    settings = dict(parsed["config"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    header = read_header(path)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=parsed["config"])
    names = _names(model, processor)

    def processed(tensor):
        values = dequantize(tensor.data, GGMLQuantizationType[tensor.kind])
        return processor.process(weights=values, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed)

    return model, parsed, names, header, processed, processor


def read(path: Path, cache: Path | None = None) -> FileModel:
    """``path``'s model with its small tensors loaded. ``cache``: a folder of this file's (its tokenizer's) where the
    configuration read from the metadata is kept (reading it takes ~10 s for the 1.5B's vocabulary on 2 cores)."""
    from accelerate.utils import set_module_tensor_to_device

    model, parsed, names, header, processed, processor = _skeleton(path, cache)
    config = model.config

    def process(tensor, param: torch.Tensor) -> torch.Tensor:
        weights = processed(tensor).weights
        return torch.from_numpy(np.array(weights, dtype=np.float32)).reshape(param.shape)  # a copy: off the file

    found = FileModel(model, _process=process)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    embedding, embedding_tensor = model.get_input_embeddings(), None
    for tensor in header.tensors:
        name = names.get(tensor.name)
        if name is None or name not in params:
            continue  # what transformers' loader skips too (rope frequency tables, ...)
        found._tensors[name] = tensor
        owner, _, attribute = name.rpartition(".")
        if modules.get(owner) is embedding and attribute == "weight":
            embedding_tensor = tensor
        if len(tensor.shape) == 2:
            rows = tensor.shape[0]
            found.raw[tensor.name], found.kinds[tensor.name] = tensor.data, tensor.kind
            if isinstance(modules.get(owner), nn.Linear) and attribute == "weight":
                found.rows[owner] = (tensor.name, _row_order(processor, tensor.name, rows, names, parsed))
                continue
            if (modules.get(owner) is embedding and type(embedding) in _embedding_classes()
                    and tensor.kind in blockmm.TYPES
                    and np.array_equal(_row_order(processor, tensor.name, rows, names, parsed), np.arange(rows))):
                # the table stays the file's blocks; each pass dequantizes the rows its tokens pick
                model.set_input_embeddings(BlockEmbedding(embedding, torch.from_numpy(np.array(tensor.data)),
                                                          tensor.kind))
                continue
        set_module_tensor_to_device(model, name, "cpu", value=process(tensor, params[name]))
    head = model.get_output_embeddings()
    head_name = next((n for n, m in modules.items() if m is head), None)
    if head_name and head_name not in found.rows and config.tie_word_embeddings and embedding_tensor is not None:
        # a tied output layer multiplies the embedding's rows (as llama.cpp does when a file has no output tensor)
        found.rows[head_name] = (embedding_tensor.name, np.arange(embedding_tensor.shape[0]))
    return found


def dequantized(path: Path, cache: Path | None = None) -> nn.Module:
    """``path``'s whole model in float32, every tensor as transformers' GGUF loader computes it (the transformers
    backend's conversion, ``references``): the same loop as ``load_gguf_checkpoint``'s, each tensor dequantized,
    processed, and set by the name the processor gives it, with the configuration read once (kept in ``cache``) and
    the name map built once, where transformers' own ``from_pretrained`` reads the metadata three times and builds
    the map per module (~19 s of a 25 s conversion of SmolLM2-135M on a Zen 4 core). Raises ``NotRowOrder`` where
    the file's tensors do not fill the model that way (a processor that gathers tensors across calls): the caller
    converts with transformers then."""
    from accelerate.utils import set_module_tensor_to_device

    model, parsed, names, header, processed, _ = _skeleton(path, cache)
    parsed["tensors"] = {}  # where a processor that gathers tensors across calls would keep them
    params = dict(model.named_parameters(remove_duplicate=False))
    for tensor in header.tensors:
        done = processed(tensor)
        name = names.get(done.name)
        if name is None or name not in params:
            continue  # what transformers' loader skips too (rope frequency tables, ...)
        value = torch.from_numpy(np.copy(done.weights))
        if value.shape != params[name].shape:
            raise NotRowOrder(f"{tensor.name}: shaped {tuple(value.shape)}, {name} is {tuple(params[name].shape)}")
        set_module_tensor_to_device(model, name, "cpu", value=value)
    if parsed["tensors"] or set(parsed) != {"config", "tensors"}:
        raise NotRowOrder(f"transformers' processor for {header.architecture} keeps tensors across calls")
    model.tie_weights()  # a tied output layer: the embedding's values, as from_pretrained leaves it
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise NotRowOrder(f"the file has no tensor for {', '.join(missing[:3])}")
    return model.eval()


def _row_order(processor, tensor: str, rows: int, names, parsed) -> np.ndarray:
    """The file's row for each of the model's rows: the architecture's processor applied to the row indices."""
    done = processor.process(weights=np.arange(rows).reshape(rows, 1), name=tensor, tensor_key_mapping=names,
                             parsed_parameters=parsed)
    order = np.asarray(done.weights)
    if done.name != tensor or order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), np.arange(rows)):
        raise NotRowOrder(f"{tensor}: transformers' GGUF loader changes it beyond its row order")
    return order[:, 0]


def _settings(path: Path, cache: Path | None) -> dict:
    """The model's configuration as transformers' GGUF loader reads it from the file's metadata (kept in ``cache``)."""
    import json

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    kept = cache / GGUF_CONFIG_FILE if cache is not None else None
    if kept is not None and kept.is_file():
        return json.loads(kept.read_text())
    settings = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    if kept is not None:
        partial = kept.with_name(f".{kept.name}.{os.getpid()}")
        partial.write_text(json.dumps(settings))
        os.replace(partial, kept)
    return settings


def _names(model: nn.Module, processor) -> dict[str, str]:
    """transformers' map from the file's tensor names to ``model``'s parameters. It walks every submodule and builds
    gguf's name table afresh at each (3.5 s for the 1.5B's 371 modules); the table is built once here."""
    from functools import lru_cache
    from unittest import mock

    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with mock.patch.object(gguf, "get_tensor_name_map", lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        return get_gguf_hf_weights_map(model, processor)
