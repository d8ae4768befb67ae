"""Soak a running OpenAI-compatible server: many requests of every kind, then check it is still healthy.

    python experiments/soak_serve.py http://127.0.0.1:8000 --requests 1000 --concurrency 8

Requests (seeded, so a run can be repeated): chat and text completions with mixed prompt lengths and max_tokens,
temperatures 0 / 0.7 / 1.0 and top_p 1 / 0.9, streaming and not, some clients that leave after the first chunk,
and a few malformed bodies. Reports status codes by kind, the server's resident memory (its
``process_resident_memory_bytes`` metric) after the first 100 requests and at the end, and passes when no request
got a 5xx, every malformed one got a 4xx, every well-formed one a 200, and memory grew by less than 10%. Writes a
JSON report with --out; the last line printed is that JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

import httpx

WORDS = ("the river crossed a quiet valley where farmers planted barley and kept bees while children ran along "
         "stone walls under an early autumn sky").split()
MALFORMED = [
    b"{not json",
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),  # no model
    json.dumps({"model": "MODEL", "messages": [], "max_tokens": 4}).encode(),
    json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(),
    json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
    json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps({"model": "MODEL", "prompt": [10 ** 9], "max_tokens": 4}).encode(),
]


def plan(n: int, seed: int, model: str) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        kind = rng.choices(["ok", "leave", "malformed"], weights=[88, 8, 4])[0]
        if kind == "malformed":
            body = rng.choice(MALFORMED).replace(b"MODEL", model.encode())
            jobs.append({"kind": kind, "path": rng.choice(["/v1/chat/completions", "/v1/completions"]),
                         "raw": body})
            continue
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 12, 40, 150])))
        chat = rng.random() < 0.7
        body = {"model": model, "max_tokens": rng.choice([1, 8, 32, 64, 128]),
                "temperature": rng.choice([0.0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]),
                "stream": kind == "leave" or rng.random() < 0.5, "seed": rng.randrange(1 << 30)}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        jobs.append({"kind": kind, "path": "/v1/chat/completions" if chat else "/v1/completions", "body": body})
    return jobs


async def send(client: httpx.AsyncClient, job: dict) -> int:
    try:
        if "raw" in job:
            r = await client.post(job["path"], content=job["raw"], headers={"content-type": "application/json"})
            return r.status_code
        if not job["body"]["stream"]:
            return (await client.post(job["path"], json=job["body"])).status_code
        async with client.stream("POST", job["path"], json=job["body"]) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code
            async for line in r.aiter_lines():
                if job["kind"] == "leave" and line.startswith("data:"):
                    return 200  # leave after the first event: closing the stream disconnects
                if line.startswith("data:") and '"error"' in line:
                    return 500  # an error inside a stream counts as a server failure
            return 200
    except httpx.HTTPError as exc:
        return -1 if not isinstance(exc, httpx.TimeoutException) else -2


async def resident_bytes(client: httpx.AsyncClient) -> float | None:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1])
    return None


async def soak(url: str, n: int, concurrency: int, seed: int, timeout: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        jobs = plan(n, seed, model)
        statuses: list[tuple[str, int]] = [("", 0)] * n
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)
        done = 0
        memory = {}
        start = time.perf_counter()

        async def worker():
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                statuses[i] = (jobs[i]["kind"], await send(client, jobs[i]))
                done += 1
                if done == 100 and "after_100" not in memory:
                    memory["after_100"] = await resident_bytes(client)
                if done % 100 == 0:
                    print(f"{done}/{n} requests, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await asyncio.sleep(1.0)
        memory["end"] = await resident_bytes(client)
        health = (await client.get("/health")).json()
    by_kind = {kind: dict(Counter(code for k, code in statuses if k == kind)) for kind in ("ok", "leave", "malformed")}
    five = sum(1 for _, code in statuses if code >= 500 or code < 0)
    malformed_4xx = all(400 <= code < 500 for k, code in statuses if k == "malformed")
    ok_200 = all(code == 200 for k, code in statuses if k in ("ok", "leave"))
    growth = (memory["end"] / memory["after_100"] - 1) if memory.get("after_100") and memory.get("end") else None
    return {
        "url": url, "requests": n, "concurrency": concurrency, "seed": seed,
        "seconds": round(time.perf_counter() - start, 1), "statuses": by_kind, "server_errors": five,
        "malformed_all_4xx": malformed_4xx, "well_formed_all_200": ok_200,
        "rss_after_100_mb": round(memory["after_100"] / 2**20, 1) if memory.get("after_100") else None,
        "rss_end_mb": round(memory["end"] / 2**20, 1) if memory.get("end") else None,
        "rss_growth": round(growth, 4) if growth is not None else None,
        "running_after": health.get("running"), "queued_after": health.get("queued"),
        "passed": five == 0 and malformed_4xx and ok_200 and growth is not None and growth < 0.10,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    report = asyncio.run(soak(args.url.rstrip("/"), args.requests, args.concurrency, args.seed, args.timeout))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
