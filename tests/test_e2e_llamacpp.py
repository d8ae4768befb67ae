"""The llamacpp backend on the real built-in GGUF file: tokenization equal to the transformers backend's, plain
decoding equal to llama-cpp-python's own greedy generation, speculation (n-gram, draft model, EAGLE head) identical
to plain decoding on F32 weights, hidden states equal to transformers', rollback, the audit, the CLI, bench peers and the server through the openai client. Marked e2e; run in CI (which
installs the llamacpp extra and sets VERISPEC_REQUIRE_LLAMACPP=1, so a missing llama-cpp-python fails there)."""

import json
import os

import pytest
import torch

from conftest import require_llama_cpp
from verispec import SpeculativeDecoder, load_model, make_drafter
from verispec.audit import run_audit
from verispec.cli import main
from verispec.errors import InvalidRequest, ModelNotFound

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Repeat this list exactly, one item per line: alpha beta gamma delta epsilon zeta eta theta iota kappa",
    "Summarize in one sentence: The committee met on Tuesday to review the budget. The committee approved the "
    "budget for roads and schools, and the committee postponed the vote on the new library until next month.",
    "Write a short poem about the sea.",
]


def plain_llama_cpp_python(model, prompt_ids, n):
    """Greedy tokens from llama-cpp-python's own high-level generate on the same file (what users run)."""
    from verispec.backends.llamacpp import default_threads

    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(model.path), n_ctx=2048, n_threads=default_threads(), verbose=False)
    out = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if token in model.eos_token_ids or len(out) >= n:
            break
    return out


def test_tokenizer_and_chat_template_match_the_transformers_backend(llama_q41, default_model):
    texts = ["Hello, world!", "  leading spaces and\ttabs\nnew lines", "naïve café — 東京 🙂", "x = [1, 2, 3]  # code"]
    decoder = SpeculativeDecoder(llama_q41)
    reference = SpeculativeDecoder(default_model)
    for text in texts:
        assert decoder.encode(text) == reference.encode(text)  # chat template applied, same ids
        assert decoder.encode(text, raw=True) == reference.encode(text, raw=True)
        # llama.cpp's own tokenizer reads the same GGUF vocabulary: it agrees with transformers' reading of it
        assert llama_q41.llama_tokenize(text, add_special=False) == default_model.tokenizer(
            text, add_special_tokens=False)["input_ids"]
    assert llama_q41.vocab_size == default_model.vocab_size
    assert llama_q41.eos_token_ids >= default_model.eos_token_ids


def test_plain_decoding_equals_llama_cpp_pythons_greedy_generate(llama_q41):
    """Same file, same kernels, same one-token steps: verispec's plain loop on llama.cpp is token-identical."""
    decoder = SpeculativeDecoder(llama_q41)
    for prompt in PROMPTS:
        ids = decoder.encode(prompt)
        ours = decoder.generate(ids, max_new_tokens=40).token_ids
        assert ours == plain_llama_cpp_python(llama_q41, ids, 40), prompt


@pytest.mark.parametrize("drafter", ["ngram", "model", "eagle", "eagle:fused", "medusa"])
def test_speculation_on_f32_weights_is_identical_to_plain_decoding(llama_f32, drafter):
    plain = SpeculativeDecoder(llama_f32)
    drafter, _, head = drafter.partition(":")  # eagle: the final-state head (this backend's default); fused: 4 layers
    draft = make_drafter(drafter, target=llama_f32, draft_model=llama_f32 if drafter == "model" else None,
                         **({"head": head} if head else {}))
    spec = SpeculativeDecoder(llama_f32, draft, k=6, k_policy="fixed")
    drafted = 0
    for prompt in PROMPTS:
        a = plain.generate(prompt, max_new_tokens=48)
        b = spec.generate(prompt, max_new_tokens=48)
        assert b.token_ids == a.token_ids, prompt
        drafted += b.stats.drafted
        if drafter == "model":  # the same model drafts for itself: every draft token is accepted
            assert b.stats.accepted == b.stats.drafted
    assert drafted > 0


