"""The OpenVINO backend's pass paths side by side, in one process, interleaved per prompt (docs/results-archive.md,
2026-11-25 15:00 UTC).

    python experiments/openvino_paths.py engines --weights bf16          # paged attention against the stateful graph
    python experiments/openvino_paths.py widths --weights int4           # padding passes to 2, 6 or 8 tokens
    python experiments/openvino_paths.py shapes --weights int4           # what a change of pass width costs
    python experiments/openvino_paths.py static --weights int4           # graphs of static shapes against the dynamic one
    python experiments/openvino_paths.py drafts --weights int4 plain suffix suffix:fill=0 eagle eagle:engine=torch

``engines``, ``widths`` and ``static`` decode Spec-Bench first turns (128 tokens, end of sequence ignored) plainly and with the
n-gram drafter (``static``: suffix drafts too, each request drafting from its own text; fixed k = 5) and print tokens/s and how many answers equal the first configuration's plain decoding. ``shapes``
times passes after 300 cached tokens at one width throughout, then alternating and random widths, on the dynamic
graph and then with the static widths. ``drafts`` races drafter specs (NAME[:option=value...], options of the drafter
plus k= (default 5), policy= (default fixed) and fill=0|1) on one loaded model, suffix drafts each request's own text.
"""

import argparse
import json
import random
import statistics
import time

from verispec import SpeculativeDecoder, make_drafter
from verispec.backends.openvino.model import load
from verispec.bench.prompts import PACKAGED


def prompts(n: int, stride: int) -> list[str]:
    rows = [json.loads(line) for line in PACKAGED.open()]
    return [r["turns"][0] for r in rows[::stride][:n]]


def race(configs: dict, texts: list[str], tokens: int, policy: str = "cost") -> None:
    decoders = {}
    for name, (model, drafter, k) in configs.items():
        model.eos_token_ids = frozenset()
        options = {"scope": "request"} if drafter == "suffix" else {}
        decoders[name] = SpeculativeDecoder(model, make_drafter(drafter, model, **options) if drafter else None, k=k,
                                            k_policy=policy)
        decoders[name].generate(texts[0], max_new_tokens=16)  # warm-up
    totals = {name: [0, 0.0, []] for name in decoders}
    for text in texts:
        for name, decoder in decoders.items():
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=tokens)
            totals[name][1] += time.perf_counter() - t0
            totals[name][0] += len(out.token_ids)
            totals[name][2].append(out.token_ids)
    first = totals[next(iter(totals))][2]
    for name, (n, seconds, answers) in totals.items():
        same = sum(a == b for a, b in zip(answers, first))
        print(f"{name:28s} {n / seconds:7.1f} tok/s   equal to the first: {same}/{len(texts)}")


def drafts(model, specs: list[str], texts: list[str], tokens: int) -> None:
    model.eos_token_ids = frozenset()
    decoders = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        opts = dict(part.split("=", 1) for part in rest.split(":") if part)
        k, policy, fill = int(opts.pop("k", 5)), opts.pop("policy", "fixed"), opts.pop("fill", "1") == "1"
        opts = {key: (float(v) if "." in v else int(v) if v.isdigit() else v) for key, v in opts.items()}
        if name == "suffix":
            opts.setdefault("scope", "request")
        drafter = make_drafter(name, model, **opts) if name != "plain" else None
        decoders[spec] = SpeculativeDecoder(model, drafter, k=k, k_policy=policy, fill_padding=fill)
    totals = {spec: [0, 0.0, 0, 0, 0, []] for spec in decoders}
    for text in texts:
        for spec, decoder in decoders.items():
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=tokens)
            row = totals[spec]
            row[1] += time.perf_counter() - t0
            row[0] += len(out.token_ids)
            row[2] += out.stats.verify_steps
            row[3] += out.stats.filled
            row[4] += out.stats.filled_accepted
            row[5].append(out.token_ids)
    first = totals[specs[0]][5]
    for spec, (n, seconds, steps, filled, taken, answers) in totals.items():
        same = sum(a == b for a, b in zip(answers, first))
        print(f"{spec:32s} {n / seconds:7.1f} tok/s  {n / steps:.2f} tokens/step  guesses {taken}/{filled} accepted  "
              f"equal to the first: {same}/{len(texts)}")


def shapes(model, rounds: int) -> None:
    kv = model.new_kv()
    model.forward(kv, list(range(1000, 1300)), last_only=True)
    rng = random.Random(0)

    def run(label, widths):
        times = []
        for w in widths:
            t0 = time.perf_counter()
            model.forward(kv, list(range(2000, 2000 + w)))
            times.append(1000 * (time.perf_counter() - t0))
            kv.truncate(300)
        print(f"{label:18s} mean {statistics.mean(times[5:]):6.2f} ms")

    for _ in range(rounds):
        run("constant 2", [2] * 60)
        run("constant 6", [6] * 60)
        run("alternating 2, 6", [2, 6] * 30)
        run("random 2..9", [rng.randint(2, 9) for _ in range(60)])
        run("constant 8", [8] * 60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("engines", "widths", "shapes", "static", "drafts"))
    ap.add_argument("specs", nargs="*", help="drafts: the drafter specs to race (plain: no drafter)")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_intermixed_args()
    if args.what == "shapes":
        models = [load("smollm2-135m", args.weights, args.threads, static_widths=w) for w in ((), None)]
        for model in models:
            model.prepare()  # every static width compiled before the timing
        for _ in range(2):  # interleaved: the dynamic graph, then the static widths, twice
            for model in models:
                print(f"static widths: {'/'.join(map(str, model.static_widths)) or 'none'}")
                shapes(model, rounds=1)
        return
    if args.what == "drafts":
        drafts(load("smollm2-135m", args.weights, args.threads), args.specs or ["plain", "suffix"],
               prompts(args.prompts, 40), args.max_new_tokens)
        return
    texts = prompts(args.prompts, 40)
    configs = {}
    if args.what == "engines":
        for attention in ("paged", "masked"):
            model = load("smollm2-135m", args.weights, args.threads, attention=attention)
            configs[f"{attention} plain"] = (model, None, 8)
            configs[f"{attention} ngram"] = (model, "ngram", 8)
    elif args.what == "static":
        for label, widths in (("dynamic", ()), ("static", None)):
            model = load("smollm2-135m", args.weights, args.threads, static_widths=widths)
            for drafter in (None, "suffix", "ngram"):
                configs[f"{label} {drafter or 'plain'}"] = (model, drafter, 5)
        race(configs, texts, args.max_new_tokens, policy="fixed")
        return
    else:
        for width in (2, 6, 8):
            model = load("smollm2-135m", args.weights, args.threads, min_width=width, static_widths=())
            configs[f"min_width {width} plain"] = (model, None, 8)
            configs[f"min_width {width} ngram"] = (model, "ngram", width - 1 if width > 2 else 8)
    race(configs, texts, args.max_new_tokens)


if __name__ == "__main__":
    main()
