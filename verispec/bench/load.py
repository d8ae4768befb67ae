"""Load generation against any OpenAI-compatible server (``verispec bench-serve``): real HTTP, streaming.

At each concurrency level, N clients take requests from a shared list (a fixed number per level, prompts cycled
in order) and send each as a streaming chat completion with ``stream_options.include_usage``. For every request it
records when the first content arrived (time to first token, TTFT), when each later chunk arrived, how many tokens
the server says it generated (``usage.completion_tokens``; servers that send no usage are counted one token per
content chunk), and any error (HTTP status or transport failure).

Per level: aggregate output tokens/s and requests/s (over the level's wall time), TTFT P50/P99, time per output
token after the first (TPOT = (end - first token) / (tokens - 1), per request) P50/P99, the gap between content
chunks P50/P99 (with speculation a chunk may carry several tokens), and errors by kind.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from ..analysis import percentile


@dataclass
class RequestResult:
    ok: bool
    error: str = ""  # "HTTP 429", "ReadTimeout", ...
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float | None = None  # seconds from sending to the first content chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def chat_request(client, url: str, model: str, messages: list[dict], max_tokens: int,
                       temperature: float) -> RequestResult:
    """One streaming chat completion; never raises (a failure is a RequestResult with ``ok=False``)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    chunks = 0
    last = None
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
                result.latency = time.perf_counter() - start
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    result.error = "error event"
                    break
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.usage_reported = True
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.chunk_gaps.append(now - last)
                        last = now
                        chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = type(exc).__name__
        result.latency = time.perf_counter() - start
        return result
    result.latency = time.perf_counter() - start
    if not result.usage_reported:
        result.output_tokens = chunks
    result.ok = not result.error
    return result


async def run_level(url: str, model: str, prompts: Sequence[list[dict]], concurrency: int, requests: int,
                    max_tokens: int, temperature: float, timeout: float,
                    progress: Callable[[], None] | None = None) -> tuple[list[RequestResult], float]:
    """``requests`` requests by ``concurrency`` concurrent clients; returns the results and the wall time."""
    import httpx

    todo: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        todo.put_nowait(prompts[i % len(prompts)])
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            while True:
                try:
                    messages = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await chat_request(client, url, model, messages, max_tokens, temperature))
                if progress:
                    progress()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


def summarize_level(concurrency: int, results: Sequence[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    tokens = sum(r.output_tokens for r in ok)
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "output_tokens": tokens,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "wall_seconds": wall,
        "output_tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "requests_per_second": len(ok) / wall if wall > 0 else 0.0,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
        "chunk_gap_p50_ms": ms(percentile(gaps, 50)), "chunk_gap_p99_ms": ms(percentile(gaps, 99)),
        "mean_latency_s": statistics.mean(r.latency for r in ok) if ok else None,
    }


def markdown(levels: Sequence[dict]) -> str:
    def f(v, fmt="{:.1f}"):
        return "n/a" if v is None else fmt.format(v)

    lines = ["| concurrency | requests | errors | output tok/s | req/s | TTFT P50 / P99 (ms) | TPOT P50 / P99 (ms) "
             "| chunk gap P50 / P99 (ms) |", "|---:|---:|---:|---:|---:|---|---|---|"]
    for s in levels:
        lines.append(
            f"| {s['concurrency']} | {s['requests']} | {s['errors']} | {f(s['output_tokens_per_second'])} | "
            f"{f(s['requests_per_second'], '{:.2f}')} | {f(s['ttft_p50_ms'], '{:.0f}')} / {f(s['ttft_p99_ms'], '{:.0f}')} | "
            f"{f(s['tpot_p50_ms'])} / {f(s['tpot_p99_ms'])} | {f(s['chunk_gap_p50_ms'])} / {f(s['chunk_gap_p99_ms'])} |")
    return "\n".join(lines)


def plot(levels: Sequence[dict], path) -> object:
    """Two panels against concurrency: aggregate output tokens/s; TTFT and TPOT P50."""
    from .plots import _pyplot, _save

    plt = _pyplot()
    xs = [s["concurrency"] for s in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [s["output_tokens_per_second"] for s in levels], marker="o")
    a.set_xlabel("concurrent clients")
    a.set_ylabel("output tokens/s (all clients)")
    a.set_xscale("log", base=2)
    a.set_title("Throughput")
    for key, label in (("ttft_p50_ms", "TTFT P50"), ("tpot_p50_ms", "TPOT P50")):
        b.plot(xs, [s[key] or 0 for s in levels], marker="o", label=label)
    b.set_xlabel("concurrent clients")
    b.set_ylabel("ms")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_title("Latency")
    b.legend()
    return _save(fig, path)


def result_dict(results: Sequence[RequestResult]) -> list[dict]:
    return [asdict(r) for r in results]
