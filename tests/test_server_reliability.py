"""The server under abuse, for a bounded time: 32 concurrent clients mixing good requests (streamed and not) with
oversized bodies, prompts over the token limit, malformed JSON, wrong keys and clients that leave mid-stream, then a
SIGTERM while requests run. Every good request either completes with the output of its lone run or gets a clear
4xx/429/503; nothing answers 5xx; the server's memory comes back near where it started; and after the SIGTERM it
exits cleanly within its grace period, leaving no process behind. A real ``verispec serve`` on the tiny model."""

import json
import os
import random
import signal
import threading
import time

import httpx
import psutil
import pytest

from serving import Server

KEY = "reliable-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["w3 w4 w5 w6 w3 w4", "w7 w8 w9 w7 w8", "w1 w2 w3 w1 w2 w3 w1", "w5 w5 w6 w6 w5"]
STORM_S = 20.0
CLIENTS = 32


def body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}


def streamed_text(response: httpx.Response) -> str:
    text = ""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"] if event["choices"] else ""
    return text


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server("--target", str(tiny_dir), "--served-model-name", "tiny", "--api-key", KEY, "--max-batch", "4",
               "--max-queue", "8", "--max-body-bytes", "8192", "--max-prompt-tokens", "48", "--queue-timeout", "5",
               "--shutdown-grace", "5")
    yield s
    s.stop()


def test_a_server_under_abuse_answers_every_request_honestly_and_shuts_down_clean(server):
    url = server.url
    lone = {}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        for prompt in PROMPTS:  # each good request's lone answer (also warms the server up)
            r = http.post("/v1/completions", json=body(prompt))
            assert r.status_code == 200, r.text
            lone[prompt] = r.json()["choices"][0]["text"]
    proc = psutil.Process(server.proc.pid)
    rss_start = proc.memory_info().rss

    outcomes: list[tuple[str, int, bool]] = []  # (kind, status, output equal to the lone run where it applies)
    lock = threading.Lock()
    stop_at = time.monotonic() + STORM_S

    def record(kind, status, same=True):
        with lock:
            outcomes.append((kind, status, same))

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < stop_at:
                kind = rng.choice(["good", "good", "good-stream", "good-stream", "oversized", "huge-prompt",
                                   "malformed", "wrong-key", "leaves"])
                prompt = rng.choice(PROMPTS)
                try:
                    if kind == "good":
                        r = http.post("/v1/completions", json=body(prompt), headers=AUTH)
                        same = r.status_code != 200 or r.json()["choices"][0]["text"] == lone[prompt]
                        record(kind, r.status_code, same)
                    elif kind == "good-stream":
                        with http.stream("POST", "/v1/completions", json=body(prompt, stream=True),
                                         headers=AUTH) as r:
                            if r.status_code == 200:
                                record(kind, 200, streamed_text(r) == lone[prompt])
                            else:
                                r.read()
                                record(kind, r.status_code)
                    elif kind == "oversized":
                        r = http.post("/v1/completions", json=body("w3 " * 5000), headers=AUTH)
                        record(kind, r.status_code)
                    elif kind == "huge-prompt":
                        r = http.post("/v1/completions", json=body("w3 w4 " * 200), headers=AUTH)
                        record(kind, r.status_code)
                    elif kind == "malformed":
                        r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=AUTH)
                        record(kind, r.status_code)
                    elif kind == "wrong-key":
                        r = http.post("/v1/completions", json=body(prompt),
                                      headers={"Authorization": "Bearer wrong"})
                        record(kind, r.status_code)
                    else:  # a client that leaves after its first chunk
                        with http.stream("POST", "/v1/completions", json=body(prompt, stream=True, max_tokens=200),
                                         headers=AUTH) as r:
                            for _ in r.iter_lines():
                                break
                        record(kind, r.status_code)
                except httpx.HTTPError as exc:  # a transport failure is a failure too
                    record(kind + f" ({type(exc).__name__})", 0, False)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    kinds = {k for k, _, _ in outcomes}
    assert {"good", "good-stream", "oversized", "huge-prompt", "malformed", "wrong-key", "leaves"} <= kinds, kinds
    assert not [o for o in outcomes if o[1] >= 500 or o[1] == 0], [o for o in outcomes if o[1] >= 500 or o[1] == 0]
    expected = {"good": {200, 429, 503}, "good-stream": {200, 429, 503}, "oversized": {413}, "huge-prompt": {400, 429},  # counted after admission
                "malformed": {400}, "wrong-key": {401}, "leaves": {200, 429, 503}}
    wrong = [o for o in outcomes if o[1] not in expected[o[0]]]
    assert not wrong, wrong[:10]
    assert all(same for _, _, same in outcomes), [o for o in outcomes if not o[2]][:10]
    good = [o for o in outcomes if o[0].startswith("good") and o[1] == 200]
    assert len(good) >= 20, len(outcomes)

    time.sleep(2.0)  # the rows of clients that left are freed
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["admitted"] == 0 and health["running"] == 0
    rss_end = proc.memory_info().rss
    assert rss_end < rss_start * 1.25 + 64e6, (rss_start / 1e6, rss_end / 1e6)

    # SIGTERM while requests run: they finish (or are cut after the grace), then the process ends, nothing left
    children = proc.children(recursive=True)
    finished: list[int] = []

    def long_request() -> None:
        try:
            r = httpx.post(url + "/v1/completions", json=body(PROMPTS[0], max_tokens=200), headers=AUTH,
                           timeout=30)
            finished.append(r.status_code)
        except httpx.HTTPError:
            finished.append(0)

    running = [threading.Thread(target=long_request) for _ in range(3)]
    for t in running:
        t.start()
    time.sleep(0.3)
    sent = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    server.proc.wait(timeout=30)
    for t in running:
        t.join()
    # uvicorn ends the process with the signal it caught once its shutdown is done: -SIGTERM after a clean one
    assert server.proc.returncode in (0, -signal.SIGTERM), server.output()[-3000:]
    assert "shut down: admitting nothing, batch worker and background work stopped" in server.output()
    assert time.monotonic() - sent < 5 + 10  # the grace, and the worker's stop
    assert all(status in (200, 503) for status in finished), finished
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert "Traceback" not in server.output(), server.output()[-3000:]
