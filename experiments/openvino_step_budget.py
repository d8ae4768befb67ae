"""Where an OpenVINO speculative step's time goes, and what a drafter does with the steps (docs/results-archive.md,
2026-11-26 10:15 UTC; issue 35).

    python experiments/openvino_step_budget.py widths --weights int4       # pass cost per static width, 300 cached tokens
    python experiments/openvino_step_budget.py nodes --weights int4        # the plugin's profiling counters by node type
    python experiments/openvino_step_budget.py steps --weights int4        # a suffix run: drafted / accepted per step
    python experiments/openvino_step_budget.py hybrid --weights int4       # suffix drafts, the EAGLE head where they have none
    python experiments/openvino_step_budget.py configs 5/2,4,6 7/2,4,6,8   # suffix drafts: k / static widths, one model each
    python experiments/openvino_step_budget.py profile --prompts 12        # suffix drafts under cProfile: Python around infer
    python experiments/openvino_step_budget.py dispatch --prompts 12       # bound inputs against handing them over per pass

``dispatch`` decodes with plain decoding and suffix drafts on two loads of the model, one whose static passes run
with inputs bound once to their infer request (today's ``paged.BoundInputs``) and one that hands OpenVINO its inputs
and takes back its outputs per pass (before 2026-11-27), interleaved per prompt, two rounds.
``steps``, ``hybrid``, ``configs`` and ``dispatch`` decode Spec-Bench first turns (128 tokens, end of sequence ignored, fixed k). ``hybrid``
races suffix drafts, the EAGLE chain, and a drafter that asks the suffix store first and the EAGLE head (up to 1 or 2
tokens) only where the store has nothing, interleaved per prompt; it prints draft and verify ms per step.
"""

import argparse
import collections
import json
import statistics
import time

from verispec import SpeculativeDecoder
from verispec.backends.openvino.model import load
from verispec.backends.openvino.paged import BoundInputs
from verispec.bench.prompts import PACKAGED
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.suffix import SuffixDrafter


def prompts(n: int, stride: int) -> list[str]:
    rows = [json.loads(line) for line in PACKAGED.open()]
    return [r["turns"][0] for r in rows[::stride][:n]]


def widths(model, rounds: int) -> None:
    kv = model.new_kv()
    model.forward(kv, list(range(100, 400)), last_only=True)
    times = {w: [] for w in model.static_widths}
    for _ in range(rounds):
        for w in model.static_widths:
            t0 = time.perf_counter()
            model.forward(kv, list(range(500, 500 + w)))
            times[w].append(time.perf_counter() - t0)
            kv.truncate(300)
    for w, ts in times.items():
        print(f"width {w:2d}: {statistics.median(ts) * 1e3:6.2f} ms (median of {rounds})")


def nodes(model, rounds: int) -> None:
    kv = model.new_kv()
    model.forward(kv, list(range(100, 400)), last_only=True)
    for w in model.static_widths:
        request = model._paged_requests[(), w]
        by_type, by_node, total = collections.Counter(), collections.Counter(), 0.0
        for r in range(rounds + 5):
            model.forward(kv, list(range(500, 500 + w)))
            kv.truncate(300)
            if r < 5:
                continue
            for node in request.profiling_info:
                ms = node.real_time.total_seconds() * 1e3
                by_type[node.node_type] += ms / rounds
                by_node[node.node_name, node.exec_type] += ms / rounds
                total += ms / rounds
        (name, exec_type), ms = by_node.most_common(1)[0]
        print(f"width {w}: {total:.2f} ms in nodes; " + ", ".join(f"{k} {v:.2f}" for k, v in by_type.most_common(4))
              + f"; slowest node {name} ({exec_type}) {ms:.2f}")


class SuffixThenEagle(EagleDrafter):
    """Suffix drafts where the store has a match, else up to ``head_k`` tokens of the EAGLE head."""

    def __init__(self, target, head_k: int) -> None:
        super().__init__(target)
        self.suffix, self.head_k = SuffixDrafter(scope="request"), head_k
        self.name = f"suffix, else eagle (k {head_k})"

    def reset(self, sampling, generator) -> None:
        super().reset(sampling, generator)
        if hasattr(self, "suffix"):
            self.suffix.reset(sampling, generator)

    def propose(self, context, k, features=None):
        draft = self.suffix.propose(context, k)
        return draft if len(draft) else super().propose(context, min(k, self.head_k), features)


