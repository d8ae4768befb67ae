"""Are the packed bfloat16 linears' rows independent of the pass width on the model's *own* activations? (issue
32; docs/kernels.md). experiments/width_invariance.py asks it on random rows; this script feeds each linear of every
layer the rows it really gets in a 3-token pass after 300 cached tokens, and compares each row computed alone (one
row, M = 1) and in pairs (M = 2) with the same row of the 3-row product, bitwise. Then it times the model with
attention computed one query row at a time over exactly the keys that row sees (a width-invariant attention, in
principle) against transformers' SDPA.

    python experiments/linear_width_identity.py
"""

import time

import torch
from torch import nn
from transformers import AttentionInterface

from verispec.backends import load_model
from verispec.backends.torch_cpu.cpu import cpu_info


def row_by_row_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA for each query row alone over the keys it sees (plain causal passes only): the same call, shapes and
    values for a position whatever the pass's width."""
    batch, heads, rows, dim = query.shape
    out = query.new_empty(batch, rows, heads, dim)
    for i in range(rows):
        seen = key.shape[2] - rows + i + 1
        out[:, i] = nn.functional.scaled_dot_product_attention(
            query[:, :, i : i + 1], key[:, :, :seen], value[:, :, :seen], scale=scaling, enable_gqa=True)[:, :, 0]
    return out, None


AttentionInterface.register("verispec_row_by_row", row_by_row_attention)


def main() -> None:
    print(f"CPU {cpu_info()['model']} {cpu_info()['flags']}")
    model = load_model("smollm2-135m", dtype="bfloat16")
    layers = model.model.model.layers
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_pre_hook(
                lambda mod, args, key=f"{index}.{name}": inputs.__setitem__(key, args[0].detach().clone())))
        for name in ("gate_proj", "up_proj", "down_proj"):
            hooks.append(getattr(layer.mlp, name).register_forward_pre_hook(
                lambda mod, args, key=f"{index}.{name}": inputs.__setitem__(key, args[0].detach().clone())))
    kv = model.new_kv()
    model.forward(kv, list(range(1000, 1300)), last_only=True)
    model.forward(kv, [2000, 2001, 2002])
    for hook in hooks:
        hook.remove()
    differing = []
    with torch.inference_mode():
        for key, x in inputs.items():
            index, name = key.split(".")
            parent = layers[int(index)].self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layers[int(index)].mlp
            linear = getattr(parent, name)
            full = linear(x)
            alone = [torch.equal(linear(x[:, r : r + 1]), full[:, r : r + 1]) for r in range(3)]
            pairs = torch.equal(linear(x[:, :2]), full[:, :2])
            if not all(alone) or not pairs:
                differing.append(f"{key} (rows alone equal: {alone}, first two as a pair: {pairs})")
    print(f"{len(inputs)} linears on their own 3-row inputs; {len(differing)} with a row that depends on M:")
    for line in differing:
        print("  ", line)
    following = list(range(2000, 2017))
    for implementation in ("sdpa", "verispec_row_by_row"):
        model.model.set_attn_implementation(implementation)
        kv.truncate(300)
        times = {}
        for width in (1, 4, 9, 17):
            runs = []
            for _ in range(7):
                t0 = time.perf_counter()
                model.forward(kv, following[:width])
                runs.append(time.perf_counter() - t0)
                kv.truncate(300)
            times[width] = 1e3 * sorted(runs)[3]
        print(f"{implementation}: median ms a pass at widths 1/4/9/17: "
              + " / ".join(f"{times[w]:.1f}" for w in times))


if __name__ == "__main__":
    main()
