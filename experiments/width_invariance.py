"""Whether a position's logits depend on the width of the pass that computed them, and which part makes them
(issue 32, bfloat16 that keeps greedy identity; docs/kernels.md).

    python experiments/width_invariance.py

For float32 and bfloat16 on the transformers backend (default model, packed linears where the CPU runs them):
1. the model: logits of passes of 1 to 17 tokens after 300 cached ones, each width's rows against the same rows of
   the 17-token pass (bitwise, largest difference, argmax);
2. its parts: one packed linear on random rows, and SDPA over 300 + w keys (the cache as an eager pass reads it), each
   width's rows against the 17-row result, bitwise.
"""

import torch

from verispec.backends import load_model

WIDTHS = (1, 2, 3, 4, 5, 8, 9, 16)


def main() -> None:
    torch.manual_seed(0)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        model = load_model("smollm2-135m", dtype=name)
        kv = model.new_kv()
        model.forward(kv, list(range(1000, 1300)), last_only=True)
        following = list(range(2000, 2017))
        rows = {}
        for w in (*WIDTHS, 17):
            rows[w] = model.forward(kv, following[:w]).logits.float()
            kv.truncate(300)
        print(f"{name} ({model.kernel}): the model's rows against the 17-token pass's")
        for w in WIDTHS:
            diff = float((rows[w] - rows[17][:w]).abs().max())
            same_argmax = bool((rows[w].argmax(-1) == rows[17][:w].argmax(-1)).all())
            print(f"  width {w:2d}: bitwise {torch.equal(rows[w], rows[17][:w])}, max |diff| {diff:.3g}, "
                  f"argmax equal {same_argmax}")
        linear = model.model.model.layers[0].mlp.down_proj
        x = torch.randn(17, linear.in_features, dtype=dtype)
        full = linear(x)
        print(f"  {type(linear).__name__} rows bitwise equal at widths {WIDTHS}:",
              [torch.equal(linear(x[:w]), full[:w]) for w in WIDTHS])
        q, k, v = (torch.randn(1, 9, n, 64, dtype=dtype) for n in (17, 317, 317))

        def attention(w: int) -> torch.Tensor:
            mask = torch.ones(w, 300 + w, dtype=torch.bool).tril(300)
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, :w], k[:, :, :300 + w], v[:, :, :300 + w],
                                                                    attn_mask=mask)

        full = attention(17)
        print(f"  SDPA rows bitwise equal at widths {WIDTHS}:",
              [torch.equal(attention(w), full[:, :, :w]) for w in WIDTHS])


if __name__ == "__main__":
    main()
