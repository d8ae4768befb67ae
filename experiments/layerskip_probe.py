"""Teacher-forced agreement of hand-picked layer cuts of the built-in model (docs/drafters.md, layer skipping).

    python experiments/layerskip_probe.py [--target smollm2-135m] [--cuts "25-29" "20-29" "15-19" "12-23"]

Each cut's agreement α: the share of answer positions where the view without those layers predicts the target's own
greedy token (the calibration prompts and answers of ``verispec.drafters.layerskip_search``), and its one-token step
cost relative to the target's.
"""

import argparse

import torch

from verispec import load_model
from verispec.backends.timing import time_passes
from verispec.drafters.layerskip_search import agreement, answers, parse_skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--cuts", nargs="+", default=["5", "25-29", "20-29", "15-19", "12-23", "10-29"])
    args = parser.parse_args()
    target = load_model(args.target)
    with torch.inference_mode():
        sequences = answers(target)
        step = time_passes(target, 128, (1,), repeats=7)[1]
        print(f"{target.name}: {target.num_layers} layers, one-token step {step:.1f} ms")
        for cut in args.cuts:
            view = target.without_layers(parse_skip(cut, target.num_layers))
            alpha = agreement(view.model, sequences, target.tokenizer.pad_token_id or 0)
            cost = time_passes(view, 128, (1,), repeats=7)[1] / step
            print(f"skip {cut:>8}: agreement {alpha:.3f}, step {cost:.2f}x the target's")


if __name__ == "__main__":
    main()
