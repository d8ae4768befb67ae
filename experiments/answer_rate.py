"""Answer tokens per second for self-distillation, by way of writing them: transformers' `generate` in one batch
(per dtype) and verispec's batch engine on llama.cpp (per weight format and row count), on the same training
prompts, greedy; and whether the engine's answers equal transformers' float32 ones.

    python experiments/answer_rate.py --prompts 32 --tokens 48
"""

import argparse
import time

import torch

from verispec import SpeculativeDecoder, load_model
from verispec.batching import BatchEngine
from verispec.training.data import generate_answers, read_prompts, select_prompts


def engine_answers(model, prompts, tokens, rows):
    engine = BatchEngine(model, max_batch=rows)
    seqs = []
    for p in prompts:
        d = SpeculativeDecoder(model, reuse_prefix=False)
        seqs.append(engine.submit(d, d.request(p, max_new_tokens=tokens)))
    engine.run()
    return [list(s.result.token_ids) for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--file", default="data/train-prompts/train_prompts.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(2)
    texts = read_prompts(args.file)
    reference = None
    for dtype in ("float32", "bfloat16"):
        target = load_model("smollm2-135m", dtype=dtype)
        prompts = select_prompts(target, texts, args.prompts, 320, 0)
        generate_answers(target, prompts[:4], 4)
        start = time.perf_counter()
        answers = generate_answers(target, prompts, args.tokens)
        n = sum(len(a) for a in answers)
        print(f"transformers {dtype}, batch {len(prompts)}: {n / (time.perf_counter() - start):.1f} answer tokens/s")
        reference = reference or answers
    for weights in ("f16", "as-is"):
        for rows in (16, 32, 1):
            model = load_model("smollm2-135m", backend="llamacpp", weights=weights, sequences=rows + 1)
            engine_answers(model, prompts[:2], 4, 2)
            start = time.perf_counter()
            answers = engine_answers(model, prompts, args.tokens, rows)
            n = sum(len(a) for a in answers)
            same = sum(a == r for a, r in zip(answers, reference))
            print(f"llama.cpp {weights}, {rows} rows: {n / (time.perf_counter() - start):.1f} answer tokens/s; "
                  f"{same} of {len(answers)} answers equal transformers float32's")
            del model


if __name__ == "__main__":
    main()
