"""End-to-end with the EAGLE head shipped for the default model. Marked e2e; run in CI."""

import json

import pytest

from verispec import EagleDrafter, SpeculativeDecoder
from verispec.audit import run_audit
from verispec.cli import main
from verispec.eagle.weights import SHIPPED

pytestmark = pytest.mark.e2e

# not training prompts, not Spec-Bench questions
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for keeping a houseplant alive.",
    "Write a Python function that returns the factorial of n.",
]


@pytest.fixture(scope="module")
def decoders(default_model):
    return SpeculativeDecoder(default_model), SpeculativeDecoder(default_model, EagleDrafter(default_model), k=6)


def test_shipped_head_is_small_and_names_its_target():
    folder = SHIPPED["smollm2-135m"]
    config = json.loads((folder / "config.json").read_text())
    assert config["target"] == "smollm2-135m"
    assert (folder / "model.safetensors").stat().st_size < 16 * 2**20


@pytest.mark.parametrize("prompt", PROMPTS)
def test_eagle_greedy_equals_plain_greedy_in_float32(decoders, prompt):
    plain, eagle = decoders
    base = plain.generate(prompt, max_new_tokens=64)
    fast = eagle.generate(prompt, max_new_tokens=64)
    assert fast.token_ids == base.token_ids and fast.text == base.text
    assert fast.stats.drafter == "eagle" and fast.stats.drafted > 0


def test_shipped_head_gets_several_tokens_accepted_per_step(decoders):
    _, eagle = decoders
    steps = tokens = 0
    for prompt in PROMPTS:
        s = eagle.generate(prompt, max_new_tokens=64).stats
        steps += s.verify_steps
        tokens += sum(s.step_tokens)
    assert tokens / steps > 2.0  # greedy, so deterministic for these weights; measured values are in the README


def test_audit_passes_with_the_eagle_drafter_at_temperature_1(default_model):
    decoder = SpeculativeDecoder(default_model, EagleDrafter(default_model), k=4)
    prompt_ids = decoder.encode("Write a short poem about the sea.")
    report = run_audit(decoder, prompt_ids, temperature=1.0, samples=150, positions=3, seed=0)
    assert report.passed, report.to_dict()


def test_bench_has_an_eagle_method(default_model, tmp_path, capsys):
    code = main(["bench", "--categories", "writing", "--limit", "1", "--max-new-tokens", "32",
                 "--methods", "baseline,eagle:k=6", "--out", str(tmp_path), "--no-plots"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    eagle = result["overall"]["eagle:k=6"]
    assert eagle["identical"] == 1.0 and eagle["drafted"] > 0 and eagle["mean_accepted_tokens"] > 1.0
