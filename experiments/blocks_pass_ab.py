"""In-process A/B of the blocks backend's passes (docs/kernels.md, "On a slower AMD EPYC Zen 3"): one model loaded
once, its passes timed under three settings taken in turn each round: no prefetching and transformers' RMSNorm;
prefetching; prefetching and the native RMSNorm (``RowRMSNorm``). Medians in ms of 3 passes a round after 256 cached
tokens (the first round dropped).

    python experiments/blocks_pass_ab.py --target qwen2.5-coder-1.5b --widths 1,8 --rounds 8
"""

import argparse
import statistics
import time

from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from verispec import blockmm, load_model
from verispec.backends.block_modules import RowRMSNorm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    places = []  # (parent, name, native norm, transformers' norm with the same weight)
    for parent in model.model.modules():
        for name, child in parent.named_children():
            if isinstance(child, RowRMSNorm):
                theirs = Qwen2RMSNorm(child.weight.shape[0], eps=child.eps)
                theirs.weight.data.copy_(child.weight)
                places.append((parent, name, child, theirs))
    settings = {"base": (0, False), "prefetch": (blockmm.PREFETCH, False), "prefetch+norms": (blockmm.PREFETCH, True)}
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(256)], last_only=True)
    took: dict = {(s, w): [] for s in settings for w in widths}
    for r in range(args.rounds + 1):
        for setting, (ahead, native) in settings.items():
            blockmm.set_prefetch(ahead)
            for parent, name, ours, theirs in places:
                setattr(parent, name, ours if native else theirs)
            for w in widths:
                for _ in range(3):
                    t0 = time.perf_counter()
                    model.forward(kv, [(11 * i + r) % 1000 for i in range(w)])
                    kv.truncate(256)
                    if r:
                        took[(setting, w)].append(1e3 * (time.perf_counter() - t0))
    for (setting, w), times in took.items():
        print(f"{setting:16s} w={w}: {statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
