"""The plain server against the same server on Ray Serve: bench-serve at each concurrency, interleaved, repeated.

    python experiments/ray_serving.py --out runs/DATE-ray [--replicas 2 --replica-cpus 1] [--levels 1,8] [--rounds 3]

Starts ``verispec serve`` (one process, batched engine) and ``verispec serve --ray`` (a local Ray instance, REPLICAS
replicas of REPLICA_CPUS CPUs each), both on the built-in model, float32, loopback, the same other options. Then, for
every round and level, runs ``verispec bench-serve`` against one and then the other (the order alternates between
rounds), so a slow spell of a shared machine hits both alike. Both stay up for the whole run: the idle one costs the
other whatever its background work costs (Ray's health checks and metrics, every 2 s).

Writes each run's bench-serve folder, ``table.md`` (output tokens/s, TTFT and TPOT P50 per level, ray / plain per
round and their median) and ``table.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from batch_serving import bench, machine_line  # noqa: E402
from serving import Server  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--replica-cpus", default="1")
    ap.add_argument("--server-args", default="--max-batch 8", help="options for both servers")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    common = shlex.split(args.server_args)
    servers = {}
    try:
        servers["plain"] = Server(*common, timeout=600)
        servers["ray"] = Server("--ray", "--replicas", str(args.replicas), "--replica-cpus", args.replica_cpus,
                                *common, timeout=600)
        deadline = time.monotonic() + 600
        import httpx

        while len(httpx.get(servers["ray"].url + "/metrics/targets", timeout=30).json()) < args.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError("the Ray replicas did not all come up")
            time.sleep(1)
        runs: list[dict] = []
        for r in range(args.rounds):
            for level in levels:
                order = ("plain", "ray") if r % 2 == 0 else ("ray", "plain")
                for name in order:
                    summary = bench(servers[name].url, level, args.requests, args.max_tokens,
                                    args.out / f"{name}-c{level}-r{r}")
                    runs.append({"round": r, "level": level, "server": name, **summary})
                    print(f"round {r} c={level} {name}: {summary['output_tokens_per_second']:.1f} tok/s, "
                          f"errors {summary['errors']}", file=sys.stderr, flush=True)
                    (args.out / "table.json").write_text(json.dumps(runs, indent=1))
    finally:
        for s in servers.values():
            s.stop()
    write_table(runs, levels, args)
    return 0


def _p50(summary: dict, key: str) -> str:
    value = summary.get(f"{key}_p50_ms")
    return f"{value:.0f}" if value is not None else ""


def write_table(runs: list[dict], levels: list[int], args) -> None:
    lines = ["| clients | round | plain tok/s | ray tok/s | ray / plain | plain TTFT P50 ms | ray TTFT P50 ms | "
             "plain TPOT P50 ms | ray TPOT P50 ms | errors |", "|" + "---|" * 10]
    medians = []
    for level in levels:
        ratios = []
        for r in range(args.rounds):
            by = {x["server"]: x for x in runs if x["level"] == level and x["round"] == r}
            if len(by) < 2:
                continue
            p, q = by["plain"], by["ray"]
            ratio = q["output_tokens_per_second"] / p["output_tokens_per_second"]
            ratios.append(ratio)
            lines.append(f"| {level} | {r} | {p['output_tokens_per_second']:.1f} | {q['output_tokens_per_second']:.1f} "
                         f"| {ratio:.2f} | {_p50(p, 'ttft')} | {_p50(q, 'ttft')} | {_p50(p, 'tpot')} | "
                         f"{_p50(q, 'tpot')} | {p['errors'] + q['errors']} |")
        if ratios:
            medians.append(f"{level} clients: median ray / plain {statistics.median(ratios):.2f} "
                           f"({', '.join(f'{x:.2f}' for x in ratios)})")
    text = "\n".join(lines) + "\n\n" + "\n".join(medians) + "\n"
    (args.out / "table.md").write_text(
        f"{machine_line()}\n\n"
        f"`python experiments/ray_serving.py --out {args.out} --levels {args.levels} --rounds {args.rounds} --requests "
        f"{args.requests} --max-tokens {args.max_tokens} --replicas {args.replicas} --replica-cpus "
        f"{args.replica_cpus} --server-args {shlex.quote(args.server_args)}`\n\n" + text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
