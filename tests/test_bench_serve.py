"""``verispec bench-serve`` against a real server over HTTP (a verispec server on the tiny chat model, in a
subprocess): per-level counts, tokens from the server's usage, latencies in order, errors counted by kind."""

import json

import pytest

from serving import Server
from test_api_contract import long_context_chat_dir  # noqa: F401  (fixture: the tiny chat model folder)
from verispec.bench.load import RequestResult, percentile, summarize_level
from verispec.cli import main


@pytest.fixture(scope="module")
def one_slot_server(long_context_chat_dir):  # noqa: F811
    s = Server("--target", str(long_context_chat_dir), "--served-model-name", "tiny", "--max-concurrency", "1",
               "--max-queue", "0")
    yield s
    s.stop()


def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    # words of the tiny model's vocabulary (w3, w4, ...), so that it answers in visible words
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{3 + (i * 7 + j) % 50}" for j in range(12))}) + "\n"
                            for i in range(5)))
    return path


def test_levels_report_tokens_latencies_and_a_plot(one_slot_server, tmp_path, capsys):
    code = main(["bench-serve", one_slot_server.url, "--concurrency", "1,2", "--requests", "6", "--max-tokens", "6",
                 "--prompts", str(prompts_file(tmp_path)), "--out", str(tmp_path / "out")])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == "tiny"  # read from /v1/models
    one, two = result["levels"]
    assert one["concurrency"] == 1 and one["requests"] == 6 and one["completed"] == 6 and one["errors"] == 0
    assert code == 0
    assert one["usage_reported"] and 0 < one["output_tokens"] <= 6 * 6
    assert one["output_tokens_per_second"] > 0 and one["requests_per_second"] > 0
    assert one["ttft_p50_ms"] <= one["ttft_p99_ms"]
    # a second client finds the only slot busy and the queue size 0: refused with 429, counted, not fatal
    assert two["completed"] + two["errors"] == 6 and set(two["errors_by_kind"]) <= {"HTTP 429"}
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    per_request = saved["requests"]["1"]
    assert sum(r["output_tokens"] for r in per_request) == one["output_tokens"]
    # TTFT is the first chunk with visible text; the random model sometimes generates only tokens that decode to
    # nothing (special tokens), and then a request has tokens but no first-token time
    timed = [r for r in per_request if r["ttft"] is not None]
    assert timed and all(r["ttft"] <= r["latency"] for r in timed)
    assert (tmp_path / "out" / "load.png").stat().st_size > 0


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    code = main(["bench-serve", "http://127.0.0.1:9", "--requests", "1", "--out", str(tmp_path)])
    assert code == 2
    assert "/v1/models" in capsys.readouterr().err


def test_summary_arithmetic():
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    ok = RequestResult(ok=True, output_tokens=11, usage_reported=True, ttft=0.5, latency=1.5, chunk_gaps=[0.1] * 10)
    bad = RequestResult(ok=False, error="HTTP 429", latency=0.01)
    s = summarize_level(2, [ok, ok, bad], wall=2.0)
    assert s["completed"] == 2 and s["errors_by_kind"] == {"HTTP 429": 1}
    assert s["output_tokens_per_second"] == 11.0 and s["requests_per_second"] == 1.0
    assert s["tpot_p50_ms"] == pytest.approx(100.0) and s["ttft_p99_ms"] == pytest.approx(500.0)
