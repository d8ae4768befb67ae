"""Self-speculative drafting: the target drafts for itself with some of its layers skipped (no training).

The draft model is a view of the target that shares every weight (embeddings, the kept decoder layers, the final
norm and the lm_head) and runs only the kept layers: nothing is copied or trained, and the draft's distribution q is
returned for strict rejection sampling, so the output is the target's whatever is skipped. The view keeps its own KV
cache (the kept layers' keys and values at the draft's own inputs), extended by the committed tokens at each proposal
and cropped after rejections, like any draft model (``verispec.drafters.model``).

Which layers to skip is measured on the target, once (``verispec.drafters.layerskip_search``: a greedy search in the manner
of Draft & Verify, scored by the speedup predicted from teacher-forced agreement and measured step costs) and stored
beside the model's other measurements; ``layers="10,12-14"`` names them instead. Transformers backend only: llama.cpp
and OpenVINO run a whole compiled graph per pass and have no way to leave layers out of it.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from ..backends.base import TargetModel
from ..errors import InvalidRequest
from .base import EMPTY_DRAFT, Draft
from .layerskip_search import Calibration, calibrated, format_layers, parse_skip
from .model import ModelDrafter
from .registry import DrafterSpec, Option, register

log = logging.getLogger(__name__)

AUTO = "auto"


class LayerSkipDrafter(ModelDrafter):
    """Drafts with the target's own layers minus ``layers`` (indices, "10,12-14", or "auto": the stored or newly
    measured choice for this target, ``verispec.drafters.layerskip_search``); ``skipped`` holds the layers it leaves
    out and ``calibration`` the measurement behind an automatic choice (None when they were named). When the
    automatic choice is predicted to be slower than plain decoding, it is ``idle``: it proposes nothing, so the
    engine decodes plainly (named layers always draft)."""

    name = "layerskip"

    def __init__(self, target: TargetModel, layers: str | Sequence[int] | Calibration = AUTO, *,
                 progress: bool = True):
        if target is None or not target.supports_layer_skipping:
            where = f"the {target.backend} backend cannot" if target is not None else "it needs the target to"
            raise InvalidRequest(f"layer skipping runs a subset of the target's own layers, which {where} do; use "
                                 "--backend transformers (llama.cpp and OpenVINO run the whole graph in one call)")
        count, skip = target.num_layers, layers
        self.calibration = None
        if isinstance(skip, str) and skip.strip().lower() == AUTO:
            skip = calibrated(target, progress=progress)
        if isinstance(skip, Calibration):  # an automatic choice, measured here or by a server's first drafter
            self.calibration, skip = skip, skip.skip
        self.skipped = parse_skip(skip, count)
        # an automatic choice predicted to lose drafts nothing: no draft prefill, no probes, plain speed
        self.idle = self.calibration is not None and self.calibration.predicted_speedup <= 1.0
        super().__init__(target.without_layers(self.skipped), None)
        if self.idle:
            if isinstance(layers, str):  # said once, where the choice was looked up (not by a server's copies)
                log.warning("layerskip drafts nothing for %s: no skipped layers are predicted to pay there (%s); "
                            "name layers with --layerskip-layers to draft anyway", target.name,
                            self.calibration.describe())
        else:
            log.info("layerskip drafts with %d of the %d layers of %s (skipping %s)", count - len(self.skipped),
                     count, target.name, format_layers(self.skipped))

    def propose(self, context: Sequence[int], k: int, enough: Callable[[list[float]], bool] | None = None) -> Draft:
        return EMPTY_DRAFT if self.idle else super().propose(context, k, enough)


register(DrafterSpec(
    "layerskip", "the target drafts for itself with some of its own layers skipped (self-speculative, no training)",
    lambda target, draft_model, **options: LayerSkipDrafter(target, **options),
    options=(Option("layers", str, AUTO, "decoder layers --drafter layerskip leaves out, as 10,12-14 (10+12-14 in a "
                    "bench method spec), or auto (default): chosen by a measurement on this target, run once (about "
                    "a minute) and stored", metavar="LAYERS"),),
    runs_on=lambda target: target.supports_layer_skipping,
    requirement="a target that runs a subset of its own layers (transformers)",
    offered_by_default=False,  # a server offers it when started with it: the first use on a model measures for a minute
    # a server's further drafters reuse the first one's choice instead of looking it up again
    share=lambda drafter: {"layers": drafter.calibration or drafter.skipped},
))