def test_heads_read_a_long_prompts_last_rows_and_speculation_stays_plain_decoding(llama_f32):
    """On llama.cpp a row's hidden state costs its logits, so the EAGLE head reads only a prompt's last
    ``PROMPT_ROWS_LLAMACPP`` rows and Medusa its last one: the rest is prefilled asking for none (a forward of its
    own), and greedy output stays plain decoding's on F32 weights."""
    from verispec.bench.prompts import load_questions
    from verispec.drafters.eagle import PROMPT_ROWS_LLAMACPP

    long = next(q.turns[0] for q in load_questions() if q.group == "summarization")
    plain = SpeculativeDecoder(llama_f32)
    expected = plain.generate(long, max_new_tokens=32)
    assert len(expected.prompt_token_ids) > PROMPT_ROWS_LLAMACPP + 50
    calls = []
    forward = llama_f32.forward

    def recording(kv, tokens, **kwargs):
        calls.append((len(tokens), bool(kwargs.get("feature_layers"))))
        return forward(kv, tokens, **kwargs)

    for name, rows in (("eagle", PROMPT_ROWS_LLAMACPP), ("medusa", 1)):
        drafter = make_drafter(name, target=llama_f32)
        assert drafter.prompt_feature_rows == rows
        calls.clear()
        llama_f32.forward = recording
        try:
            out = SpeculativeDecoder(llama_f32, drafter, k=4, k_policy="fixed").generate(long, max_new_tokens=32)
        finally:
            del llama_f32.forward
        blind = len(expected.prompt_token_ids) - 1 - rows
        assert calls[:2] == [(blind, False), (rows, True)], name
        assert out.token_ids == expected.token_ids and out.stats.drafted > 0, name


@pytest.fixture(scope="module")
def llama_f32_callback():
    """F32 weights with hidden states read by the eval callback, as on a llama.cpp build without layer inputs."""
    os.environ["VERISPEC_LLAMACPP_LAYER_INPUTS"] = "0"
    try:
        model = load_model("smollm2-135m", backend="llamacpp", weights="f32", features=True)
    finally:
        del os.environ["VERISPEC_LLAMACPP_LAYER_INPUTS"]
    assert model._tap is not None and model._inputs is None
    return model


@pytest.mark.parametrize("reader", ["layer inputs", "callback"])
def test_hidden_states_equal_the_transformers_backends(reader, llama_f32, llama_f32_callback, default_model):
    """llama.cpp's layer inputs (input of layer i, i < n_layer) and its embeddings output (the final norm), or the
    eval callback's embd, l_out-{i-1} and result_norm: transformers' hidden_states[0], [i], [n_layer]."""
    model = llama_f32 if reader == "layer inputs" else llama_f32_callback
    assert (model._inputs is not None) == (reader == "layer inputs") and model.supports_features
    ids = default_model.tokenizer("The quick brown fox jumps over the lazy dog, then naps in the sun.")["input_ids"]
    layers = (0, 2, 15, 28, 30)
    ref = default_model.forward(default_model.new_kv(), ids, feature_layers=layers)
    kv = model.new_kv()
    head = model.forward(kv, ids[:5], last_only=True, feature_layers=layers)  # a prefill keeps every row
    tail = model.forward(kv, ids[5:], feature_layers=layers)
    hidden = torch.cat([head.hidden, tail.hidden])
    assert hidden.shape == ref.hidden.shape and head.logits.shape[0] == 1
    scale = ref.hidden.abs().amax(dim=(0, 2), keepdim=True)
    assert float(((hidden - ref.hidden).abs() / scale).max()) < 1e-5
    torch.testing.assert_close(tail.logits, ref.logits[5:], atol=1e-3, rtol=0)
    # inner layers alone: every row without asking for logits (a prefill in chunks, the first with no output row),
    # the same rows in a batch of two sequences
    long = (ids * 60)[:600]
    inner = (15, 2)
    full = default_model.forward(default_model.new_kv(), long, feature_layers=inner).hidden
    out = model.forward(model.new_kv(), long, last_only=True, feature_layers=inner)
    assert out.logits.shape[0] == 1 and out.hidden.shape == full.shape
    assert float(((out.hidden - full).abs() / full.abs().amax(dim=(0, 2), keepdim=True)).max()) < 1e-5
    batch = model.forward_batch([(model.new_kv(), long[:7]), (model.new_kv(), long[:3])], feature_layers=inner)
    torch.testing.assert_close(batch[0].hidden, out.hidden[:7], atol=1e-3, rtol=0)
    assert batch[1].hidden.shape == (3, 2, 576) and model.forward(model.new_kv(), long[:4]).hidden is None


