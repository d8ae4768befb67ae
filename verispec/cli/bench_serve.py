"""``verispec bench-serve URL``: load an OpenAI-compatible server at several concurrency levels (argument parsing
and printing; the measurement lives in ``verispec.bench.load``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from .bench import _out_dir, _prompt_options, _questions
from ..errors import InvalidRequest


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser(
        "bench-serve", help="load-test an OpenAI-compatible server (verispec's, vLLM's, llama.cpp's, ...)",
        description="Send streaming chat completions to URL from N concurrent clients at each --concurrency level "
                    "(a fixed number of requests per level, Spec-Bench prompts or a JSONL file, first turns) and "
                    "report aggregate output tokens/s, requests/s, time to first token (TTFT) and time per output "
                    "token (TPOT) P50/P99, chunk gaps and errors. Writes results.json, summary.md and a plot to "
                    "--out; prints the table, and last a one-line JSON summary.")
    p.add_argument("url", metavar="URL", help="server base URL, e.g. http://127.0.0.1:8000 (no /v1)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts (default: 1,2,4,8)")
    p.add_argument("--requests", type=int, default=16, help="requests per level (default: 16)")
    p.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature of every request (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before one request counts as failed")
    _prompt_options(p, limit_default=None)
    p.add_argument("--out", metavar="DIR", help="results folder (default: bench-serve-results/<UTC time>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    p.set_defaults(func=cmd_bench_serve)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequest(f"--concurrency must be comma-separated whole numbers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise InvalidRequest(f"--concurrency needs client counts >= 1, got {text!r}")
    return levels


def _model_name(url: str, timeout: float) -> str:
    import httpx

    try:
        listed = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout).json()["data"]
        return listed[0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise InvalidRequest(f"could not read the model list at {url}/v1/models ({exc}); is the server up? Pass "
                             "--model NAME to skip the lookup") from None


def cmd_bench_serve(args) -> int:
    import asyncio

    from tqdm import tqdm

    from ..bench import load

    levels = _levels(args.concurrency)
    if args.requests < 1 or args.max_tokens < 1:
        raise InvalidRequest("--requests and --max-tokens must be >= 1")
    prompts = [[{"role": "user", "content": q.turns[0]}] for q in _questions(args)]
    if not prompts:
        raise InvalidRequest("no prompts selected; check --prompts / --categories")
    model = args.model or _model_name(args.url, min(args.timeout, 30))
    out = _out_dir(args, "bench-serve")
    summaries, raw = [], {}
    with tqdm(total=args.requests * len(levels), desc="requests", file=sys.stderr, disable=None) as bar:
        for n in levels:
            bar.set_postfix_str(f"{n} clients")
            results, wall = asyncio.run(load.run_level(args.url, model, prompts, n, args.requests, args.max_tokens,
                                                       args.temperature, args.timeout, progress=lambda: bar.update(1)))
            summaries.append(load.summarize_level(n, results, wall))
            raw[str(n)] = load.result_dict(results)
    table = load.markdown(summaries)
    files = {"results": str(out / "results.json"), "table": str(out / "summary.md")}
    if not args.no_plots:
        files["plot"] = str(load.plot(summaries, out / "load.png"))
    result = {"command": "verispec " + shlex.join(args.argv), "url": args.url, "model": model,
              "config": {"concurrency": levels, "requests": args.requests, "max_tokens": args.max_tokens,
                         "temperature": args.temperature, "prompts": args.prompts or "spec-bench",
                         "categories": args.categories, "limit": args.limit},
              "files": files, "levels": summaries}
    (out / "results.json").write_text(json.dumps({**result, "requests": raw}, indent=1))
    (out / "summary.md").write_text(table + "\n")
    print(f"bench-serve · {args.url} · model {model} · {args.requests} requests per level · max_tokens "
          f"{args.max_tokens} · temperature {args.temperature}\n")
    print(table)
    print()
    print(json.dumps(result))
    return 0 if all(s["completed"] for s in summaries) else 1
