"""Serving throughput with continuous batching: bench-serve against several server configurations, interleaved.

    python experiments/batch_serving.py --out runs/DATE-batching [--levels 1,2,4,8,16] [--requests 16]

Starts one ``verispec serve`` per configuration (all on the built-in model, float32, loopback), waits for them,
then for every concurrency level runs ``verispec bench-serve`` against each configuration in turn (so a slow
spell of a shared machine hits every configuration of a level alike). Configurations:

- ``one-slot``: ``--max-batch 1`` (one request per pass, as the server ran before batching), levels 1 and 8 only
- ``off``: ``--max-batch 8 --speculation-off``
- ``fixed``: ``--max-batch 8 --k-policy fixed`` (every draft token the n-gram drafter offers, up to k)
- ``adaptive``: ``--max-batch 8`` (the default: the cost-aware controller, seeing the batch's pass)

Writes each run's bench-serve folder, ``table.md`` (output tokens/s per level and configuration, adaptive's ratio
to the better of off and fixed, TTFT/TPOT P50) and ``table.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import Server  # noqa: E402

CONFIGS = {
    "one-slot": ["--max-batch", "1"],
    "off": ["--max-batch", "8", "--speculation-off"],
    "fixed": ["--max-batch", "8", "--k-policy", "fixed"],
    "adaptive": ["--max-batch", "8"],
}
ONE_SLOT_LEVELS = {1, 8}


def bench(url: str, level: int, requests: int, max_tokens: int, out: Path, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "verispec", "bench-serve", url, "--concurrency", str(level), "--requests",
           str(requests), "--max-tokens", str(max_tokens), "--out", str(out), "--no-plots", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if not done.stdout.strip():
        raise RuntimeError(f"bench-serve failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["levels"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every level this often, rotating the order of "
                                                           "the configurations each round; the table gives medians")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--server-args", default="", help="more options for every server, e.g. \"--backend llamacpp "
                                                      "--weights f32\"")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    names = args.configs.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    servers = {}
    rows: dict[int, dict[str, list[dict]]] = {}
    try:
        for name in names:
            servers[name] = Server("--target", args.target, "--max-queue", "64", "--drafter", "ngram", *CONFIGS[name],
                                   *shlex.split(args.server_args), timeout=600)
            print(f"{name}: {servers[name].url}", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for level in levels:
                for name in order:
                    if name == "one-slot" and level not in ONE_SLOT_LEVELS:
                        continue
                    t0 = time.perf_counter()
                    folder = f"{name}-c{level}" + (f"-r{r}" if args.rounds > 1 else "")
                    summary = bench(servers[name].url, level, args.requests, args.max_tokens, args.out / folder)
                    summary["round"] = r
                    for key in ("passes", "sequences", "speculating"):  # cumulative over the server's life
                        summary[f"batch_{key}"] = servers[name].metric(f"verispec_batch_{key}_total")
                    rows.setdefault(level, {}).setdefault(name, []).append(summary)
                    print(f"round {r} c={level} {name}: {json.dumps(summary)} ({time.perf_counter() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
                    (args.out / "table.json").write_text(json.dumps(rows, indent=2))
    finally:
        for s in servers.values():
            s.stop()
    write_table(rows, names, args)
    return 0


def _tps(summary: dict | None):
    return summary.get("output_tokens_per_second") if summary else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def machine_line() -> str:
    """Today's date and the CPU a serving measurement ran on, for the head of its table."""
    from verispec.backends.torch_cpu.cpu import cpu_info

    cpu = cpu_info()
    return f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores of {cpu['model']} ({', '.join(cpu['flags'])})"


def write_table(rows: dict, names: list[str], args) -> None:
    """Median output tokens/s per level and configuration over the rounds; adaptive's ratio to the better of off
    and fixed, per round (both from the same round) and its median; TPOT P50 medians."""
    head = ("| clients | " + " | ".join(f"{n} tok/s" for n in names) + " | adaptive / best(off, fixed) per round | "
            "median | " + " | ".join(f"{n} TPOT P50 ms" for n in names) + " | errors |")
    lines = [head, "|" + "---|" * (2 * len(names) + 4)]
    for level, by in sorted(rows.items()):
        cells = [f"{m:.1f}" if (m := _median([_tps(x) for x in by.get(n, [])])) else "" for n in names]
        ratios = []
        for r in range(args.rounds):
            this = {n: next((x for x in by.get(n, []) if x["round"] == r), None) for n in ("off", "fixed", "adaptive")}
            best = max([_tps(this[n]) or 0 for n in ("off", "fixed")])
            if this["adaptive"] and best:
                ratios.append(_tps(this["adaptive"]) / best)
        tpot = [f"{m:.1f}" if (m := _median([x.get("tpot_p50_ms") for x in by.get(n, [])])) else "" for n in names]
        errors = sum(x.get("errors", 0) for runs in by.values() for x in runs)
        lines.append(f"| {level} | " + " | ".join(cells) + f" | {', '.join(f'{x:.2f}' for x in ratios)} | "
                     f"{f'{statistics.median(ratios):.2f}' if ratios else ''} | " + " | ".join(tpot) + f" | {errors} |")
    text = "\n".join(lines) + "\n"
    extra = f" --server-args {shlex.quote(args.server_args)}" if args.server_args else ""
    (args.out / "table.md").write_text(
        f"{machine_line()}\n\n"
        f"`python experiments/batch_serving.py --out {args.out} --levels {args.levels} --requests {args.requests} "
        f"--max-tokens {args.max_tokens} --rounds {args.rounds} --configs {args.configs}{extra}`\n\n" + text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