def test_a_four_layer_head_drafts_on_llama_cpp_without_the_callback(llama_f32):
    """The shipped four-layer head reads layers 2, 15 and 28 as llama.cpp's layer inputs: no eval callback on any
    pass, and on F32 weights greedy output is plain decoding's token for token."""
    assert llama_f32._tap is None and llama_f32._inputs is not None
    drafter = make_drafter("eagle", target=llama_f32, head="fused")
    assert drafter.feature_layers == (2, 15, 28, 30)
    expected = SpeculativeDecoder(llama_f32).generate(PROMPTS[0], max_new_tokens=32).token_ids
    out = SpeculativeDecoder(llama_f32, drafter, k=3, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=32)
    assert out.stats.drafted > 0 and out.stats.accepted > 0 and out.token_ids == expected
    assert {2, 15, 28} <= llama_f32._inputs.kept  # kept on: switching them per pass rebuilds llama.cpp's graph


def test_rollback_leaves_the_cache_of_a_fresh_prefill(llama_f32):
    """After speculative steps with rejections the next-token logits equal those after a fresh prefill."""
    decoder = SpeculativeDecoder(llama_f32, make_drafter("ngram"), k=8, k_policy="fixed")
    g = decoder.generate(PROMPTS[1], max_new_tokens=40)
    assert g.stats.drafted > g.stats.accepted  # rejections, so rollbacks
    cached = decoder._cached_tokens
    committed = g.prompt_token_ids + g.token_ids
    # the committed tokens (past an end token the last step may have accepted more, which stay cached)
    assert cached[: len(committed) - 1] == committed[:-1] and len(decoder._cache) == len(cached)
    mine = llama_f32.forward(decoder._cache, [504]).logits[-1]
    fresh = llama_f32.new_kv()
    ref = llama_f32.forward(fresh, [*cached, 504], last_only=True).logits[-1]
    torch.testing.assert_close(mine, ref, atol=2e-3, rtol=0)


def test_kv_sequences_are_released_and_reused(llama_q41):
    for _ in range(3 * 8):  # more than the context's 8 sequences: dropped caches give theirs back
        kv = llama_q41.new_kv()
        llama_q41.forward(kv, [1, 2, 3])
        del kv
    held = [llama_q41.new_kv() for _ in range(8)]
    with pytest.raises(InvalidRequest, match="sequences are in use"):
        llama_q41.new_kv()
    del held


def test_audit_passes_on_the_llamacpp_backend(llama_q41):
    decoder = SpeculativeDecoder(llama_q41, make_drafter("ngram"), k=4, k_policy="fixed")
    prompt = decoder.encode("one two three four five one two three four five one two", raw=True)
    report = run_audit(decoder, prompt, temperature=1.0, samples=200, positions=3, seed=0)
    assert report.drafted > 0
    assert report.passed, report.to_dict()


def test_what_the_backend_cannot_do_is_a_clear_error(llama_q41, tiny_dir):
    with pytest.raises(InvalidRequest, match="transformers"):
        SpeculativeDecoder(llama_q41, make_drafter("ngram", branches=3))
    with pytest.raises(InvalidRequest, match="outside 0..30"):
        llama_q41.forward(llama_q41.new_kv(), [1, 2], feature_layers=(31,))
    assert make_drafter("eagle", target=llama_q41).feature_layers == (30,)  # llama.cpp's default: the final state
    os.environ["VERISPEC_LLAMACPP_LAYER_INPUTS"] = "0"  # as a build without layer inputs, and no callback
    try:
        bare = load_model("smollm2-135m", backend="llamacpp")
    finally:
        del os.environ["VERISPEC_LLAMACPP_LAYER_INPUTS"]
    assert not bare.supports_features
    with pytest.raises(InvalidRequest, match="features=True"):
        bare.forward(bare.new_kv(), [1, 2], feature_layers=(1,))
    with pytest.raises(InvalidRequest, match="features=True"):
        make_drafter("eagle", target=bare, head="fused")  # four layers: the callback's here
    with pytest.raises(ModelNotFound, match="GGUF"):
        load_model(str(tiny_dir), backend="llamacpp")
    with pytest.raises(InvalidRequest, match="--weights"):
        load_model(str(tiny_dir), weights="f16")
    with pytest.raises(InvalidRequest, match="dtype"):
        load_model("smollm2-135m", backend="llamacpp", dtype="bfloat16")
    with pytest.raises(InvalidRequest, match="unknown backend"):
        load_model("smollm2-135m", backend="vllm")


