"""End-to-end on the real default model: a second `verispec generate` process starts from the step costs the first
one stored (no calibration) and gives the same greedy output; on the engine `--backend auto` runs it on (blocks) and on
llama.cpp, whose keys are their own code (the transformers backend's: tests/test_measurements.py). Marked e2e; run in
CI."""

import json
import subprocess
import sys

import pytest

from conftest import require_llama_cpp

pytestmark = pytest.mark.e2e

PROMPT = ("Summarize in two sentences: The committee met on Monday to review the budget. The committee approved "
          "the budget after a long debate, and the mayor signed the budget on Friday.")


def generate(env, *extra):
    out = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", PROMPT, "--json", "--max-new-tokens", "48",
                          *extra], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out)


@pytest.mark.parametrize("backend", ["blocks", "llamacpp"])
def test_a_second_process_skips_calibration_and_decodes_the_same(default_model, backend, tmp_path, monkeypatch):
    if backend == "llamacpp":
        require_llama_cpp()
    import os

    env = {**os.environ, "VERISPEC_COST_CACHE": str(tmp_path / "costs")}
    extra = ("--backend", backend, *(("--weights", "f32") if backend == "llamacpp" else ()))
    first, second = generate(env, *extra), generate(env, *extra)
    assert first["stats"]["calibration_seconds"] > 0
    assert second["stats"]["calibration_seconds"] == 0
    assert second["token_ids"] == first["token_ids"]
    assert len(list((tmp_path / "costs").glob("cost-curve-*.json"))) == 1
    # other weights, or another engine on the same file (blocks' other threads: tests/test_blocks_gguf.py; more threads
    # than a test worker's one core would spin against each other)
    other = generate(env, *(("--backend", backend, "--weights", "f16") if backend == "llamacpp"
                            else ("--backend", "transformers")))
    assert other["stats"]["calibration_seconds"] > 0  # other settings, another curve: measured, not borrowed
