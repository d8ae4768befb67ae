"""A draft model's cache kept between requests against dropped at each (docs/draft-models.md, "Catch-up after plain
steps"): the statistical audit of one prompt on the default model with the layer-skip drafter (a draft model over the
target's own layers), whose samples are requests of one prompt, timed both ways in turn each round. The draws are
printed too (drafted and accepted tokens, the verdict): both ways must give the same.

    python experiments/draft_cache_ab.py [--samples 40] [--rounds 2] [--layers 5]
"""

import argparse
import time

from verispec import SpeculativeDecoder, load_model
from verispec.audit import run_audit
from verispec.drafters import model as model_drafter
from verispec.drafters.layerskip import LayerSkipDrafter


def dropping_reset(self, sampling, generator) -> None:
    """``ModelDrafter.reset`` as it was before 2026-12-05: the draft's cache dropped at every request."""
    self.sampling, self.generator = sampling, generator
    self._cache, self._cached = None, []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", default="5", help="the layers the drafter skips")
    ap.add_argument("--prompt", default="Write a short poem about the sea.")
    args = ap.parse_args()
    target = load_model("smollm2-135m")
    keeping = model_drafter.ModelDrafter.reset
    for round_ in range(args.rounds):
        for name, reset in (("kept", keeping), ("dropped", dropping_reset)):
            model_drafter.ModelDrafter.reset = reset
            decoder = SpeculativeDecoder(target, LayerSkipDrafter(target, args.layers), k=3, k_policy="fixed")
            ids = decoder.encode(args.prompt)
            start = time.perf_counter()
            report = run_audit(decoder, ids, temperature=0.7, samples=args.samples, positions=3, seed=0)
            print(f"round {round_}: cache {name:8s} {time.perf_counter() - start:6.1f} s  {report.verdict}, "
                  f"drafted {report.drafted}, accepted {report.accepted}", flush=True)
    model_drafter.ModelDrafter.reset = keeping


if __name__ == "__main__":
    main()
