"""Pass cost by width and width-dependence of the logits on the llama.cpp (or OpenVINO) backend, per weight format.

    python experiments/llamacpp_costs.py [--formats as-is,q4_0,q8_0,f16,f32] [--context 300] [--repeats 7]
    python experiments/llamacpp_costs.py --backend openvino --formats fp32,fp16,int8,int4
    python experiments/llamacpp_costs.py --target qwen2.5-coder-1.5b --formats as-is --widths 1,2,3,4,5,8,9

For each format (converted once from --target's GGUF file, the built-in Q4_1 file by default; cached): the median ms of one pass over 1/2/5/9/17 new
tokens after --context cached ones (interleaved, first round dropped), and, on a Spec-Bench prompt, the largest
difference between the logits of 9-token passes and those of one-token steps over the same 45 greedy tokens, with
how many argmaxes differ (what decides whether greedy speculation equals plain decoding on that format).
"""

from __future__ import annotations

import argparse
import torch

from verispec import InvalidRequest, SpeculativeDecoder, load_model
from verispec.bench.prompts import load_questions
from verispec.backends.timing import time_passes

WIDTHS = (1, 2, 5, 9, 17)


def width_dependence(model, prompt_ids: list[int], n: int = 45, width: int = 9) -> tuple[float, int]:
    kv = model.new_kv()
    model.forward(kv, prompt_ids[:-1], last_only=True)
    base = len(kv)
    seq, narrow = [prompt_ids[-1]], []
    for _ in range(n):
        row = model.forward(kv, seq[-1:]).logits[-1]
        narrow.append(row)
        seq.append(int(row.argmax()))
    kv.truncate(base)
    wide = torch.cat([model.forward(kv, seq[i : i + width]).logits for i in range(0, n, width)])
    narrow = torch.stack(narrow)
    return float((wide - narrow).abs().max()), int((wide.argmax(-1) != narrow.argmax(-1)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="as-is,q4_0,q8_0,f16,f32")
    ap.add_argument("--target", default="smollm2-135m", help="a built-in name or a GGUF file (default: smollm2-135m)")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="pass widths to time (default: %(default)s)")
    ap.add_argument("--backend", default="llamacpp", choices=["llamacpp", "openvino"])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--question", default="241", help="Spec-Bench question id for the width check (default: 241)")
    args = ap.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    question = next(q for q in load_questions(None) if q.question_id == args.question)
    print("| weights | KV cache | " + " | ".join(f"{w} tok" for w in widths) + " | max logit diff, 9-wide vs 1 | "
          "argmax differs |")
    print("|---|---|" + "---|" * len(widths) + "---|---|")
    for fmt in args.formats.split(","):
        try:
            model = load_model(args.target, backend=args.backend, weights=fmt)
        except InvalidRequest as exc:  # a format this CPU cannot run (bf16 without bf16 instructions)
            print(f"| {fmt} | not run here: {exc} |", flush=True)
            continue
        ms = time_passes(model, args.context, widths, args.repeats)
        ids = SpeculativeDecoder(model).encode(question.turns[0])
        diff, flips = width_dependence(model, ids)
        cells = " | ".join(f"{ms[w]:.1f}" + ("" if w == 1 else f" ({ms[w] / ms[1]:.2f}x)") for w in widths)
        kv = getattr(model, "kv_type", None) or getattr(model, "kv_precision", "")
        print(f"| {fmt} | {kv} | {cells} | {diff:.2g} | {flips} / 45 |", flush=True)
        del model


if __name__ == "__main__":
    main()
