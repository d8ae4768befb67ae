"""The server's API contract: /openapi.json declares every request and response body, real responses match the
declared models, and a schema-driven fuzz run (schemathesis, positive and negative cases) against the running
server finds no 5xx and no response outside the schema."""

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serving import Server
from test_server import CHAT_TEMPLATE, PROMPT
from tiny import loaded, make_model
from verispec.server.schemas import ChatCompletion, Completion, ErrorResponse, Health, ModelList

LIMIT = 8  # max tokens per request on this server: keeps every fuzzed generation short


@pytest.fixture(scope="module")
def long_context_chat_dir(tmp_path_factory):
    """The tiny chat model with a 4096-token window: a prompt past the window is a 400 no schema can foresee
    (it depends on tokenization), and the fuzzer's strings stay far below 4096 tokens."""
    model = make_model()
    model.config.max_position_embeddings = 4096
    path = tmp_path_factory.mktemp("tiny-chat-4k")
    target = loaded(model)
    model.save_pretrained(path)
    target.tokenizer.chat_template = CHAT_TEMPLATE
    target.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def api(long_context_chat_dir):
    s = Server("--target", str(long_context_chat_dir), "--max-queue", "64", "--max-tokens-limit", str(LIMIT),
               "--served-model-name", "tiny", "--admin-token", "sesame")
    yield s
    s.stop()


def test_openapi_declares_request_and_response_bodies(api):
    schema = httpx.get(api.url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/admin/speculation", "SpeculationSwitch")):
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert "400" in op["responses"]
    chat = components["ChatRequest"]["properties"]
    assert chat["model"]["enum"] == ["tiny"]
    assert {"messages", "temperature", "top_p", "seed", "stop", "stream", "verispec"} <= set(chat)
    assert any(o.get("maximum") == LIMIT for o in chat["max_tokens"]["anyOf"])
    assert components["ChatRequest"]["properties"]["temperature"]["maximum"] == 2.0
    ok = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("ChatCompletion") and "text/event-stream" in ok
    for status in ("400", "404", "429"):
        ref = schema["paths"]["/v1/completions"]["post"]["responses"][status]["content"]["application/json"]
        assert ref["schema"]["$ref"].endswith("ErrorResponse")
    assert schema["paths"]["/health"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("Health")
    assert "swagger-ui" in httpx.get(api.url + "/docs").text.lower()


def test_real_responses_match_the_declared_models(api):
    chat = httpx.post(api.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0})
    ChatCompletion.model_validate(chat.json())
    done = httpx.post(api.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    Completion.model_validate(done.json())
    ModelList.model_validate(httpx.get(api.url + "/v1/models").json())
    Health.model_validate(httpx.get(api.url + "/health").json())
    bad = httpx.post(api.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": LIMIT + 1})
    assert bad.status_code == 400
    err = ErrorResponse.model_validate(bad.json()).error
    assert err.param == "max_tokens" and str(LIMIT) in err.message
    unknown = httpx.post(api.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "colour": 1})
    assert unknown.status_code == 400 and "colour" in ErrorResponse.model_validate(unknown.json()).error.message
    for extreme in ({"temperature": 1.1, "top_p": 1.7e-158, "seed": 1}, {"temperature": 2.9e-192}):
        # the request that once made a 500 (top_p rounding to 0 in float32), and a temperature that overflowed
        r = httpx.post(api.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **extreme})
        assert r.status_code == 200, r.text
        ChatCompletion.model_validate(r.json())
    no_auth = httpx.post(api.url + "/admin/speculation", json={"enabled": True})
    assert no_auth.status_code == 401
    ErrorResponse.model_validate(no_auth.json())


def test_schemathesis_fuzz_finds_no_server_error(api, tmp_path):
    """Positive and negative requests generated from the server's own schema: no 5xx, every response's status
    and body as declared. Bounded: a few examples per operation, at most LIMIT tokens per generation."""
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        pytest.fail("schemathesis is not installed; it is part of the test extras: pip install -e '.[test]'")
    report = tmp_path / "junit.xml"
    cmd = [st, "--no-color", "run", api.url + "/openapi.json", "--checks", "all", "--mode", "all", "--max-examples", "15",
           "--phases", "examples,coverage,fuzzing", "--header", "Authorization: Bearer sesame",
           "--seed", "1", "--request-timeout", "60", "--report", "junit", "--report-junit-path", str(report)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert api.alive()
