"""End-to-end on the real default model: the bench command on Spec-Bench prompts, and the server through
the official openai client. Marked e2e; run in CI."""

import json
import threading
import time

import httpx
import openai
import pytest

from conftest import require_llama_cpp
from serving import Server
from verispec.cli import main

pytestmark = pytest.mark.e2e

COPY_PROMPT = ("Repeat this list exactly, one item per line: alpha beta gamma delta epsilon zeta eta theta iota "
               "kappa lambda mu")


def test_bench_on_spec_bench_prompts(default_model, tmp_path, capsys):
    code = main(["bench", "--categories", "summarization", "--limit", "1", "--max-new-tokens", "48",
                 "--methods", "baseline,ngram,hf:pld,hf:greedy", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert "| method | summarization | overall |" in out
    for name, s in result["overall"].items():
        assert s["identical"] == 1.0, name  # every greedy method reproduces plain decoding exactly
        assert s["new_tokens"] == result["overall"]["baseline"]["new_tokens"]
    assert result["overall"]["ngram"]["drafted"] > 0
    assert result["environment"]["versions"]["transformers"]
    # quality beside the speeds (the other e2e bench runs pass --no-quality): every method runs the model's own
    # float32 weights, so their top-1 tokens are the weights' own
    quality = result["quality"]
    assert set(quality) == {"baseline", "ngram"}, quality  # hf: methods run transformers' own generate
    for name, q in quality.items():
        assert q["top1_agreement"] >= 0.98 and 1.0 < q["perplexity"] < 1000, (name, q)


@pytest.fixture(scope="module", params=["transformers", "llamacpp"])
def server(request, default_model):  # default_model: the model is fetched and cached before the server starts
    # fixed k: the tests assert that drafts were verified, and the cost policy may skip them on a busy machine; on
    # llama.cpp F32 weights, where speculative output is identical to plain decoding (quantized kernels round
    # differently at different pass widths)
    backend = ["--backend", request.param, "--k-policy", "fixed"]
    if request.param == "llamacpp":
        require_llama_cpp()
        backend += ["--weights", "f32"]
    s = Server("--max-queue", "16", *backend)
    s.backend_args = backend
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return server.client()


def test_openai_client_chat_equals_verispec_generate(server, client, capsys):
    messages = [{"role": "user", "content": COPY_PROMPT}]
    resp = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0, max_tokens=40)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=messages, temperature=0, max_tokens=40, stream=True) if c.choices)
    assert main(["generate", COPY_PROMPT, "--max-new-tokens", "40", "--json", *server.backend_args]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert resp.choices[0].message.content == cli["text"] == streamed
    assert resp.model_extra["verispec"]["accepted"] > 0  # the copy prompt is drafted and accepted


def test_disconnect_stops_the_generation(server):
    before = server.metric("verispec_generated_tokens_total")
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 4:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric("verispec_client_disconnects_total") < 1:
        time.sleep(0.2)
    assert server.metric("verispec_client_disconnects_total") == 1
    assert server.metric("verispec_running_requests") == 0
    generated = server.metric("verispec_generated_tokens_total") - before
    assert generated < 200, generated  # far from the 2000 asked for: the generation stopped
    # the slot and the admission go back as the stream's generator closes, a moment after the metric moved
    health = httpx.get(server.url + "/health").json()
    while time.monotonic() < deadline and (health["running"] or health["admitted"]):
        time.sleep(0.2)
        health = httpx.get(server.url + "/health").json()
    assert health["running"] == 0 and health["admitted"] == 0


def test_eight_clients_five_requests_each(server):
    codes = []

    def loop(i):
        c = server.client()
        for j in range(5):
            try:
                c.completions.create(model="smollm2-135m", prompt=f"Count from {i} to {i + 5}:", max_tokens=8,
                                     temperature=0)
                codes.append(200)
            except openai.APIStatusError as exc:
                codes.append(exc.status_code)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 40
    assert server.alive()


def test_server_offers_the_shipped_eagle_head(server, client, capsys):
    prompt = "Give three tips for keeping a houseplant alive."
    if "llamacpp" in server.backend_args:  # on llama.cpp a head is offered only to a server started with it
        assert "eagle" not in httpx.get(server.url + "/health").json()["drafters"]
        with pytest.raises(openai.BadRequestError, match="eagle"):
            client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=4, extra_body={"verispec": {"drafter": "eagle"}})
        return
    resp = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=40, extra_body={"verispec": {"drafter": "eagle"}})
    assert main(["generate", prompt, "--max-new-tokens", "40", "--json", "--drafter", "none", *server.backend_args]) == 0
    assert resp.choices[0].message.content == json.loads(capsys.readouterr().out)["text"]
    stats = resp.model_extra["verispec"]
    assert stats["drafter"] == "eagle" and stats["accepted"] > 0
    assert server.metric("verispec_accepted_tokens_total", 'drafter="eagle"') == stats["accepted"]
    assert "eagle" in httpx.get(server.url + "/health").json()["drafters"]
