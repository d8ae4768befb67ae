"""A streaming request cancelled while it waits to send (what Ray Serve does to a replica's request when its client
leaves) stops its generation at once, without waiting for the garbage collector: an ASGI call in process."""

import asyncio
import contextlib
import gc
import json

import pytest

from verispec.drafters.ngram import NgramDrafter
from verispec.server.app import create_app
from verispec.server.config import ServerConfig

PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"


def scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80)}


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_cancelled_stream_stops_its_generation_at_once(tiny_target, max_batch):
    app = create_app(ServerConfig(target=tiny_target, drafters={"ngram": NgramDrafter}, max_batch=max_batch))
    server = app.state.server
    registry = app.state.metrics.registry
    body = json.dumps({"model": server.served, "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                       "stream": True, "verispec": {"speculation": False}}).encode()

    async def scenario() -> list[dict]:
        sent: list[dict] = []
        stuck = asyncio.Event()
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client says nothing more

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) >= 4:
                stuck.set()
                await asyncio.Event().wait()  # the chunk is never taken: the request waits here until cancelled

        task = asyncio.create_task(app(scope("/v1/completions"), receive, send))
        try:
            await asyncio.wait_for(stuck.wait(), 20)
        except TimeoutError:
            raise AssertionError(f"the stream did not start: {sent}") from None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # the task (kept) holds the cancelled frames: only an explicit close can have ended the generation
        assert registry.get_sample_value("verispec_client_disconnects_total") == 1
        assert registry.get_sample_value("verispec_running_requests") == 0
        return sent

    gc.disable()
    try:
        sent = asyncio.run(scenario())
    finally:
        gc.enable()
    assert sent[0]["status"] == 200
    # the slot is free again: a second request runs to its end
    assert server.pool.admitted == 0