def decode(model, drafters: dict, texts: list[str], k: int, tokens: int) -> dict:
    decoders = {}
    for name, drafter in drafters.items():
        decoders[name] = SpeculativeDecoder(model, drafter, k=k, k_policy="fixed")
        decoders[name].generate(texts[0], max_new_tokens=16)  # warm-up
    runs = {name: [] for name in decoders}
    for text in texts:
        for name, decoder in decoders.items():
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=tokens)
            runs[name].append((out, time.perf_counter() - t0))
    return runs


def profile(model, texts: list[str], k: int, tokens: int) -> None:
    """Suffix drafts at fixed k under cProfile: time inside OpenVINO's ``infer`` against the rest, a pass, and the
    functions that take the most of the rest."""
    import cProfile
    import pstats

    import openvino as ov

    decoder = SpeculativeDecoder(model, SuffixDrafter(scope="request"), k=k, k_policy="fixed")
    decoder.generate(texts[0], max_new_tokens=16)  # warm-up
    inside = {"calls": 0, "seconds": 0.0}
    infer = ov.InferRequest.infer

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return infer(self, *args, **kwargs)
        finally:
            inside["seconds"] += time.perf_counter() - t0
            inside["calls"] += 1

    ov.InferRequest.infer = timed
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for text in texts:
        decoder.generate(text, max_new_tokens=tokens)
    profiler.disable()
    wall = time.perf_counter() - t0
    ov.InferRequest.infer = infer
    n = inside["calls"]
    print(f"{n} passes: {inside['seconds'] * 1e3 / n:.2f} ms inside infer, {(wall - inside['seconds']) * 1e3 / n:.2f} ms "
          "outside it (cProfile's own overhead included)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def configs(args) -> None:
    """Suffix drafts at each fixed k on a model loaded with its own static widths, interleaved per prompt."""
    texts = prompts(args.prompts, args.stride)
    decoders = {}
    for spec in args.configs:
        k, widths = spec.split("/")
        model = load("smollm2-135m", args.weights, args.threads, static_widths=tuple(map(int, widths.split(","))))
        model.eos_token_ids = frozenset()
        decoders[spec] = SpeculativeDecoder(model, SuffixDrafter(scope="request"), k=int(k), k_policy="fixed")
        decoders[spec].generate(texts[0], max_new_tokens=16)  # warm-up
    totals = {spec: [0, 0, 0.0, []] for spec in decoders}
    for text in texts:
        for spec, decoder in decoders.items():
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=args.tokens)
            total = totals[spec]
            total[2] += time.perf_counter() - t0
            total[0] += out.stats.new_tokens
            total[1] += out.stats.verify_steps
            total[3].append(out.token_ids)
    first = totals[args.configs[0]][3]
    for spec, (new, steps, seconds, answers) in totals.items():
        same = sum(a == b for a, b in zip(answers, first))
        print(f"k/widths {spec:16s} {new / seconds:6.1f} tok/s  {new / steps:.2f} tokens a step  "
              f"equal to the first: {same}/{len(texts)}")


class HandedOver(BoundInputs):
    """A static graph's pass as before 2026-11-27: the inputs handed to ``infer`` and the outputs taken back each time."""

    def run(self, inputs) -> None:
        self.out = self.request.infer(inputs, share_inputs=True, share_outputs=True)

    def output(self, name: str):
        return self.out[name]


