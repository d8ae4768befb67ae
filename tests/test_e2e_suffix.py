"""The suffix drafter on the real built-in model: greedy output identical to plain decoding on the transformers and
llama.cpp (F32) backends, drafts from an earlier request's answer (a repeated request is mostly drafted), and the
bench over the shipped repetition workload. Marked e2e; run in CI."""

import json

import pytest

from conftest import require_llama_cpp
from verispec import SpeculativeDecoder, load_model
from verispec.cli import main
from verispec.drafters.suffix import SuffixDrafter, SuffixStore

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Extract the name, the date and the amount as JSON from: On March 24, 2024, Peter Costa paid $2535.36 for dues.",
    "Extract the name, the date and the amount as JSON from: Invoice from Lars Sharma, dated October 2, 2023: $60.91.",
]


@pytest.mark.parametrize("backend", ["transformers", "llamacpp"])
def test_suffix_drafts_are_identical_to_plain_and_learn_from_earlier_answers(backend, default_model):
    if backend == "llamacpp":
        require_llama_cpp()
        target = load_model("smollm2-135m", backend="llamacpp", weights="f32")
    else:
        target = default_model
    plain = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, SuffixDrafter(store=SuffixStore()), k=8, k_policy="fixed")
    runs = []
    for prompt in [PROMPTS[0], PROMPTS[1], PROMPTS[0]]:
        got = spec.generate(prompt, max_new_tokens=40)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=40).token_ids, prompt
        runs.append(got)
    # the third request repeats the first: its answer is drafted from the first's
    assert runs[2].stats.accepted >= 0.6 * len(runs[2].token_ids) > runs[0].stats.accepted


def test_bench_on_the_repetition_workload(tmp_path, capsys):
    from verispec.bench.prompts import PACKAGED

    workload = PACKAGED.parent.parent / "repetition" / "extract.jsonl"
    assert main(["bench", "--prompts", str(workload), "--limit", "2", "--max-new-tokens", "48", "--methods",
                 "baseline,suffix", "--out", str(tmp_path), "--no-plots", "--no-quality"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    overall = result["overall"]
    assert overall["suffix"]["identical"] == 1.0 and overall["suffix"]["drafted"] > 0


def test_samples_of_one_prompt_draft_from_each_other(default_model):
    """n = 3 on the real model: greedy samples all equal plain decoding; sampled ones (temperature 0.7) draft from
    the siblings' text (scope request: only theirs), each with its own seed."""
    from verispec.batching import generate_samples

    prompt = PROMPTS[0]
    plain = SpeculativeDecoder(default_model).generate(prompt, max_new_tokens=40).token_ids
    decoders = [SpeculativeDecoder(default_model, SuffixDrafter(scope="request"), k=8, k_policy="fixed")
                for _ in range(3)]
    greedy = generate_samples(decoders, prompt, max_new_tokens=40, temperature=0.0)
    assert [g.token_ids for g in greedy] == [plain] * 3
    sampled = generate_samples(decoders, prompt, max_new_tokens=40, temperature=0.7, seed=5)
    assert [g.seed for g in sampled] == [5, 6, 7]
    assert sum(g.stats.accepted for g in sampled[1:]) > 0
    assert all(g.stats.reused_prompt_tokens > 0 for g in sampled[1:])  # the prompt was prefilled once
