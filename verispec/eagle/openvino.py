"""The EAGLE head's draft step on OpenVINO, for targets that run there.

On the OpenVINO backend the target's passes use both cores through OpenVINO's own threads, and the torch head ran on
the one thread left to torch: ~1.2 ms a draft token, most of it streaming the float32 draft lm_head (8,192 x 576),
and the target's next pass ran ~1.5 ms slower after torch had run (measured on a Zen 5, docs/openvino.md). Here the
head's step (``EagleHead.step`` then ``EagleHead.logits``) is converted once to an OpenVINO graph, its weights
compressed to int8 (NNCF), and run on the target's threads: ~0.43 ms a one-token step at 300 cached positions. The
drafts change a little (int8 weights); the output cannot: drafts are verified by the target like any others.

``HeadSteps`` and the torch head share one method, ``step_logits``: the drafter calls whichever it was given.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import torch
from torch import nn

from ..backends.openvino.export import import_openvino
from .head import EagleHead, HeadCache

log = logging.getLogger(__name__)


class _Step(nn.Module):
    """What is converted: embeddings and features of T new pairs after P cached ones -> (g [T, H], keys and values
    of the T pairs, out_norm(g) of the last row [1, H], its draft-vocabulary logits [1, V_d])."""

    def __init__(self, head: EagleHead) -> None:
        super().__init__()
        self.head = head
        self.lm_head = nn.Parameter(head.lm_head_d.detach().clone(), requires_grad=False)

    def forward(self, emb, feat, positions, past_k, past_v, visible):
        h = self.head
        x = h.fc(torch.cat([h.embed_norm(emb), h.feature_norm(feat)], dim=-1))[None]
        q, k, v = h.qkv(x, positions)
        g = h.finish(x, q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2), visible[None, None])[0]
        n = h.out_norm(g[-1:])
        return g, k, v, n, n @ self.lm_head.T


class HeadSteps:
    """``head``'s draft steps as a compiled OpenVINO graph (dynamic in the new pairs and the cached ones), run with
    ``threads`` threads; ``weights`` int8 (default) or fp32. Trees take the torch head (their steps need every
    row's logits)."""

    def __init__(self, head: EagleHead, embedding_model, threads: int, weights: str = "int8", core=None) -> None:
        ov = import_openvino()
        c = head.config
        plain = EagleHead(c)  # an unpacked copy: oneDNN's packed linears do not trace
        plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("embed.")}, strict=False)
        plain.train()  # attach() packs a head in eval mode
        plain.attach(embedding_model)
        plain.eval()
        self.head, self.embed = head, head.embed
        self.kv_shape = (1, c.num_kv_heads, 0, c.head_dim)
        cached = 3
        example = (torch.zeros(2, c.hidden_size), torch.zeros(2, c.hidden_size), torch.tensor([cached, cached + 1]),
                   torch.zeros(1, c.num_kv_heads, cached, c.head_dim), torch.zeros(1, c.num_kv_heads, cached, c.head_dim),
                   torch.ones(2, cached + 2, dtype=torch.bool))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's deprecation and its notes on shapes it records
            model = ov.convert_model(_Step(plain).eval(), example_input=example)
        h, kv = c.hidden_size, [1, c.num_kv_heads, -1, c.head_dim]
        model.reshape(dict(zip(model.inputs, ([-1, h], [-1, h], [-1], kv, kv, [-1, -1]))))
        if weights == "int8":
            try:
                import nncf
            except ImportError:
                log.warning("nncf is not installed (pip install \"verispec[openvino]\"): the eagle head's graph keeps "
                            "fp32 weights")
                weights = "fp32"
            else:
                quiet = logging.getLogger("nncf")
                level = quiet.level
                quiet.setLevel(logging.ERROR)  # its per-layer bit-width table, printed at every load otherwise
                try:  # and its progress bar (a second's work)
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
                finally:
                    quiet.setLevel(level)
        compiled = (core or ov.Core()).compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
                                                           "INFERENCE_PRECISION_HINT": "f32",
                                                           "PERFORMANCE_HINT": "LATENCY"})
        self.request = compiled.create_infer_request()
        self.weights = weights

    def step_logits(self, tokens: torch.Tensor, features: torch.Tensor, cache: HeadCache,
                    extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``EagleHead.step_logits`` for a chain: the new pairs sit at the next positions and see the cache and
        each other causally; logits of the last row only."""
        start, t = len(cache), int(tokens.shape[0])
        emb = self.embed(tokens).detach().float().numpy()
        visible = np.ones((t, start + t), dtype=bool)
        if t > 1:
            visible[:, start:] = np.tri(t, dtype=bool)
        past_k = cache.k.numpy() if cache.k is not None else np.zeros(self.kv_shape, np.float32)
        past_v = cache.v.numpy() if cache.v is not None else np.zeros(self.kv_shape, np.float32)
        out = self.request.infer([emb, features.detach().float().numpy(), np.arange(start, start + t), past_k, past_v, visible])
        g, k, v, n, logits = (torch.from_numpy(np.array(o)) for o in out.to_tuple())
        cache.append(k, v)
        if extra is not None and extra.shape[0]:
            logits = torch.cat([logits, n.to(extra.dtype) @ extra.T], dim=-1)
        return g, logits
