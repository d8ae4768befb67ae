"""Speculation in one-shot commands against speculation inside one process (the stored cost curve, issue 36).

Each held-out grounded prompt (a Dolly passage wrapped in a summarise / rewrite / extract / correct task, as in
compare_ngram.py; never Spec-Bench) is answered by separate `verispec generate --json` processes with the n-gram
drafter and with none, interleaved per prompt, twice: with the step costs stored by an earlier process (the default)
and with --no-cost-cache (every process calibrates). Then one `verispec bench` process answers the same prompts.
Speedup = mean tokens/s of ngram / mean tokens/s of plain decoding (bench's convention), tokens/s as each process
reports it (new tokens / wall time from the request's start: prefill and calibration included, model load not).

    python experiments/cold_start.py --n 8 --out runs/cold-start
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from compare_ngram import prompt_sets


def generate(prompt: str, drafter: str, env: dict, max_new_tokens: int, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", prompt, "--json", "--drafter", drafter,
                          "--max-new-tokens", str(max_new_tokens), *extra], capture_output=True, text=True,
                         check=True, env=env).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="data/train-prompts/train_prompts.jsonl")
    ap.add_argument("--n", type=int, default=8, help="grounded prompts (default: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True, help="folder for the prompts, records and the bench run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_sets(args.prompts, args.n)["grounded"]
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    env = {**os.environ, "VERISPEC_COST_CACHE": str(out / "costs")}
    generate("Hello", "ngram", env, 16)  # the process before: it stores the step costs
    records = []
    for i, prompt in enumerate(prompts):
        for config, extra in (("stored", ()), ("afresh", ("--no-cost-cache",))):
            order = ("none", "ngram") if i % 2 == 0 else ("ngram", "none")
            for drafter in order:
                r = generate(prompt, drafter, env, args.max_new_tokens, *extra)
                s = r["stats"]
                records.append({"prompt": i, "config": config, "drafter": drafter, "token_ids": r["token_ids"],
                                "tokens_per_second": s["tokens_per_second"], "wall_seconds": s["wall_seconds"],
                                "calibration_seconds": s["calibration_seconds"], "new_tokens": s["new_tokens"]})
                print(json.dumps({k: v for k, v in records[-1].items() if k != "token_ids"}), file=sys.stderr)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    subprocess.run([sys.executable, "-m", "verispec.cli", "bench", "--prompts", str(out / "prompts.jsonl"),
                    "--methods", "baseline,ngram", "--max-new-tokens", str(args.max_new_tokens), "--no-plots",
                    "--out", str(out / "bench")], check=True, env=env, stdout=subprocess.DEVNULL)
    bench = json.loads((out / "bench" / "summary.json").read_text())
    result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "bench_speedup": bench["overall"]["ngram"]["speedup"]}
    for config in ("stored", "afresh"):
        rows = [r for r in records if r["config"] == config]
        tps = {d: statistics.mean(r["tokens_per_second"] for r in rows if r["drafter"] == d) for d in ("none", "ngram")}
        ngram = [r for r in rows if r["drafter"] == "ngram"]
        plain = {r["prompt"]: r["token_ids"] for r in rows if r["drafter"] == "none"}
        result[config] = {
            "speedup": tps["ngram"] / tps["none"],
            "calibration_share": statistics.mean(r["calibration_seconds"] / r["wall_seconds"] for r in ngram),
            "identical": sum(r["token_ids"] == plain[r["prompt"]] for r in ngram) / len(ngram)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