def test_the_final_state_comes_without_the_callback(llama_f32, llama_q41, monkeypatch):
    """A model loaded without features=True still returns hidden_states[n_layer] (llama.cpp's embeddings output,
    switched on for the passes that ask): equal to what the eval callback reads, so heads on the final state alone
    (Medusa, `train-eagle --layers 30`) run with no Python per graph node."""
    n = llama_q41.final_feature_layer
    assert n == 30 and llama_q41._tap is None
    plain_f32 = load_model("smollm2-135m", backend="llamacpp", weights="f32")
    tokens = list(range(300, 340))
    mine = plain_f32.forward(plain_f32.new_kv(), tokens, last_only=True, feature_layers=(n,))
    tapped = llama_f32.forward(llama_f32.new_kv(), tokens, last_only=True, feature_layers=(n - 1, n))
    assert mine.hidden.shape == (len(tokens), 1, 576) and mine.logits.shape == (1, llama_q41.vocab_size)
    assert torch.equal(mine.hidden[:, 0], tapped.hidden[:, 1]) and torch.equal(mine.logits, tapped.logits)
    kv = plain_f32.new_kv()
    plain_f32.forward(kv, tokens)
    assert plain_f32.forward(kv, [5]).hidden is None  # switched off again for a pass that asks for none
    batch = plain_f32.forward_batch([(plain_f32.new_kv(), tokens[:7]), (plain_f32.new_kv(), tokens[:3])],
                                    feature_layers=(n,))
    assert torch.equal(batch[0].hidden[:, 0], mine.hidden[:7, 0]) and batch[1].hidden.shape == (3, 1, 576)
    # switched only where a pass wants otherwise than the one before (a switch rebuilds llama.cpp's graph)
    plain_f32.forward(kv, [5])  # off (the batch above left it on)
    switches = []
    real = plain_f32._llama.llama_set_embeddings
    monkeypatch.setattr(plain_f32._llama, "llama_set_embeddings", lambda ctx, on: switches.append(on) or real(ctx, on))
    for token, layers in ((6, (n,)), (7, (n,)), (8, (n,)), (9, ()), (10, ()), (11, (n,))):
        out = plain_f32.forward(kv, [token], feature_layers=layers)
        assert (out.hidden is None) == (not layers)
    assert switches == [True, False, True]
    monkeypatch.undo()
    # Medusa reads the final state only: it drafts without the callback (F32 weights: passes of any width round
    # alike, so greedy output is plain decoding's token for token), and builds on the as-is file too
    drafter = make_drafter("medusa", target=plain_f32)
    expected = SpeculativeDecoder(plain_f32).generate(PROMPTS[0], max_new_tokens=32).token_ids
    out = SpeculativeDecoder(plain_f32, drafter, k=3, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=32)
    assert out.stats.drafted > 0 and out.stats.accepted > 0 and out.token_ids == expected
    assert make_drafter("medusa", target=llama_q41).feature_layers == (n,)


