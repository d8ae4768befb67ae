"""The EAGLE head's draft step compiled ahead of time (AOTInductor), for float32 heads on a CPU.

A chain step of the head is small (one decoder layer, the 8,192 draft-vocabulary rows of the lm_head: ~9 M
parameters for the default model's head), so run eagerly most of its time goes to a dozen small ops and linears
launched from Python. ``StepGraph`` (the step as a function of plain tensors, the graph the OpenVINO engine converts
too) is exported with the number of new pairs (1 to ``MAX_ROWS``) and of cached pairs dynamic and compiled like the
target's one-token step (``verispec.backends.torch_cpu.compile_store``: frozen weights, ``max_autotune``, stored on disk
under a key of the head's weights, config, code, CPU and versions). What it buys: docs/kernels.md ("Figures behind the
code's choices").

``CompiledHeadSteps`` has the torch head's ``step_logits``; the drafter calls whichever engine it was given. A
request's first step (no cached pairs, or more than ``MAX_ROWS`` new ones: the prompt's pairs) and trees run the
torch head. The keys and values the program returns are appended to the same ``HeadCache``, so both mix freely.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

import torch
from torch.export import Dim, export

from ..errors import InvalidRequest
from .head import EagleHead, HeadCache, StepGraph, plain_copy

log = logging.getLogger(__name__)

# new pairs one program call takes: a draft token, or the pairs a verify pass accepted. More run the torch head, which
# is as fast from about this many pairs and faster beyond (its kernels are chosen for wide products; inductor's here
# for a few rows; measured in docs/kernels.md)
MAX_ROWS = 32


def _export(graph: StepGraph):
    c = graph.head.config
    cached, rows = 40, 2
    example = (torch.zeros(rows, c.hidden_size), torch.zeros(rows, c.hidden_size), torch.arange(cached, cached + rows),
               torch.zeros(1, c.num_kv_heads, cached, c.head_dim), torch.zeros(1, c.num_kv_heads, cached, c.head_dim),
               torch.ones(rows, cached + rows, dtype=torch.bool), torch.tensor([rows - 1]))
    new, past, seen = Dim("new", min=1, max=MAX_ROWS), Dim("past", min=1, max=1 << 20), Dim("seen", min=2)
    shapes = ({0: new}, {0: new}, {0: new}, {2: past}, {2: past}, {0: new, 1: seen}, None)
    with torch.no_grad():
        return export(graph, example, dynamic_shapes=shapes)


class CompiledHeadSteps:
    """``head``'s chain steps through its compiled program (``load_or_build``)."""

    def __init__(self, head: EagleHead, runner, seconds: float, loaded: bool, path) -> None:
        self.head, self._runner = head, runner
        self.seconds, self.loaded, self.path = seconds, loaded, path

    @classmethod
    def load_or_build(cls, head: EagleHead, embedding_model, name: str = "", *,
                      cached_only: bool = False) -> "CompiledHeadSteps | None":
        """The program of ``head`` (float32), loaded from the compile cache, else compiled now (about a minute for
        the default model's head on 2 cores) and stored; with ``cached_only`` None when none is stored. Raises what
        the compiler raises."""
        from ..backends.torch_cpu import compile_store

        if head.fuse.weight.dtype != torch.float32 or head.fuse.weight.device.type != "cpu":
            raise InvalidRequest("the compiled eagle head runs float32 heads on CPU; use --eagle-engine torch for "
                                 f"a {str(head.fuse.weight.dtype).removeprefix('torch.')} head or another device")
        graph = StepGraph(plain_copy(head, embedding_model)).eval()
        source = compile_store.source_of(StepGraph, EagleHead, _export) + json.dumps(asdict(head.config),
                                                                                      sort_keys=True, default=str)
        key = compile_store.package_key(graph, f"eagle head step, 1-{MAX_ROWS} pairs", source)
        path = compile_store.package_path(key)
        t0 = time.perf_counter()
        runner = compile_store.load(path)
        if runner is not None:
            return cls(head, runner, time.perf_counter() - t0, True, path)
        if cached_only:
            return None
        missing = compile_store.compiler_missing()
        if missing:
            raise RuntimeError(missing)
        log.warning("compiling the eagle head's draft step%s (about a minute on 2 cores, once per head and machine)"
                    " ...", f" for {name}" if name else "")
        compile_store.save(_export(graph), path, key, name or "eagle head")
        runner = compile_store.load(path)
        if runner is None:
            raise RuntimeError(f"the compiled eagle head written to {path} does not load")
        return cls(head, runner, time.perf_counter() - t0, False, path)

    def step_logits(self, tokens: torch.Tensor, features: torch.Tensor, cache: HeadCache,
                    extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``EagleHead.step_logits``: the new pairs at the next positions see the cache and each other causally;
        logits of the last row only."""
        start, t = len(cache), int(tokens.shape[0])
        if start == 0 or t > MAX_ROWS:
            return self.head.step_logits(tokens, features, cache, extra)
        head = self.head
        visible = torch.ones(t, start + t, dtype=torch.bool)
        if t > 1:
            visible[:, start:] = torch.ones(t, t, dtype=torch.bool).tril()
        # the program reads its inputs with the strides it was exported with (contiguous) and checks none: a cache
        # rolled back by slicing, or one holding a step's transposed keys, must be copied
        g, k, v, n, logits = self._runner(head.embed(tokens).to(torch.float32).contiguous(),
                                          features.to(torch.float32).contiguous(), torch.arange(start, start + t),
                                          cache.k.contiguous(), cache.v.contiguous(), visible, torch.tensor([t - 1]))
        cache.append(k, v)
        if extra is not None and extra.shape[0]:
            logits = torch.cat([logits, n.to(extra.dtype) @ extra.T], dim=-1)
        return g, logits
