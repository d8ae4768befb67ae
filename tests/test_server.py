"""The OpenAI-compatible server, started for real on a loopback port, on the tiny model (a chat template
is added so that chat requests work): the official openai client, streaming, errors, concurrency,
back-pressure, metrics and the off switch."""

import json
import threading
import time

import httpx
import pytest

from serving import Server
from verispec.cli import main

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT = "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tiny_target):
    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_target.model.save_pretrained(path)
    tok = tiny_target.tokenizer
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    tok.chat_template = None
    return path


@pytest.fixture(scope="module")
def server(chat_dir):
    # fixed k: on a tiny model a draft costs as much as it saves, so the controller would run plain steps, and
    # these tests are about what speculation does to the server's counters
    s = Server("--target", str(chat_dir), "--max-queue", "32", "--admin-token", "sesame", "--k-policy", "fixed")
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return server.client(timeout=60)


def test_models_and_health(server, client, chat_dir):
    ids = [m.id for m in client.models.list().data]
    assert ids == [str(chat_dir)]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["speculation"] is True and "ngram" in health["drafters"]


def test_chat_greedy_equals_verispec_generate(server, client, chat_dir, capsys):
    resp = client.chat.completions.create(model=str(chat_dir), messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, max_tokens=20)
    assert main(["generate", PROMPT, "--target", str(chat_dir), "--max-new-tokens", "20", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert resp.choices[0].message.content == cli["text"]
    assert resp.choices[0].finish_reason == cli["finish_reason"]
    assert resp.usage.completion_tokens == len(cli["token_ids"])
    meta = resp.model_extra["verispec"]
    assert meta["speculation"] is True and meta["drafter"] == "suffix" and meta["lossy"] is False


def test_chat_stream_matches_non_stream(server, client, chat_dir):
    kwargs = dict(model=str(chat_dir), messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["verispec"]["drafter"] == "suffix"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_stream_ends_with_done(server, chat_dir):
    body = {"model": str(chat_dir), "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": 5, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_completions_sampling_is_reproducible_by_seed(server, client, chat_dir):
    kwargs = dict(model=str(chat_dir), prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11)
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == a.choices[0].text
    assert a.model_extra["verispec"]["seed"] == 11


def test_n_choices_are_samples_seeded_seed_plus_i(server, client, chat_dir):
    kwargs = dict(model=str(chat_dir), prompt=PROMPT, max_tokens=16, temperature=1.0)
    many = client.completions.create(n=3, seed=11, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    meta = many.model_extra["verispec"]["choices"]
    assert [m["seed"] for m in meta] == [11, 12, 13]
    singles = [client.completions.create(seed=11 + i, **kwargs) for i in range(3)]
    assert [c.text for c in many.choices] == [one.choices[0].text for one in singles]
    assert many.usage.completion_tokens == sum(m["new_tokens"] for m in meta)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # one prompt, counted once


def test_n_choices_stream_interleaved_with_one_end_each(server, client, chat_dir):
    kwargs = dict(model=str(chat_dir), messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=20)
    one = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 2 * one.usage.completion_tokens


def test_request_can_turn_speculation_off(server, client, chat_dir):
    resp = client.completions.create(model=str(chat_dir), prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"verispec": {"speculation": False}})
    meta = resp.model_extra["verispec"]
    assert meta["speculation"] is False and meta["speculation_disabled_by"] == "request" and meta["drafted"] == 0
    on = client.completions.create(model=str(chat_dir), prompt=PROMPT, max_tokens=12, temperature=0)
    assert on.choices[0].text == resp.choices[0].text  # lossless: the switch changes speed, not text


def malformed_requests(model):
    chat = "/v1/chat/completions"
    good = {"model": model, "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2}
    cases = [(chat, raw) for raw in ["", "{", "not json", "[]", "123", "null", '"text"', b"\xff\xfe"]]
    edits = [
        {"model": None}, {"messages": None}, {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "user"}]},
        {"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"model": 5}, {"model": ""}, {"model": "no-such-model"},
        {"max_tokens": 0}, {"max_tokens": -1}, {"max_tokens": "ten"}, {"max_tokens": 1.5}, {"max_tokens": True},
        {"temperature": -0.1}, {"temperature": 2.5}, {"temperature": "hot"}, {"temperature": True},
        {"top_p": 0}, {"top_p": 1.5}, {"top_p": "x"}, {"seed": -1}, {"seed": "abc"}, {"seed": 1.5},
        {"stop": 5}, {"stop": [""]}, {"stop": ["a", "b", "c", "d", "e"]}, {"stream": "yes"}, {"n": 0}, {"n": 65}, {"n": "two"}, {"n": 1.5},
        {"logprobs": True}, {"presence_penalty": 1}, {"frequency_penalty": 0.5},
        {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"response_format": {"type": "json_object"}},
        {"unknown_param": 1}, {"verispec": {"drafter": "eagle"}}, {"verispec": {"k": 0}},
        {"verispec": {"speculation": "no"}}, {"verispec": {"foo": 1}}, {"stream_options": {"include_usage": "y"}},
        {"max_completion_tokens": 0}, {"best_of": 2}, {"messages": [{"role": "user", "content": "  "}]},
        {"messages": [{"role": "user", "content": []}]}, {"seed": False}, {"store": 0},
    ]
    for edit in edits:
        body = {**good, **edit}
        cases.append((chat, json.dumps({k: v for k, v in body.items() if v is not None})))
    comp = {"model": model, "max_tokens": 2}
    for prompt in [None, [], ["a", "b"], 5, [99999], "", " ", "w3 " * 400]:
        body = dict(comp) if prompt is None else {**comp, "prompt": prompt}
        cases.append(("/v1/completions", json.dumps(body)))
    return cases


def test_fifty_malformed_requests_get_openai_style_4xx(server, chat_dir):
    cases = malformed_requests(str(chat_dir))
    assert len(cases) >= 50
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, content in cases:
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, content, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"], (content, err)
        assert http.get("/v1/nope").status_code == 404
        assert http.delete("/v1/models").status_code == 405
    assert server.alive()


def test_specific_statuses_and_messages(server, chat_dir):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.post("/v1/completions", json={"model": str(chat_dir), "prompt": "w3 " * 400})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/v1/chat/completions", json={"model": str(chat_dir), "n": 9,
                                                     "messages": [{"role": "user", "content": "x"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "n" and "--max-batch 9" in err["message"]
        r = http.post("/v1/chat/completions", content="{", headers={"content-type": "application/json"})
        assert "not valid JSON" in r.json()["error"]["message"]


def test_eight_concurrent_clients(server, chat_dir):
    statuses, texts = [], []
    passes0, sequences0 = (server.metric("verispec_batch_passes_total"),
                           server.metric("verispec_batch_sequences_total"))

    def client_loop(i):
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for j in range(5):
                # the n-gram drafter: suffix drafts would write this repeated answer in one or two passes, leaving
                # little to batch
                r = http.post("/v1/completions", json={"model": str(chat_dir), "prompt": PROMPT, "max_tokens": 16,
                                                       "temperature": 0, "stream": j % 2 == 1,
                                                       "verispec": {"drafter": "ngram"}})
                statuses.append(r.status_code)
                if j % 2 == 0:
                    texts.append(r.json()["choices"][0]["text"])

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 40
    assert len(set(texts)) == 1  # greedy answers do not depend on who else was being served
    # they were batched: passes carried several requests each
    passes = server.metric("verispec_batch_passes_total") - passes0
    assert passes > 0 and server.metric("verispec_batch_sequences_total") - sequences0 > 1.5 * passes
    assert server.metric("verispec_batch_size") == 0
    # 40 requests of one prompt: all but the first took most of it from a cached sequence
    assert server.metric("verispec_batch_reused_prompt_tokens_total") > 0.5 * server.metric(
        "verispec_batch_prefill_tokens_total")


def test_client_leaving_mid_stream_frees_its_batch_row(server, chat_dir):
    before = server.metric("verispec_client_disconnects_total")
    tokens = server.metric("verispec_generated_tokens_total")
    body = {"model": str(chat_dir), "prompt": PROMPT, "max_tokens": 200, "temperature": 0.8, "stream": True,
            "verispec": {"speculation": False}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(3):
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (server.metric("verispec_batch_size") or
                                           httpx.get(server.url + "/health").json()["running"]):
        time.sleep(0.1)
    assert server.metric("verispec_batch_size") == 0 and httpx.get(server.url + "/health").json()["running"] == 0
    # the tiny model is fast enough that a generation may finish before its client's leaving is noticed, but not
    # all three: work stopped early
    assert server.metric("verispec_client_disconnects_total") >= before + 1
    assert server.metric("verispec_generated_tokens_total") - tokens < 3 * 200
    r = httpx.post(server.url + "/v1/completions", json={"model": str(chat_dir), "prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200


def test_unbatched_server_gives_the_same_answers(server, client, chat_dir):
    s = Server("--target", str(chat_dir), "--max-batch", "1", "--max-concurrency", "2", "--k-policy", "fixed")
    try:
        for prompt in (PROMPT, "w7 w8 w9 w7 w8"):
            a = client.completions.create(model=str(chat_dir), prompt=prompt, max_tokens=24, temperature=0)
            b = s.client(timeout=60).completions.create(model=str(chat_dir), prompt=prompt, max_tokens=24,
                                                        temperature=0)
            assert a.choices[0].text == b.choices[0].text
        two = s.client(timeout=60).completions.create(model=str(chat_dir), prompt=prompt, max_tokens=24,
                                                      temperature=0, n=2)  # one slot, one sample after the other
        assert [c.text for c in two.choices] == [a.choices[0].text] * 2
        assert httpx.get(s.url + "/health").json()["max_batch"] == 1
        assert "verispec_batch_passes_total" not in httpx.get(s.url + "/metrics").text  # no batch engine there
    finally:
        s.stop()


def test_metrics_move_and_admin_switch_stops_them(server, client, chat_dir):
    def drafted():
        return server.metric("verispec_draft_tokens_total", 'drafter="suffix"')

    before = drafted()
    client.completions.create(model=str(chat_dir), prompt=PROMPT, max_tokens=24, temperature=0)
    assert drafted() > before
    assert server.metric("verispec_generated_tokens_total") > 0
    assert server.metric("verispec_requests_total", 'endpoint="/v1/completions",status="200"') > 0
    text = httpx.get(server.url + "/metrics").text
    for name in ("verispec_accepted_tokens_by_position_total", "verispec_token_latency_seconds_bucket",
                 "verispec_request_duration_seconds_bucket", "verispec_queue_depth",
                 "verispec_acceptance_rate_recent", "verispec_speculation_enabled 1.0"):
        assert name in text

    assert httpx.post(server.url + "/admin/speculation", json={"enabled": False}).status_code == 401
    auth = {"Authorization": "Bearer sesame"}
    r = httpx.post(server.url + "/admin/speculation", json={"enabled": False}, headers=auth)
    assert r.json() == {"enabled": False}
    try:
        frozen = drafted()
        tokens = server.metric("verispec_generated_tokens_total")
        resp = client.completions.create(model=str(chat_dir), prompt=PROMPT, max_tokens=24, temperature=0)
        assert resp.model_extra["verispec"]["speculation_disabled_by"] == "server"
        assert drafted() == frozen
        assert server.metric("verispec_generated_tokens_total") > tokens
        assert server.metric("verispec_speculation_enabled") == 0
    finally:
        httpx.post(server.url + "/admin/speculation", json={"enabled": True}, headers=auth)
    client.completions.create(model=str(chat_dir), prompt=PROMPT, max_tokens=24, temperature=0)
    assert drafted() > frozen


def test_burst_past_the_limit_gets_429_and_server_recovers(chat_dir):
    s = Server("--target", str(chat_dir), "--max-concurrency", "1", "--max-queue", "1")
    try:
        statuses = []
        barrier = threading.Barrier(12)

        def hit():
            barrier.wait()
            r = httpx.post(s.url + "/v1/completions", timeout=120,
                           json={"model": str(chat_dir), "prompt": PROMPT, "max_tokens": 200, "temperature": 0})
            statuses.append((r.status_code, r.json()))

        threads = [threading.Thread(target=hit) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = [c for c, _ in statuses]
        assert 429 in codes and 200 in codes and all(c in (200, 429) for c in codes)
        busy = next(body for c, body in statuses if c == 429)
        assert busy["error"]["code"] == "rate_limit_exceeded" and "retry" in busy["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"model": str(chat_dir), "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200
        assert s.metric("verispec_requests_total", 'endpoint="/v1/completions",status="429"') == codes.count(429)
    finally:
        s.stop()


def test_the_prompt_cache_size_reaches_the_batch_engine(chat_dir, capsys):
    """``--prompt-cache-mb`` sizes the memory finished requests' keys and values are copied into (0: none)."""
    from verispec.server.app import Server as App
    from verispec.server.config import ServeOptions, build_server_config

    for mb in (0, 3):
        app = App(build_server_config(ServeOptions(target=str(chat_dir), drafter="ngram", prompt_cache_mb=mb)))
        try:
            assert app.worker.engine.prompt_cache_bytes == mb << 20
        finally:
            app.close()
    assert main(["serve", "--target", str(chat_dir), "--prompt-cache-mb", "-1"]) == 2
    assert "--prompt-cache-mb must be >= 0" in capsys.readouterr().err


def test_serve_rejects_bad_options(chat_dir, capsys):
    assert main(["serve", "--target", str(chat_dir), "--max-concurrency", "0"]) == 2
    assert "--max-concurrency must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--target", str(chat_dir), "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--target", str(chat_dir), "--max-concurrency", "2"]) == 2
    assert "--max-batch 1" in capsys.readouterr().err
    assert main(["serve", "--target", str(chat_dir), "--eagle-tree"]) == 2
    assert "--max-batch 1" in capsys.readouterr().err
    assert main(["serve", "--target", str(chat_dir), "--acceptance", "typical"]) == 2
    assert "strict" in capsys.readouterr().err