def test_generate_cli_on_llamacpp(capsys, llama_q41):
    assert main(["generate", PROMPTS[0], "--backend", "llamacpp", "--max-new-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 24 or out["finish_reason"] == "stop"
    plain = SpeculativeDecoder(llama_q41).generate(PROMPTS[0], max_new_tokens=24)
    assert out["stats"]["drafter"] == "ngram" and out["stats"]["prompt_tokens"] == len(plain.prompt_token_ids)


def test_bench_with_llama_cpp_peers(tmp_path, capsys, llama_f32):
    code = main(["bench", "--categories", "summarization", "--limit", "1", "--max-new-tokens", "32",
                 "--methods", "baseline:backend=llamacpp:weights=f32,ngram:backend=llamacpp:weights=f32:policy=fixed,"
                 "llamacpp,llamacpp:lookup", "--out", str(tmp_path), "--no-plots", "--no-quality"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    overall = result["overall"]
    assert overall["ngram:backend=llamacpp:weights=f32:policy=fixed"]["identical"] == 1.0
    assert overall["ngram:backend=llamacpp:weights=f32:policy=fixed"]["drafted"] > 0
    assert overall["llamacpp"]["new_tokens"] > 0 and overall["llamacpp:lookup"]["new_tokens"] > 0
    kernels = result["environment"]["method_kernels"]
    assert "f32 weights" in kernels["baseline:backend=llamacpp:weights=f32"]
    assert "Q4_1" in kernels["llamacpp"]


def test_analyze_and_audit_cli_on_llamacpp(tmp_path, capsys, llama_q41):
    assert main(["analyze", "--backend", "llamacpp", "--limit", "1", "--categories", "summarization",
                 "--max-new-tokens", "24", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["environment"]["backend"] == "llamacpp" and "llama.cpp" in result["environment"]["linear_kernel"]
    costs = {int(j): ms for j, ms in result["verify_cost_ms"].items()}
    assert costs[0] > 0 and costs[16] > costs[0]  # a 17-token llama.cpp pass costs more than a one-token one
    assert 1 <= result["optimal_k"] <= 16
    assert main(["audit", "--backend", "llamacpp", "--samples", "60", "--positions", "2", "--k-policy", "fixed",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["drafted"] > 0


def test_bf16_weights_stay_within_bf16_rounding_of_the_shipped_values(llama_f32):
    """--weights bf16 (cheaper wide passes where the CPU has bf16 dot products; any CPU runs it): the converted
    file is llama.cpp's BF16 type, and its logits follow the F32 file's (exactly the Q4_1 values) to bf16 rounding."""
    llama_cpp = require_llama_cpp()
    bf16 = load_model("smollm2-135m", backend="llamacpp", weights="bf16")
    assert llama_cpp.llama_model_ftype(bf16._model) == llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
    assert "bf16 weights" in bf16.kernel and bf16.path.name.endswith(".bf16.gguf")
    ids = bf16.tokenizer(PROMPTS[1])["input_ids"]
    narrow = bf16.forward(bf16.new_kv(), ids, last_only=True).logits[-1]
    reference = llama_f32.forward(llama_f32.new_kv(), ids, last_only=True).logits[-1]
    assert int(narrow.argmax()) == int(reference.argmax())
    assert float((narrow - reference).abs().max()) < 0.05 * float(reference.abs().max())  # measured ~0.01
    # a verify pass over several tokens and one-token steps agree on the argmax on this prompt
    kv = bf16.new_kv()
    bf16.forward(kv, ids[:-4], last_only=True)
    wide = bf16.forward(kv, ids[-4:]).logits
    kv.truncate(len(ids) - 4)
    steps = torch.stack([bf16.forward(kv, [t]).logits[-1] for t in ids[-4:]])
    assert torch.equal(wide.argmax(-1), steps.argmax(-1))


def test_a_llama_cpp_server_started_with_eagle_runs_the_final_state_head_without_the_callback(llama_q41):
    from verispec.server.config import ServeOptions, build_server_config

    config = build_server_config(ServeOptions(target="smollm2-135m", backend="llamacpp", drafter="eagle", max_batch=1))
    assert config.target._tap is None  # no eval callback installed
    assert "eagle" in config.drafters and "medusa" not in config.drafters  # heads only when asked
    assert config.drafters["eagle"]().feature_layers == (30,)
    fused = build_server_config(ServeOptions(target="smollm2-135m", backend="llamacpp", drafter="eagle",
                                             drafter_options={"eagle_head": "fused"}, max_batch=1))
    assert fused.target.supports_features and fused.drafters["eagle"]().feature_layers == (2, 15, 28, 30)
    assert fused.target._tap is None  # its inner layers come as llama.cpp's layer inputs