def dispatch(args, texts: list[str]) -> None:
    decoders = {}
    for name in ("handed over per pass", "bound once"):
        model = load("smollm2-135m", args.weights, args.threads)
        model.prepare(width=args.k + 1)
        model.eos_token_ids = frozenset()
        if name == "handed over per pass":
            for w in model.static_widths:
                model._bound[(), w] = HandedOver(model.ov, model._paged_request((), w))
        for kind, drafter in (("plain", None), ("suffix", SuffixDrafter(scope="request"))):
            decoders[name, kind] = SpeculativeDecoder(model, drafter, k=args.k, k_policy="fixed")
            decoders[name, kind].generate(texts[0], max_new_tokens=16)  # warm-up
    totals = {key: [0, 0.0, []] for key in decoders}
    for _ in range(2):
        for text in texts:
            for key, decoder in decoders.items():
                t0 = time.perf_counter()
                out = decoder.generate(text, max_new_tokens=args.tokens)
                total = totals[key]
                total[0] += out.stats.new_tokens
                total[1] += time.perf_counter() - t0
                total[2].append(out.token_ids)
    for (name, kind), (tokens, seconds, ids) in totals.items():
        same = sum(a == b for a, b in zip(ids, totals["handed over per pass", kind][2]))
        print(f"{name:22s} {kind:6s} {tokens / seconds:6.1f} tok/s  answers equal to the other's: {same}/{len(ids)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("widths", "nodes", "steps", "hybrid", "configs", "profile", "dispatch"))
    ap.add_argument("configs", nargs="*", metavar="K/WIDTHS", help="configs: fixed k and static widths, e.g. 5/2,4,6")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--static", default="2,4,6,8,10,12,16", help="static widths (widths, nodes)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--stride", type=int, default=20)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    static = tuple(int(w) for w in args.static.split(",")) if args.what in ("widths", "nodes") else None
    if args.what == "configs":
        return configs(args)
    if args.what == "dispatch":
        return dispatch(args, prompts(args.prompts, args.stride))
    if args.what == "nodes":
        model = load("smollm2-135m", args.weights, args.threads, static_widths=())
        model._properties["PERF_COUNT"] = True  # the static graphs compiled below count their nodes' time
        model.static_widths = static
        for w in static:
            model._paged_request((), w)
    else:
        model = load("smollm2-135m", args.weights, args.threads, static_widths=static)
        model.prepare()  # every static width compiled before the timing
    model.eos_token_ids = frozenset()
    print(model.kernel)
    if args.what == "widths":
        return widths(model, args.rounds)
    if args.what == "nodes":
        return nodes(model, args.rounds)
    texts = prompts(args.prompts, args.stride)
    if args.what == "profile":
        return profile(model, texts, args.k, args.tokens)
    if args.what == "steps":
        (name, results), = decode(model, {"suffix": SuffixDrafter(scope="request")}, texts, args.k,
                                  args.tokens).items()
        hist = collections.Counter()
        for out, _ in results:
            hist.update(zip(out.stats.step_drafted, out.stats.step_accepted))
        steps = sum(hist.values())
        print(f"{steps} steps, {sum(out.stats.new_tokens for out, _ in results) / steps:.2f} tokens a step")
        for drafted in sorted({d for d, _ in hist}):
            row = [hist[drafted, a] for a in range(drafted + 1)]
            print(f"drafted {drafted}: {sum(row)} steps, accepted 0..{drafted}: {row}")
        return
    drafters = {"suffix": SuffixDrafter(scope="request"), "eagle": EagleDrafter(model),
                "suffix, else eagle k 2": SuffixThenEagle(model, 2), "suffix, else eagle k 1": SuffixThenEagle(model, 1)}
    runs = decode(model, drafters, texts, args.k, args.tokens)
    first = [out.token_ids for out, _ in runs["suffix"]]
    for name, results in runs.items():
        steps = sum(out.stats.verify_steps for out, _ in results)
        new = sum(out.stats.new_tokens for out, _ in results)
        seconds = sum(s for _, s in results)
        draft = sum(out.stats.draft_seconds for out, _ in results) / steps * 1e3
        verify = sum(out.stats.verify_seconds for out, _ in results) / steps * 1e3
        same = sum(out.token_ids == ids for (out, _), ids in zip(results, first))
        print(f"{name:24s} {new / seconds:6.1f} tok/s  {new / steps:.2f} tokens a step  draft {draft:.2f} ms  "
              f"verify {verify:.2f} ms a step  equal to suffix: {same}/{len(results)}")

if __name__ == "__main__":
    main()
