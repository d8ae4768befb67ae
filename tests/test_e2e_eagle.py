"""End-to-end with the EAGLE head shipped for the default model. Marked e2e; run in CI."""

import json

import pytest

from verispec import EagleDrafter, SpeculativeDecoder
from verispec.audit import run_audit
from verispec.cli import main
from verispec.eagle.weights import SHIPPED

pytestmark = pytest.mark.e2e

# tokens per step of the shipped head on PROMPTS below (float32, 64 tokens): measured 2.15 (chain) and 2.75
# (tree + lookup) on the development machine (round d: 2.10 and 2.59; the CPU-trained head before it: 1.68 and
# 2.21); the thresholds leave a margin for other CPUs
CHAIN_MAT = 1.7
TREE_MAT = 2.2

# not training prompts, not Spec-Bench questions
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for keeping a houseplant alive.",
    "Write a Python function that returns the factorial of n.",
]


@pytest.fixture(scope="module")
def decoders(default_model):
    tree = EagleDrafter(default_model, tree=True, lookup=True, width=6, depth=5)
    copies = EagleDrafter(default_model, suffix=True)
    copies.isolate()  # drafts from this test's text only
    return (SpeculativeDecoder(default_model), SpeculativeDecoder(default_model, EagleDrafter(default_model), k=6, k_policy="fixed"),
            SpeculativeDecoder(default_model, tree, k=24, k_policy="fixed"),
            SpeculativeDecoder(default_model, copies, k=6, k_policy="fixed"))


def test_shipped_head_is_small_and_names_its_target():
    folder = SHIPPED["smollm2-135m"]
    config = json.loads((folder / "config.json").read_text())
    assert config["target"] == "smollm2-135m"
    assert (folder / "model.safetensors").stat().st_size < 16 * 2**20


def test_eagle_greedy_equals_plain_greedy_in_float32_and_the_shipped_head_gets_drafts_accepted(decoders):
    """Greedy, so deterministic for these weights: every prompt's output is plain decoding's with the chain, the tree
    with lookup and the suffix-joined head; the chain and the tree take more than CHAIN_MAT / TREE_MAT tokens a step
    over the prompts (fixed k: this measures the head, not the controller's cuts)."""
    plain, chain, tree, copies = decoders
    steps = {"eagle": [0, 0], "eagle+lookup": [0, 0]}
    for prompt in PROMPTS:
        base = plain.generate(prompt, max_new_tokens=64)
        for decoder, name in ((chain, "eagle"), (tree, "eagle+lookup"), (copies, "eagle+suffix")):
            fast = decoder.generate(prompt, max_new_tokens=64)
            assert fast.token_ids == base.token_ids and fast.text == base.text, (name, prompt)
            assert fast.stats.drafter == name and fast.stats.drafted > 0
            if name in steps:
                steps[name][0] += sum(fast.stats.step_tokens)
                steps[name][1] += fast.stats.verify_steps
    assert steps["eagle"][0] / steps["eagle"][1] > CHAIN_MAT
    assert steps["eagle+lookup"][0] / steps["eagle+lookup"][1] > TREE_MAT


def test_audit_passes_with_the_eagle_drafter_at_temperature_1(default_blocks):
    decoder = SpeculativeDecoder(default_blocks, EagleDrafter(default_blocks), k=4, k_policy="fixed")
    prompt_ids = decoder.encode("Write a short poem about the sea.")
    report = run_audit(decoder, prompt_ids, temperature=1.0, samples=150, positions=3, seed=0)
    assert report.passed, report.to_dict()


def test_bench_has_an_eagle_method(default_model, tmp_path, capsys):
    code = main(["bench", "--categories", "writing", "--limit", "1", "--max-new-tokens", "32",
                 "--methods", "baseline,eagle:k=6", "--out", str(tmp_path), "--no-plots", "--no-quality"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    eagle = result["overall"]["eagle:k=6"]
    assert eagle["identical"] == 1.0 and eagle["drafted"] > 0 and eagle["mean_accepted_tokens"] > 1.0


def test_train_eagle_answers_with_llama_cpp_as_transformers_would(default_model, tmp_path, capsys):
    """--gen-backend llamacpp: the batch engine on the GGUF weights in F16 writes the answers (2-3x faster than
    transformers on a 2-core CPU); they are the target's greedy answers, token for token (F16 rounding may flip a
    near-tie on some CPU, hence one answer of eight may differ)."""
    from conftest import require_llama_cpp
    from verispec.training.data import generate_answers, load_meta, load_sequences

    require_llama_cpp()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [
        "Name three rivers in Europe.", "What is a prime number?", "Write a haiku about rain.",
        "How do I reverse a list in Python?", "Why is the sky blue?", "Give two tips for sleeping well.",
        "What does a compiler do?", "Describe a cat in one sentence.", "What is 12 times 7?"]))
    args = ["train-eagle", "--prompts", str(prompts), "--out", str(tmp_path / "head"), "--data", str(tmp_path / "data"),
            "--samples", "8", "--max-new-tokens", "24", "--gen-backend", "llamacpp", "--gen-batch-size", "4",
            "--features", "online", "--epochs", "1", "--val-sequences", "1", "--check-prompts", "0",
            "--init-head", str(SHIPPED["smollm2-135m"]), "--batch-tokens", "512", "--max-minutes", "0.2"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] >= 1
    assert load_meta(tmp_path / "data")["answered_by"] == "llama.cpp F16 batch engine"
    stored = list(load_sequences(tmp_path / "data"))
    assert len(stored) == 8
    plain = generate_answers(default_model, [s.tokens[: s.answer_start].tolist() for s in stored], 24)
    same = sum(s.tokens[s.answer_start:].tolist() == answer for s, answer in zip(stored, plain))
    assert same >= 7, f"{same} of 8 llama.cpp answers equal transformers' greedy answers"
