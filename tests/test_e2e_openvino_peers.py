"""OpenVINO GenAI as bench peers on the real built-in model: exported once by verispec (no optimum-intel), its plain
and prompt-lookup pipelines run through `verispec bench` beside verispec's own decoding. Marked e2e; CI installs
the OpenVINO extra (VERISPEC_REQUIRE_OPENVINO=1), so a missing openvino-genai fails there instead of skipping."""

import json

import pytest

from conftest import require_openvino
from verispec.backends.references import gguf_file
from verispec.cli import main
from verispec.errors import ModelNotFound

pytestmark = pytest.mark.e2e


def test_bench_runs_openvino_genai_plain_and_prompt_lookup(tmp_path, capsys):
    require_openvino("openvino_genai")
    out = tmp_path / "bench"
    methods = "baseline,openvino,openvino:lookup:kv=f32,openvino:weights=gguf:kv=f32"
    assert main(["bench", "--methods", methods, "--categories", "summarization", "--limit", "1",
                 "--max-new-tokens", "48", "--out", str(out), "--no-plots", "--no-quality"]) == 0
    records = {r["method"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    assert set(records) == {"baseline", "openvino", "openvino:lookup:kv=f32", "openvino:weights=gguf:kv=f32"}
    for r in records.values():
        assert r["new_tokens"] > 0 and sum(r["step_tokens"]) == r["new_tokens"]
    # both start from verispec's prompt ids: the first token (the prompt's prefill) is plain decoding's
    for name in ("openvino", "openvino:lookup:kv=f32"):
        assert records[name]["token_ids"][0] == records["baseline"]["token_ids"][0]
    # a summary repeats its article: prompt lookup commits several tokens in some passes
    assert max(records["openvino:lookup:kv=f32"]["step_tokens"]) > 1
    table = capsys.readouterr().out
    assert "OpenVINO GenAI" in table and "u8 KV cache" in table and "f32 KV cache" in table
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in table  # weights=gguf: GenAI read the model's own file


def test_weights_gguf_needs_a_gguf_file(tmp_path, capsys):
    require_openvino("openvino_genai")
    assert main(["bench", "--methods", "openvino:weights=q4", "--limit", "1", "--out", str(tmp_path / "b"),
                 "--no-plots"]) == 2
    assert "weights= takes as-is, fp32, bf16, fp16, int8, int4 or gguf, got 'q4'" in capsys.readouterr().err
    assert main(["bench", "--methods", "openvino:weights=gguf:draft=smollm2-135m", "--limit", "1", "--out",
                 str(tmp_path / "c"), "--no-plots"]) == 2
    assert "reads a draft model from an exported folder only" in capsys.readouterr().err
    with pytest.raises(ModelNotFound, match="has no GGUF file: pass a built-in name"):
        gguf_file(str(tmp_path))
