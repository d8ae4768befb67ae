"""The blocks backend on the real built-in model's own Q4_1 file: greedy speculation identical to plain decoding
with the n-gram and suffix drafters, the file's values reproduced (top-1 agreement with
the float32 model of the same file, teacher-forced), and `verispec costs` printing its curve. Marked e2e; run in CI."""

import json

import pytest

from verispec import SpeculativeDecoder, blockmm, load_model
from verispec.cli import main
from verispec.drafters import NgramDrafter
from verispec.drafters.suffix import SuffixDrafter, SuffixStore

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not blockmm.available(), reason=str(blockmm.why_unavailable()))]

PROMPTS = [
    "Rewrite in the passive voice: The committee approved the new budget on Monday and the mayor signed it on Friday.",
    "Extract the name, the date and the amount as JSON from: On March 24, 2024, Peter Costa paid $2535.36 for dues.",
]


@pytest.fixture(scope="module")
def target():
    return load_model("smollm2-135m", backend="blocks")


def test_every_matrix_on_the_files_blocks(target):
    assert target.backend == "blocks" and target.width_invariant
    assert target.swapped.left == [] and target.swapped.kinds == {"Q4_1": 210, "Q8_0": 1}


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_greedy_speculation_equals_plain(target, drafter):
    plain = SpeculativeDecoder(target)
    make = {"ngram": NgramDrafter, "suffix": lambda: SuffixDrafter(store=SuffixStore())}[drafter]
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=48).token_ids
        got = SpeculativeDecoder(target, make(), k=8, k_policy="fixed").generate(prompt, max_new_tokens=48)
        assert got.token_ids == want, prompt
        assert got.stats.drafted > 0


def test_the_files_values_teacher_forced(target, default_model):
    """Activations quantized per 32 values (as llama.cpp does) keep the argmax of the file's float32 model."""
    import torch

    ids = default_model.tokenizer(PROMPTS[0] + " " + PROMPTS[1])["input_ids"]
    want = default_model.forward(default_model.new_kv(), ids).logits
    got = target.forward(target.new_kv(), ids).logits
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    assert torch.allclose(got, want, atol=0.1 * want.abs().max().item())


def test_costs_command(capsys):
    assert main(["costs", "--backends", "blocks", "--widths", "1,4", "--repeats", "1", "--context", "64",
                 "--arithmetic-floor"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["floor_ms"] > 0 and set(summary["engines"]) == {"blocks"}
    ms = summary["engines"]["blocks"]["ms"]
    assert set(ms) == {"1", "4"} and all(v > 0 for v in ms.values())
    assert "| blocks |" in out
    # the products with their weights in cache, in all and by the file's block types
    cached = summary["engines"]["blocks"]["products_in_cache_ms"]
    assert set(cached) == {"1", "4"} and all(parts["all"] > 0 and len(parts) > 1 for parts in cached.values())
    assert "| blocks: products, weights in cache |" in out and "| ... of which " in out
