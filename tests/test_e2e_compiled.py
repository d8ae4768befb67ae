"""End-to-end on the real default model: the compiled one-token step (``--compile``) gives the same greedy tokens as
the eager path, plain and speculative, and as transformers' own generate; a second process loads it from the
compile cache instead of compiling. Marked e2e; run in CI (compiling takes about a minute on 2 cores, once for this
module, when the cache does not hold it yet)."""

import subprocess
import sys

import pytest
import torch
from test_e2e_kernels import PROMPTS

from verispec import NgramDrafter, SpeculativeDecoder, load_model
from verispec.backends.hf.compiled import FixedKV

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def compiled_model():
    # the one-token step only: the verify program (a second compile as long as the step's, the slowest setup of the
    # cold suite) is compiled and checked pass for pass on tiny models in test_compiled.py
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VERISPEC_COMPILED_VERIFY", "0")
        model = load_model("smollm2-135m", compiled=True)
    assert model.verify is None
    return model


def test_compiled_greedy_equals_eager_speculative_and_transformers_generate(compiled_model, default_model):
    assert compiled_model.step is not None, "compiling failed on this machine (see the warning above)"
    assert isinstance(compiled_model.new_kv(), FixedKV) and "compiled (AOTInductor)" in compiled_model.kernel
    plain = load_model("smollm2-135m", dtype="float32", pack=False)
    fast, eager = SpeculativeDecoder(compiled_model), SpeculativeDecoder(default_model)
    ngram = SpeculativeDecoder(compiled_model, NgramDrafter(), k=8)
    for prompt in PROMPTS:
        ours = fast.generate(prompt, max_new_tokens=64)
        assert ours.token_ids == eager.generate(prompt, max_new_tokens=64).token_ids, prompt
        assert ours.token_ids == ngram.generate(prompt, max_new_tokens=64).token_ids, prompt
        ids = torch.tensor([ours.prompt_token_ids])
        with torch.inference_mode():
            theirs = plain.model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
        assert ours.token_ids == theirs, prompt


def test_compiled_step_logits_follow_a_fresh_forward(compiled_model, default_model):
    ids = default_model.tokenizer("The committee approved the new budget on Monday, and the mayor")["input_ids"]
    kv = compiled_model.new_kv()
    with torch.inference_mode():
        compiled_model.forward(kv, ids[:-1], last_only=True)  # eager prefill into the fixed cache
        step = compiled_model.forward(kv, ids[-1:]).logits[-1]  # the compiled one-token step
        fresh = default_model.model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert (step - fresh).abs().max().item() < 1e-3
    assert step.argmax() == fresh.argmax()


def test_a_second_process_loads_the_stored_step(compiled_model):
    # --compile auto (the command line's default outside the tests) uses what the fixture's compile stored
    result = subprocess.run([sys.executable, "-m", "verispec", "-v", "generate", "What is 2 + 2?", "--compile",
                             "auto", "--drafter", "none", "--max-new-tokens", "8"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "one-token steps compiled (loaded in" in result.stderr  # from the cache: the fixture stored it


def test_the_shipped_eagle_head_drafts_compiled_with_plain_greedy_output(compiled_model):
    """The shipped head's draft step compiled (``verispec.eagle.compiled``, what ``verispec compile`` stores) on the
    compiled target: plain decoding's tokens, and drafts accepted (a program that attended wrongly would draft
    noise)."""
    from verispec import EagleDrafter

    drafter = EagleDrafter(compiled_model, engine="compiled")
    assert drafter.engine == "compiled"
    plain = SpeculativeDecoder(compiled_model)
    eagle = SpeculativeDecoder(compiled_model, drafter, k=3, k_policy="fixed")
    accepted = drafted = 0
    for prompt in PROMPTS:
        out = eagle.generate(prompt, max_new_tokens=64)
        assert out.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids, prompt
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert drafted and accepted / drafted > 0.3, (accepted, drafted)
