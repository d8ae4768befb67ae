"""The controller's draft cost as a fixed part plus a part per token (``DraftCost``, since 2026-11-27) against the
old pricing (the mean seconds per drafted token, no fixed part, no exploration), on the compiled default model:
Spec-Bench first turns, greedy, 128 tokens, the two decoders interleaved per prompt (taking turns going first)
over one loaded target, plain decoding beside them.

    python scripts/draft_cost_ab.py [--prompts 12] [--drafters eagle] [--tokens 128]

Prints tok/s, tokens a step, draft tokens verified a step, the fitted draft line and how many answers equal plain
decoding's.
"""

import argparse
import time

from verispec import SpeculativeDecoder, load_model
from verispec.bench.prompts import load_questions
from verispec.controller import DraftCost
from verispec.drafters.registry import make_drafter


class PerToken(DraftCost):
    """What ran before: every second of a proposal priced per token, the same for any length."""

    def line(self) -> tuple[float, float]:
        weights = {n: min(m.count, 20.0) for n, m in self._means.items()}
        total = sum(weights.values())
        return (0.0, sum(m.value / n * weights[n] for n, m in self._means.items()) / total) if total else (0.0, 0.0)

    def explore(self, n: int) -> bool:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="Spec-Bench first turns, spread over the groups")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafters", default="eagle")
    args = ap.parse_args()
    target = load_model("smollm2-135m", compiled="on")
    target.wait_compiled()
    print(target.kernel)
    questions = load_questions(None)
    step = max(1, len(questions) // args.prompts)
    texts = [q.turns[0] for q in questions[::step][: args.prompts]]
    decoders = {("none", "plain"): SpeculativeDecoder(target, None)}
    for drafter in args.drafters.split(","):
        for label in ("fixed + per token", "per token"):
            decoder = SpeculativeDecoder(target, make_drafter(drafter, target))
            if label == "per token":
                decoder.controller.draft = PerToken()
            decoders[drafter, label] = decoder
    for decoder in decoders.values():
        decoder.generate(texts[0], max_new_tokens=16)  # warm-up (and the cost curve's calibration)
    runs = {key: [] for key in decoders}
    for i, text in enumerate(texts):
        keys = list(decoders)
        for key in keys[:1] + (keys[1:] if i % 2 == 0 else keys[:0:-1]):  # the two pricings take turns going first
            decoder = decoders[key]
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=args.tokens)
            runs[key].append((out, time.perf_counter() - t0))
    reference = [out.token_ids for out, _ in runs["none", "plain"]]
    plain_rate = None
    print("| drafter | draft cost | tok/s | vs plain | tokens a step | verified a step | draft line (ms + ms/token) "
          "| tokens predicted / committed | seconds predicted / measured | same as plain |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for (drafter, label), outs in runs.items():
        tokens = sum(len(o.token_ids) for o, _ in outs)
        rate = tokens / sum(s for _, s in outs)
        plain_rate = plain_rate or rate
        steps = max(1, sum(o.stats.verify_steps for o, _ in outs))
        verified = sum(o.stats.drafted for o, _ in outs) / steps
        same = sum(o.token_ids == r for (o, _), r in zip(outs, reference))
        controller = decoders[drafter, label].controller
        fixed, per_token = controller.draft.line()
        line = f"{1e3 * fixed:.2f} + {1e3 * per_token:.2f}" if drafter != "none" else ""
        stats = [o.stats for o, _ in outs]
        predicted = sum(st.predicted_tokens for st in stats) / max(1, sum(sum(st.step_tokens) for st in stats))
        seconds = sum(st.predicted_seconds for st in stats) / max(1e-9, sum(sum(st.step_seconds) for st in stats))
        print(f"| {drafter} | {label} | {rate:.1f} | {rate / plain_rate:.2f}x | {tokens / steps:.2f} | "
              f"{verified:.2f} | {line} | {predicted:.2f} | {seconds:.2f} | {same}/{len(outs)} |", flush=True)


if __name__ == "__main__":
    main()
