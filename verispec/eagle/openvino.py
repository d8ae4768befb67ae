"""The EAGLE head's draft step on OpenVINO, for targets that run there.

On the OpenVINO backend the target's passes use the cores through OpenVINO's own threads; a torch head runs on the
thread left to torch, streams its float32 draft lm_head, and slows the target's next pass (two thread pools take
turns on the same cores). Here the head's step (``EagleHead.step`` then ``EagleHead.logits``) is converted once to
an OpenVINO graph, its weights compressed to int8 (NNCF), and run in the target's OpenVINO core on one thread, so
both share one executor (measured in docs/openvino.md). The drafts change a little (int8 weights); the output cannot:
drafts are verified by the target like any others.

``HeadSteps`` and the torch head share one method, ``step_logits``: the drafter calls whichever it was given.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import shutil
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidRequest
from .head import EagleHead, HeadCache, StepGraph, plain_copy

log = logging.getLogger(__name__)


def import_openvino():
    """openvino, with a clear error naming the install command when it is missing."""
    try:
        import openvino
    except ImportError:
        raise InvalidRequest('the eagle head\'s OpenVINO engine needs openvino: pip install "verispec[openvino]"') \
            from None
    return openvino


ROWS = (1, 8)  # the fixed numbers of new pairs: a draft token; the pairs a verify pass accepted (up to 8)
CACHE_STEP = 64


GRAPH_XML = "head_step.xml"


def graph_dir(head: EagleHead, weights: str) -> Path:
    """Where the converted graph of ``head`` in ``weights`` is stored: ``$VERISPEC_CACHE/openvino/eagle-heads``, keyed
    by the head's weights and config, the format, this module's and ``verispec.eagle.head``'s source (what the graph
    is traced from) and the OpenVINO and NNCF versions; so a changed head, code or version is converted afresh."""
    import importlib.metadata

    from ..backends.references import cache_dir
    from . import head as head_module

    digest = hashlib.sha256()
    for name, tensor in sorted(head.state_dict().items()):
        if name.startswith("embed."):  # borrowed from the target, not traced into the graph
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    versions = {}
    for package in ("openvino", "nncf"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    for part in (json.dumps(asdict(head.config), sort_keys=True, default=str), weights,
                 json.dumps(versions, sort_keys=True),
                 Path(__file__).read_text(), Path(head_module.__file__).read_text()):
        digest.update(part.encode())
    return cache_dir() / "openvino" / "eagle-heads" / digest.hexdigest()[:24]


def _convert(plain: EagleHead, weights: str):
    """The head's step traced and converted to OpenVINO (dynamic shapes), int8-compressed with ``weights`` int8
    (seconds, once per drafter that loads the head: the trace, NNCF's import and its compression)."""
    ov = import_openvino()
    c = plain.config
    cached = 3
    example = (torch.zeros(2, c.hidden_size), torch.zeros(2, c.hidden_size), torch.tensor([cached, cached + 1]),
               torch.zeros(1, c.num_kv_heads, cached, c.head_dim), torch.zeros(1, c.num_kv_heads, cached, c.head_dim),
               torch.ones(2, cached + 2, dtype=torch.bool), torch.tensor([1]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's deprecation and its notes on shapes it records
        model = ov.convert_model(StepGraph(plain).eval(), example_input=example)
    h, kv = c.hidden_size, [1, c.num_kv_heads, -1, c.head_dim]
    model.reshape(dict(zip(model.inputs, ([-1, h], [-1, h], [-1], kv, kv, [-1, -1], [1]))))
    if weights != "int8":
        return model
    import nncf

    quiet = logging.getLogger("nncf")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its per-layer bit-width table, printed at every load otherwise
    try:  # and its progress bar (a second's work)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    finally:
        quiet.setLevel(level)


def _store(ov, model, xml: Path) -> None:
    """Write the graph to ``xml``'s folder whole (a temporary folder, then renamed); a failure to write is logged,
    not raised: the graph in memory still runs."""
    tmp = None
    try:
        xml.parent.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=xml.parent.parent, prefix=".tmp-"))
        ov.save_model(model, str(tmp / xml.name), compress_to_fp16=False)  # the weights as they are
        tmp.rename(xml.parent)  # fails where another process stored it first: its copy stays
    except Exception as exc:  # noqa: BLE001 - a full disk, a read-only cache, a race: the graph in memory runs
        if not xml.exists():
            log.warning("could not store the eagle head's OpenVINO graph in %s (%s)", xml.parent, exc)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class HeadSteps:
    """``head``'s draft steps as compiled OpenVINO graphs (1 or 8 new pairs, padded up, or any number for a
    request's first step), run with ``threads`` threads; ``weights`` int8 (default) or fp32. Tensors in and out keep
    the head's dtype (the graphs compute in float32). Trees take the torch head (their steps need every row's
    logits)."""

    def __init__(self, head: EagleHead, embedding_model, threads: int, weights: str = "int8", core=None) -> None:
        ov = import_openvino()
        c = head.config
        self.head, self.embed, self.dtype = head, head.embed, head.fuse.weight.dtype
        self.kv_shape = (1, c.num_kv_heads, 0, c.head_dim)
        self.hidden = c.hidden_size
        h, kv = c.hidden_size, [1, c.num_kv_heads, -1, c.head_dim]
        if weights == "int8" and importlib.util.find_spec("nncf") is None:
            log.warning("nncf is not installed (pip install \"verispec[openvino]\"): the eagle head's graph keeps "
                        "fp32 weights")
            weights = "fp32"
        core = core or ov.Core()
        stored = graph_dir(head, weights) / GRAPH_XML
        model = None
        if stored.exists():
            try:
                model = core.read_model(str(stored))
            except Exception as exc:  # noqa: BLE001 - a broken file: converted again below and stored afresh
                log.warning("the eagle head's stored OpenVINO graph %s does not load (%s); converting it again", stored,
                            exc)
                shutil.rmtree(stored.parent, ignore_errors=True)
        if model is None:
            model = _convert(plain_copy(head, embedding_model), weights)
            _store(ov, model, stored)
        properties = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32",
                      "PERFORMANCE_HINT": "LATENCY"}
        # rows -> infer request: graphs of a fixed number of new pairs (padded up to it), the cached pairs padded to
        # a multiple of CACHE_STEP, so a shape changes every CACHE_STEP positions instead of at every draft token
        # (OpenVINO re-plans a graph's kernels on every change of shape); None: any shape (a request's first step)
        self.requests = {None: core.compile_model(model, "CPU", properties).create_infer_request()}
        for rows in ROWS:
            fixed = model.clone()
            fixed.reshape(dict(zip(fixed.inputs, ([rows, h], [rows, h], [rows], kv, kv, [rows, -1], [1]))))
            self.requests[rows] = core.compile_model(fixed, "CPU", properties).create_infer_request()
        self.weights = weights

    def step_logits(self, tokens: torch.Tensor, features: torch.Tensor, cache: HeadCache,
                    extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``EagleHead.step_logits`` for a chain: the new pairs sit at the next positions and see the cache and
        each other causally; logits of the last row only."""
        start, t = len(cache), int(tokens.shape[0])
        rows = next((r for r in ROWS if r >= t), None)
        width = t if rows is None else rows
        room = start if rows is None else -(-start // CACHE_STEP) * CACHE_STEP
        emb = np.zeros((width, self.hidden), np.float32)
        emb[:t] = self.embed(tokens).detach().float().numpy()
        feat = np.zeros((width, self.hidden), np.float32)
        feat[:t] = features.detach().float().numpy()
        visible = np.zeros((width, room + width), dtype=bool)
        visible[:, :start] = True
        visible[:, room:] = np.tri(width, dtype=bool)  # padding rows come last: no real row sees them
        past_k = np.zeros((1, self.kv_shape[1], room, self.kv_shape[3]), np.float32)
        past_v = np.zeros_like(past_k)
        if start:
            past_k[:, :, :start] = cache.k.float().numpy()
            past_v[:, :, :start] = cache.v.float().numpy()
        out = self.requests[rows].infer([emb, feat, np.arange(start, start + width), past_k, past_v, visible,
                                         np.array([t - 1])], share_inputs=True)
        g, k, v, n, logits = (torch.from_numpy(np.array(o)) for o in out.to_tuple())
        g, k, v = g[:t].to(self.dtype), k[:, :, :t].to(self.dtype), v[:, :, :t].to(self.dtype)
        cache.append(k, v)
        if extra is not None and extra.shape[0]:
            logits = torch.cat([logits, n.to(extra.dtype) @ extra.T], dim=-1)
        return g, logits
