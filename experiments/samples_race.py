"""Several samples of one prompt through the server: one request with ``n`` against ``n`` separate requests.

    python experiments/samples_race.py --out runs/DATE-samples [--questions 18] [--n 4] [--temperature 0.7]

Starts ``verispec serve`` (suffix drafter by default; ``--server-args`` for more) and, for each Spec-Bench question
(first turns; ``--questions`` of them, spread over the six groups), in a rotating order:

- ``n``: one chat completion with ``n`` choices (rows of one batch, the prompt prefilled once, each sample drafting
  from the others' text);
- ``separate, one after another``: ``n`` requests for one choice each, sent in turn (a client without ``n``);
- ``separate, at once``: the same ``n`` requests sent together (the server batches them too).

Sample i of every mode has seed ``seed + i``. Writes ``results.json`` (every request's wall time, tokens and errors)
and ``table.md`` (output tokens/s per mode over all questions, the ratio of ``n`` to each, errors) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_serving import machine_line  # noqa: E402
from serving import Server  # noqa: E402

MODES = ("n", "separate, one after another", "separate, at once")


async def chat(http: httpx.AsyncClient, body: dict) -> tuple[int, int]:
    """(completion tokens, errors) of one request."""
    try:
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            print(f"error {r.status_code}: {r.text[:300]}", file=sys.stderr)
            return 0, 1
        return r.json()["usage"]["completion_tokens"], 0
    except httpx.HTTPError as exc:
        print(f"error: {exc!r}", file=sys.stderr)
        return 0, 1


async def run_mode(http, mode: str, base: dict, n: int, seed: int) -> dict:
    t0 = time.perf_counter()
    if mode == "n":
        results = [await chat(http, {**base, "n": n, "seed": seed})]
    elif mode == "separate, one after another":
        results = [await chat(http, {**base, "seed": seed + i}) for i in range(n)]
    else:
        results = await asyncio.gather(*(chat(http, {**base, "seed": seed + i}) for i in range(n)))
    return {"seconds": time.perf_counter() - t0, "tokens": sum(t for t, _ in results),
            "errors": sum(e for _, e in results)}


async def race(url: str, questions, args) -> list[dict]:
    from tqdm import tqdm

    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as http:
        for qi, q in enumerate(tqdm(questions, desc="questions", unit="q")):
            base = {"model": args.model, "messages": [{"role": "user", "content": q.turns[0]}],
                    "max_tokens": args.max_tokens, "temperature": args.temperature}
            order = MODES[qi % 3:] + MODES[: qi % 3]  # rotate: a slow spell hits every mode alike
            for mode in order:
                row = await run_mode(http, mode, base, args.n, seed=1000 * qi)
                rows.append({"question": q.question_id, "group": q.group, "mode": mode, **row})
    return rows


def spread(questions, count: int):
    """``count`` questions taken in turn from each group."""
    groups: dict[str, list] = {}
    for q in questions:
        groups.setdefault(q.group, []).append(q)
    picked, i = [], 0
    while len(picked) < count and any(i < len(g) for g in groups.values()):
        picked += [g[i] for g in groups.values() if i < len(g)][: count - len(picked)]
        i += 1
    return picked


def write(rows: list[dict], args) -> str:
    total = {m: (sum(r["tokens"] for r in rows if r["mode"] == m), sum(r["seconds"] for r in rows if r["mode"] == m),
                 sum(r["errors"] for r in rows if r["mode"] == m)) for m in MODES}
    tps = {m: tok / sec for m, (tok, sec, _) in total.items()}
    lines = [f"{machine_line()}; `python experiments/samples_race.py {' '.join(sys.argv[1:])}`", "",
             f"{len(rows) // 3} questions, n = {args.n}, temperature {args.temperature}, {args.max_tokens} tokens, "
             f"server: `verispec serve {args.server_args}`", "",
             "| mode | output tokens | seconds | tokens/s | n / this | errors |", "|---|---|---|---|---|---|"]
    for m in MODES:
        tok, sec, err = total[m]
        lines.append(f"| {m} | {tok} | {sec:.1f} | {tps[m]:.1f} | {tps['n'] / tps[m]:.2f}x | {err} |")
    text = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows},
                                                      indent=1))
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--questions", type=int, default=18, help="Spec-Bench questions, spread over the groups")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--server-args", default="--drafter suffix --suffix-scope request",
                    help="options of verispec serve (default: suffix drafts, each request (and its samples) from its "
                         "own text, so that modes do not draft from each other's answers to the same question)")
    ap.add_argument("--url", help="race a server already running here instead of starting one")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    from verispec.bench.prompts import load_questions

    args.out.mkdir(parents=True, exist_ok=True)
    questions = spread(load_questions(), args.questions)
    server = None
    if args.url is None:
        server = Server("--target", args.target, "--threads", str(args.threads), "--max-batch", str(max(args.n, 8)),
                        *shlex.split(args.server_args), timeout=900)
    try:
        url = args.url or server.url
        args.model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rows = asyncio.run(race(url, questions, args))
    finally:
        if server is not None:
            server.stop()
    print(write(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
