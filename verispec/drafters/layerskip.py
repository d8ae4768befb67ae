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
from typing import Sequence

from ..backends.base import TargetModel
from ..errors import InvalidRequest
from .layerskip_search import calibrated, format_layers, parse_skip
from .model import ModelDrafter
from .registry import DrafterSpec, Option, register

log = logging.getLogger(__name__)

AUTO = "auto"


class LayerSkipDrafter(ModelDrafter):
    """Drafts with the target's own layers minus ``layers`` (indices, "10,12-14", or "auto": the stored or newly
    measured choice for this target, ``verispec.drafters.layerskip_search``); ``skipped`` holds the layers it leaves
    out and ``calibration`` the measurement behind an automatic choice (None when they were named)."""

    name = "layerskip"

    def __init__(self, target: TargetModel, layers: str | Sequence[int] = AUTO, *, progress: bool = True):
        without = getattr(target, "without_layers", None)
        if without is None:
            where = f"the {target.backend} backend cannot" if target is not None else "it needs the target to"
            raise InvalidRequest(f"layer skipping runs a subset of the target's own layers, which {where} do; use "
                                 "--backend transformers (llama.cpp and OpenVINO run the whole graph in one call)")
        count, skip = target.num_layers, layers
        self.calibration = None
        if isinstance(skip, str) and skip.strip().lower() == AUTO:
            self.calibration = calibrated(target, progress=progress)
            skip = self.calibration.skip
        self.skipped = parse_skip(skip, count)
        super().__init__(without(self.skipped), None)
        log.info("layerskip drafts with %d of the %d layers of %s (skipping %s)", count - len(self.skipped), count,
                 target.name, format_layers(self.skipped))


register(DrafterSpec(
    "layerskip", "the target drafts for itself with some of its own layers skipped (self-speculative, no training)",
    lambda target, draft_model, **options: LayerSkipDrafter(target, **options),
    options=(Option("layers", str, AUTO, "decoder layers --drafter layerskip leaves out, as 10,12-14 (10+12-14 in a "
                    "bench method spec), or auto (default): chosen by a measurement on this target, run once (about "
                    "a minute) and stored", metavar="LAYERS"),),
    backends=("transformers",),
    offered_by_default=False,  # a server offers it when started with it: the first use on a model measures for a minute
    # a server's further drafters reuse the first one's choice instead of looking it up again
    share=lambda drafter: {"layers": format_layers(drafter.skipped)},
))
