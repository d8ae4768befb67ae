"""Race the servers a CPU user would choose between, through the same OpenAI API, at several loads.

    python experiments/race_servers.py --out runs/DATE-race [--levels 1,4,8] [--requests 16] [--llama-server PATH]
                                       [--groups mt_bench,translation,...]

Starts, on the built-in model and the same GGUF file, all on loopback with the same thread count:

- ``llama-server``: llama.cpp's own server, plain (``-np`` = the largest level, continuous batching);
- ``llama-server ngram-mod``: the same with ``--spec-type ngram-mod`` (its pool shared by all slots);
- ``verispec llamacpp``: ``verispec serve --backend llamacpp --max-batch L`` (n-gram drafter, cost controller);
- ``verispec transformers``: ``verispec serve --max-batch L`` (float32, n-gram drafter, cost controller);
- ``verispec default``: ``verispec serve --max-batch L`` with nothing else: the engine ``--backend auto`` picks (on the
  model's own weights) and the default drafter (suffix);

then, for every level, runs ``verispec bench-serve`` against each server in turn (rotating the order each round,
so a slow spell of a shared machine hits all servers of a level alike); with ``--groups``, every level once per group
(``--categories G`` added to the bench arguments; the servers started once). Writes each bench-serve folder,
``table.md`` (output tokens/s per level and server, each server's ratio to plain llama-server, TPOT P50, errors)
and ``table.json``.

Every level asks the same prompts (bench-serve takes the first ``--requests`` of those ``--bench-args`` select, in
turn), so a server that keeps earlier answers (verispec's suffix store, scope ``process``; llama-server's slot prompt
caches) meets the later levels' prompts again; and with fewer prompts than requests, within a level too. ``--fresh``
restarts every server before each level (and group), so that each level's figures are a server's first sight of its
prompts; give at least as many prompts as requests (docs/kernels.md, 2026-12-06 afternoon).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_serving import bench, machine_line  # noqa: E402
from serving import Server  # noqa: E402

SERVERS = ["llama-server", "llama-server ngram-mod", "verispec llamacpp", "verispec transformers",
           "verispec default"]


def start(name: str, args, slots: int, gguf: Path, binary: Path):
    from verispec.bench.llama_server import LlamaServer

    threads = str(args.threads)
    if name.startswith("llama-server"):
        extra = ["--spec-type", "ngram-mod"] if name.endswith("ngram-mod") else []
        return LlamaServer(binary, gguf, args.threads, extra, parallel=slots, ctx=2048 * slots, alias=args.target)
    if name == "verispec default":
        return Server("--target", args.target, "--max-batch", str(slots), "--max-queue", "64", "--threads", threads,
                      *shlex.split(args.verispec_args), timeout=900, env={"VERISPEC_BACKEND": None})
    backend = ["--backend", "llamacpp"] if name.endswith("llamacpp") else ["--backend", "transformers"]
    return Server("--target", args.target, "--max-batch", str(slots), "--max-queue", "64", "--threads", threads,
                  "--drafter", "ngram", *backend, *shlex.split(args.verispec_args), timeout=900)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-server", help="llama-server binary (default: found as verispec bench finds it)")
    ap.add_argument("--verispec-args", default="", help="more options for both verispec servers")
    ap.add_argument("--groups", default="", help="Spec-Bench groups or categories to race one at a time at every "
                                                 "level (default: the prompts as bench-args select them, together)")
    ap.add_argument("--fresh", action="store_true", help="restart every server before each level and group, so no "
                    "server meets prompts an earlier level asked (their answers kept, their caches warm)")
    ap.add_argument("--bench-args", default="", help="more options for bench-serve, e.g. \"--limit 3\" (3 questions "
                                                    "of each Spec-Bench group instead of the first ones)")
    args = ap.parse_args()
    from verispec.backends import load_model
    from verispec.bench.llama_server import find_binary

    levels = [int(x) for x in args.levels.split(",")]
    names = args.servers.split(",")
    unknown = set(names) - set(SERVERS)
    if unknown:
        ap.error(f"unknown server(s) {', '.join(sorted(unknown))}; choose from {', '.join(SERVERS)}")
    gguf = load_model(args.target, backend="llamacpp", threads=args.threads).path
    binary = find_binary(args.llama_server)
    args.out.mkdir(parents=True, exist_ok=True)
    servers, rows = {}, {}
    try:
        for name in names:
            servers[name] = start(name, args, max(levels), gguf, binary)
            print(f"{name}: {servers[name].url}", file=sys.stderr, flush=True)
        groups = args.groups.split(",") if args.groups else [None]
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for i, (group, level) in enumerate([(g, level) for g in groups for level in levels]):
                if args.fresh and (i or r):
                    for name in names:
                        servers[name].stop()
                        servers[name] = start(name, args, max(levels), gguf, binary)
                    print(f"servers restarted before c={level} {group or ''}", file=sys.stderr, flush=True)
                row = f"{level} ({group})" if group else level
                extra = shlex.split(args.bench_args) + (["--categories", group] if group else [])
                for name in order:
                    t0 = time.perf_counter()
                    folder = (f"{name.replace(' ', '-')}-c{level}" + (f"-{group}" if group else "")
                              + (f"-r{r}" if args.rounds > 1 else ""))
                    summary = bench(servers[name].url, level, args.requests, args.max_tokens, args.out / folder, extra)
                    summary["round"] = r
                    rows.setdefault(row, {}).setdefault(name, []).append(summary)
                    print(f"round {r} c={level} {group or ''} {name}: {summary.get('output_tokens_per_second')} "
                          f"tok/s, {summary.get('errors')} errors ({time.perf_counter() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
                    (args.out / "table.json").write_text(json.dumps(rows, indent=2))
    finally:
        for s in servers.values():
            s.stop()
    write_table(rows, names, args, gguf, binary)
    return 0


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def write_table(rows: dict, names: list[str], args, gguf: Path, binary: Path) -> None:
    ref = names[0]
    head = ("| clients | " + " | ".join(f"{n} tok/s" for n in names) + " | "
            + " | ".join(f"{n} / {ref}" for n in names[1:]) + " | " + " | ".join(f"{n} TPOT P50 ms" for n in names)
            + " | errors |")
    lines = [head, "|" + "---|" * (3 * len(names) + 1)]
    for level, by in rows.items():  # in the order raced
        tps = {n: _median([x.get("output_tokens_per_second") for x in by.get(n, [])]) for n in names}
        cells = [f"{tps[n]:.1f}" if tps[n] else "" for n in names]
        ratios = [f"{tps[n] / tps[ref]:.2f}x" if tps[n] and tps[ref] else "" for n in names[1:]]
        tpot = [f"{m:.1f}" if (m := _median([x.get("tpot_p50_ms") for x in by.get(n, [])])) else "" for n in names]
        errors = sum(x.get("errors", 0) for runs in by.values() for x in runs)
        lines.append(f"| {level} | " + " | ".join(cells + ratios + tpot) + f" | {errors} |")
    text = "\n".join(lines) + "\n"
    command = (f"python experiments/race_servers.py --out {args.out} --levels {args.levels} --requests {args.requests} "
               f"--max-tokens {args.max_tokens} --rounds {args.rounds} --servers {shlex.quote(args.servers)}"
               + (f" --bench-args {shlex.quote(args.bench_args)}" if args.bench_args else "")
               + (f" --groups {args.groups}" if args.groups else "") + (" --fresh" if args.fresh else ""))
    (args.out / "table.md").write_text(f"{machine_line()}\n\nModel file {gguf.name}; llama-server {binary}\n\n"
                                       f"`{command}`\n\n" + text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
