"""In-process A/B of the blocks backend's decoder layers (docs/kernels.md, "On a faster AMD EPYC Zen 3"): one model
loaded once, its passes timed with transformers' own layer forward, the lean forward with q/k/v and gate/up as
separate products, and the lean forward with them joined (what loads by default), taken in turn each round; then the
same with the kernel's products replaced by a no-op, which leaves what the framework around the kernel costs.
Medians in ms of 3 passes a round after --context cached tokens (the first round dropped); the three settings' logits
are checked equal first.

    python experiments/blocks_layers_ab.py --target qwen2.5-coder-1.5b --widths 1,8 --rounds 8
"""

import argparse
import statistics
import time

import torch

import verispec.blockmm as blockmm
from verispec import load_model
from verispec.backends import block_layers
from verispec.backends.hf.layers import decoder_layers


def separate(layer) -> block_layers.LeanForward:
    """The lean forward with every product alone (no joined rows)."""
    lean = block_layers.LeanForward(layer)
    attn, mlp = layer.self_attn, layer.mlp
    lean.qkv.runs = [run for m in (attn.q_proj, attn.k_proj, attn.v_proj) for run in block_layers.Products([m]).runs]
    lean.gate_up.runs = [run for m in (mlp.gate_proj, mlp.up_proj) for run in block_layers.Products([m]).runs]
    return lean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    layers = decoder_layers(model.model)
    joined = [layer.__dict__.get("forward") for layer in layers]
    if any(f is None for f in joined):
        raise SystemExit("not every layer took the lean forward on this model")
    settings = {"transformers": None, "lean, separate products": [separate(layer) for layer in layers],
                "lean, joined products": joined}

    def use(forwards):
        for i, layer in enumerate(layers):
            if forwards is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forwards[i]

    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(args.context)], last_only=True)
    logits = []
    for forwards in settings.values():
        use(forwards)
        logits.append(model.forward(kv, [5, 17, 99, 1000]).logits.clone())
        kv.truncate(args.context)
    print("the same logits in every setting:", all(torch.equal(logits[0], other) for other in logits))

    def run(title: str) -> None:
        took = {(s, w): [] for s in settings for w in widths}
        for r in range(args.rounds + 1):
            for setting, forwards in settings.items():
                use(forwards)
                for w in widths:
                    for _ in range(3):
                        start = time.perf_counter()
                        model.forward(kv, [(11 * i + r) % 1000 for i in range(w)])
                        kv.truncate(args.context)
                        if r:
                            took[(setting, w)].append(1e3 * (time.perf_counter() - start))
        print(title)
        for (setting, w), times in took.items():
            print(f"  {setting:26s} w={w}: {statistics.median(times):.1f} ms")

    run("whole passes:")
    native = blockmm._native

    class NoProducts:  # the native module with its matrix product a no-op
        def __getattr__(self, name):
            return getattr(native, name)

        @staticmethod
        def matmul(*_):
            return None

    blockmm._native = NoProducts()
    try:
        run("without the kernel's products (what the rest of the pass costs):")
    finally:
        blockmm._native = native
    use(joined)


if __name__ == "__main__":
    main()
