"""What runs an EAGLE head's draft steps: the torch head itself, its program compiled ahead of time
(``verispec.eagle.compiled``) or its graph on OpenVINO (``verispec.eagle.openvino``).

``choose_engine`` picks one from the ``--eagle-engine`` setting and what the target declares
(``verispec.backends.base.TargetModelBase``): ``auto`` is OpenVINO where the target runs on an OpenVINO core (the
head's graph joins it), the stored compiled program where the target's own one-token step runs compiled, and the
torch head elsewhere. The drafter receives the chosen engine's steps object and never asks which backend it runs on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import InvalidRequest
from .head import EagleHead

log = logging.getLogger(__name__)

ENGINES = ("auto", "torch", "compiled", "openvino", "openvino-fp32")


@dataclass
class HeadEngine:
    """The engine chosen for a head: ``name`` (torch, compiled, openvino, openvino-fp32), whether ``auto`` chose it,
    and ``dtype``, what the head's weights must be in for it."""

    name: str
    chosen: bool
    dtype: torch.dtype
    awaiting: bool = False  # auto, still on torch, for a target that may switch to a compiled step later

    def steps(self, head: EagleHead, target):
        """The object that runs ``head``'s draft steps for ``target`` (the head itself on torch); ``name`` says
        which it is afterwards (a compiled program that is not stored falls back to torch)."""
        if self.name.startswith("openvino"):
            from .openvino import HeadSteps

            # one thread: a step is too small to split; the target's OpenVINO core, so that both graphs share its
            # executor
            return HeadSteps(head, target.embedding_model, 1, "fp32" if self.name == "openvino-fp32" else "int8",
                             core=target.openvino_core)
        if self.name == "compiled" or (self.chosen and compiles(target, head)):
            # auto: a program stored earlier (``verispec compile``), where the target runs compiled too
            compiled = compiled_steps(head, target, cached_only=self.name != "compiled")
            if compiled is not None:
                self.name = "compiled"
                return compiled
            self.name = "torch"
        # auto on a target that still runs eagerly (a server compiling it in the background): look again once the
        # target's own step is there, since the same compile stores the head's program (``verispec compile``)
        self.awaiting = self.chosen and target.compiles_steps and target.step is None
        return head

    def upgrade(self, head: EagleHead, target):
        """The compiled steps once a target that was compiling in the background runs compiled (one look), else
        None."""
        if not self.awaiting or target.step is None:
            return None
        self.awaiting = False  # one look: the target's switch comes after the head's program is stored
        compiled = compiled_steps(head, target, cached_only=True) if compiles(target, head) else None
        if compiled is not None:
            self.name = "compiled"
            log.info("the eagle head's draft steps now run compiled")
        return compiled


def choose_engine(engine: str, precision: str, target,
                  torch_dtype: Callable[[], torch.dtype] | None = None) -> HeadEngine:
    """The engine ``engine`` (one of ENGINES) names for ``target``; ``torch_dtype()`` resolves the torch head's
    precision (``verispec.drafters.precision``), called only when the engine is torch."""
    if engine not in ENGINES:
        raise InvalidRequest(f"eagle engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    chosen = engine == "auto"
    if chosen:
        engine = "openvino" if target.openvino_core is not None else "torch"
    if engine.startswith("openvino") and precision not in ("auto", "float32"):
        raise InvalidRequest(f"the eagle head's OpenVINO graph is converted from float32 weights; "
                             f"--eagle-precision {precision} is for --eagle-engine torch")
    if engine == "compiled" and precision not in ("auto", "float32"):
        raise InvalidRequest(f"the compiled eagle head runs float32 weights; --eagle-precision {precision} is for "
                             "--eagle-engine torch")
    # an OpenVINO graph is converted from the target's float32 weights; a compiled program runs float32
    if engine == "torch":
        dtype = torch_dtype() if torch_dtype is not None else target.dtype
    else:
        dtype = torch.float32 if engine == "compiled" else target.dtype
    return HeadEngine(engine, chosen, dtype)


def compiles(target, head: EagleHead) -> bool:
    """Would ``engine=auto`` look for the head's compiled program: a float32 head on CPU drafting for a target whose
    own one-token step runs compiled (``--compile off`` keeps every part eager)."""
    weight = head.fuse.weight
    return target.step is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"


def compiled_steps(head: EagleHead, target, cached_only: bool = False):
    """The head's ``CompiledHeadSteps``, loaded (or, unless ``cached_only``, built) once per head object and shared
    by the drafters that share the head; None where none is stored (``cached_only``) or compiling failed (warned)."""
    from .compiled import CompiledHeadSteps

    with _COMPILED_LOCK:  # drafters of a server's slots share a head: one of them loads its program
        steps = head.compiled_steps
        if steps is None:
            try:
                steps = _load_or_build(CompiledHeadSteps, head, target, cached_only)
            except InvalidRequest:
                raise
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: the torch head drafts
                log.warning("compiling the eagle head failed (%s: %s); the torch head drafts", type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "")
                return None
            if steps is not None:
                object.__setattr__(head, "compiled_steps", steps)
        return steps


_COMPILED_LOCK = threading.Lock()


def _load_or_build(steps_type, head: EagleHead, target, cached_only: bool):
    """``steps_type.load_or_build``, tried a second time after CPython 3.11's spurious "AST constructor recursion
    depth mismatch" (python/cpython#106905: the ast module's depth counter is shared by threads, so another thread
    parsing at the same moment can trip it; the retry parses alone)."""
    for attempt in (1, 2):
        try:
            return steps_type.load_or_build(head, target.embedding_model, target.name, cached_only=cached_only)
        except SystemError as exc:
            if attempt == 2 or "recursion depth mismatch" not in str(exc):
                raise
            log.info("the eagle head's program met CPython's AST depth race (%s); trying once more", exc)
