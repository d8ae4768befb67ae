"""A server exposed on a network: API keys on every route but /health (compared in constant time), CORS, the body,
prompt, message, stop and name limits with their 4xx, Retry-After on 429/503, the queue and request deadlines, an
honest /health, and the lifespan's end stopping what runs beside the handlers. In process (FastAPI's TestClient)
on the tiny model, except the command-line warning."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from verispec.cli import main
from verispec.drafters.ngram import NgramDrafter
from verispec.server import ServerConfig, create_app
from verispec.server.http import APIError
from verispec.server.limits import bearer, is_loopback, key_matches, split_keys

PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"


def app_for(target, **config):
    return create_app(ServerConfig(target=target, drafters={"ngram": NgramDrafter}, **config))


def completion(app, **extra):
    return {"model": app.state.server.served, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}


def test_keys_guard_every_route_but_health(tiny_target):
    app = app_for(tiny_target, api_keys=("k-one", "k-two"), admin_token="sesame", max_batch=1)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            r = http.get(path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key" and "--api-key" in r.json()["error"]["message"]
            assert r.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models", headers={"Authorization": "Bearer k-three"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Basic k-one"}).status_code == 401
        for key in ("k-one", "k-two"):
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        r = http.post("/v1/completions", json=completion(app), headers={"Authorization": "Bearer k-two"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # /admin takes the admin token (an API key is not enough), compared in constant time too
        assert http.get("/admin/speculation", headers={"Authorization": "Bearer k-one"}).status_code == 401
        assert http.get("/admin/speculation", headers={"Authorization": "Bearer sesame"}).json() == {"enabled": True}


def test_without_an_admin_token_the_api_keys_guard_admin(tiny_target):
    with TestClient(app_for(tiny_target, api_keys=("k",), max_batch=1)) as http:
        assert http.post("/admin/speculation", json={"enabled": False}).status_code == 401
        r = http.post("/admin/speculation", json={"enabled": False}, headers={"Authorization": "Bearer k"})
        assert r.json() == {"enabled": False}


def test_key_helpers():
    assert key_matches("b", ("a", "b")) and not key_matches("c", ("a", "b")) and not key_matches(None, ("a",))
    assert not key_matches("", ("a",))
    assert bearer([(b"authorization", b"Bearer  tok ")]) == "tok" and bearer([(b"authorization", b"Basic x")]) is None
    assert split_keys(" a, ,b ") == ("a", "b") and split_keys(None) == ()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_cors_preflight_needs_no_key_and_names_the_origin(tiny_target):
    app = app_for(tiny_target, api_keys=("k",), cors_origins=("https://app.example",), max_batch=1)
    with TestClient(app) as http:
        r = http.options("/v1/completions", headers={"Origin": "https://app.example",
                                                      "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = http.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers
        r = http.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_limits_answer_4xx_naming_the_option(tiny_target):
    app = app_for(tiny_target, max_body_bytes=2048, max_prompt_tokens=12, max_messages=2, max_batch=1)
    with TestClient(app) as http:
        r = http.post("/v1/completions", json=completion(app, prompt="w3 " * 1000))
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

        def chunked():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"w3 " * 10
            yield b'"}'
        r = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = http.post("/v1/completions", json=completion(app, prompt="w3 w4 " * 20))
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
        assert "--max-prompt-tokens" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
        chat = {"model": app.state.server.served, "max_tokens": 2,
                "messages": [{"role": "user", "content": "w3"}] * 3}
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "--max-messages" in r.text
        r = http.post("/v1/completions", json=completion(app, stop=["x" * 257]))
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop")
        chat["messages"] = [{"role": "user", "content": "w3", "name": "n" * 65}]
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "name" in r.json()["error"]["param"]
        assert http.post("/v1/completions", json=completion(app)).status_code == 200  # still serving


def test_busy_answers_carry_retry_after(tiny_target):
    app = app_for(tiny_target, max_batch=1, max_queue=0)
    server = app.state.server
    assert server.pool.reserve(1)  # the one place is taken
    with TestClient(app) as http:
        r = http.post("/v1/completions", json=completion(app))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    server.pool.unreserve(1)


def test_a_request_waiting_past_the_queue_deadline_gets_503(tiny_target):
    app = app_for(tiny_target, max_batch=1, queue_timeout=0.05)
    server = app.state.server

    async def scenario():
        held = await server.pool.acquire(1)
        with pytest.raises(APIError) as info:
            await server.acquire(1)
        server.pool.release(held[0])
        return info.value

    err = asyncio.run(scenario())
    assert err.status == 503 and err.headers["Retry-After"] == "1" and "--queue-timeout" in err.message
    assert server.metrics.queue_timeouts._value.get() == 1


def test_a_generation_past_the_request_deadline_is_stopped(tiny_target):
    app = app_for(tiny_target, max_batch=1, request_timeout=1e-9)
    with TestClient(app) as http:
        r = http.post("/v1/completions", json=completion(app, max_tokens=50))
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        assert "--request-timeout" in r.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json=completion(app, max_tokens=50, stream=True)) as s:
            lines = [line for line in s.iter_lines() if line]
        assert '"request_timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert app.state.server.pool.admitted == 0 and app.state.server.pool.busy == 0  # all given back


def test_health_is_503_when_closing_or_the_worker_died_and_the_lifespan_stops_the_worker(tiny_target):
    app = app_for(tiny_target, max_batch=4)
    server = app.state.server
    with TestClient(app) as http:
        assert http.get("/health").json()["status"] == "ok"
        server.worker.stop()  # the batch thread gone: say so
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "worker_stopped"
    app = app_for(tiny_target, max_batch=4)
    server = app.state.server
    with TestClient(app) as http:
        assert server.worker.alive
        server.closing = True
        r = http.post("/v1/completions", json=completion(app))
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "shutting down" in r.text
        assert http.get("/health").json()["status"] == "shutting_down"
    assert not server.worker.alive  # the lifespan's end stopped it


def test_serving_beyond_loopback_without_a_key_warns(tiny_dir, capsys, monkeypatch):
    import uvicorn

    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: ran.append(self.config.host))
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    assert main(["serve", "--target", str(tiny_dir), "--host", "0.0.0.0", "--max-batch", "1"]) == 0
    assert ran == ["0.0.0.0"] and "without an API key" in capsys.readouterr().err
    assert main(["serve", "--target", str(tiny_dir), "--host", "0.0.0.0", "--api-key", "k", "--max-batch", "1"]) == 0
    assert "without an API key" not in capsys.readouterr().err
