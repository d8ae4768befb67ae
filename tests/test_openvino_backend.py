"""The OpenVINO backend on the tiny random model: logits equal to transformers' at any pass width, rollback by masking
(and compaction) equal to a fresh cache, prefix copies, speculative greedy output equal to plain, the exact
distribution test's premise (per-position probabilities equal to the transformers target's), token trees and hidden
states equal to the transformers backend's, tree and EAGLE drafters equal to plain decoding."""

import json

import pytest
import torch

from conftest import require_openvino

require_openvino()

from verispec import EagleDrafter, SpeculativeDecoder, load_model, make_drafter  # noqa: E402
from verispec.eagle.head import EagleHead, head_config_for  # noqa: E402
from verispec.backends.openvino.model import OpenVINOKV  # noqa: E402
from verispec.backends.openvino.paged import PagedKV  # noqa: E402
from verispec.errors import InvalidRequest  # noqa: E402


@pytest.fixture(scope="module")
def ov_target(tiny_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("ov-cache")))
        target = load_model(str(tiny_dir), backend="openvino", threads=1)
    target.eos_token_ids = frozenset()  # random weights: answers run to the limit
    return target


def _ids(n, seed=0):
    return torch.randint(3, 32, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("trees", [False, True], ids=["paged", "stateful"])
def test_logits_match_transformers_at_every_width_and_after_rollback(ov_target, tiny_target, trees):
    seq = _ids(40)
    with torch.no_grad():
        want = tiny_target.model(torch.tensor([seq])).logits[0]
    kv = ov_target.new_kv(trees=trees)
    assert isinstance(kv, OpenVINOKV if trees else PagedKV)
    done = 0
    for width in (6, 1, 3, 9):
        got = ov_target.forward(kv, seq[done:done + width]).logits
        torch.testing.assert_close(got, want[done:done + width], atol=1e-4, rtol=1e-4)
        done += width
        # a rejected draft: three wrong tokens fed, then rolled back
        ov_target.forward(kv, [5, 6, 7])
        kv.truncate(done)
        assert len(kv) == done
    # stateful: enough dead positions to compact the state; paged: a block's worth of positions written over again
    # and again; the next pass must not notice either
    for _ in range(30):
        ov_target.forward(kv, [8, 9, 10, 11] * (9 if trees else 1))
        kv.truncate(done)
    got = ov_target.forward(kv, seq[done:done + 5]).logits
    torch.testing.assert_close(got, want[done:done + 5], atol=1e-4, rtol=1e-4)
    if trees:
        assert kv.physical < done + 5 + 36 * 30  # compaction ran
    else:
        assert len(kv.blocks) == -(-len(kv) // kv.pool.size)  # rolled-back blocks went back to the pool
    last = ov_target.forward(kv, seq[done + 5:done + 7], last_only=True).logits
    torch.testing.assert_close(last, want[done + 6:done + 7], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        kv.truncate(len(kv) + 1)


def test_prefix_copy_gives_the_same_continuation(ov_target):
    seq = _ids(20, seed=1)
    group = ov_target.new_kv_group(2)
    a, b = group.new_kv(), group.new_kv()
    ov_target.forward(a, seq[:12])
    ov_target.forward(a, [3, 4])
    a.truncate(12)
    group.copy_prefix(a, b, 10)
    assert len(b) == 10
    torch.testing.assert_close(ov_target.forward(b, seq[10:14]).logits, _fresh(ov_target, seq[:14])[10:14],
                               atol=1e-5, rtol=1e-5)


def test_batched_paged_pass_equals_single_passes_and_survives_pool_growth(ov_target, tiny_target):
    seqs = [_ids(30, seed=s) for s in range(3)]
    kvs = [ov_target.new_kv() for _ in seqs]
    for kv, seq, cut in zip(kvs, seqs, (5, 17, 1)):
        ov_target.forward(kv, seq[:cut])
        ov_target.forward(kv, [3, 3, 3])  # a rejected draft in each
        kv.truncate(cut)
    pool = kvs[0].pool
    hoard = pool.take(pool.blocks + 3)  # every free block and more: the pool doubles, copying what it holds
    ragged = [(kv, seq[len(kv):len(kv) + w]) for kv, seq, w in zip(kvs, seqs, (4, 1, 9))]
    got = ov_target.forward_batch(ragged, feature_layers=(1,))
    pool.give(hoard)
    for (kv, tokens), out, seq in zip(ragged, got, seqs):
        with torch.no_grad():
            want = tiny_target.model(torch.tensor([seq[:len(kv)]]), output_hidden_states=True)
        n = len(tokens)
        torch.testing.assert_close(out.logits, want.logits[0, -n:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden[:, 0], want.hidden_states[1][0, -n:], atol=1e-4, rtol=1e-4)
    assert pool.blocks >= 64 + 3 and all(len(kv) == c for kv, c in zip(kvs, (9, 18, 10)))


def _fresh(target, tokens):
    return target.forward(target.new_kv(), tokens).logits


def test_speculative_greedy_equals_plain_on_both_drafters(ov_target, tiny_dir):
    draft = load_model(str(tiny_dir))
    prompt = [1, 5, 9, 5, 9, 5, 9, 12, 5, 9]
    plain = SpeculativeDecoder(ov_target).generate(prompt, max_new_tokens=40)
    for drafter in (make_drafter("ngram", target=ov_target), make_drafter("model", target=ov_target,
                                                                          draft_model=draft)):
        # fixed k: the controller, timing passes, may step aside on a loaded machine and leave nothing verified
        out = SpeculativeDecoder(ov_target, drafter, k=4, k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert out.token_ids == plain.token_ids
        assert sum(out.stats.step_accepted) > 0  # drafts were accepted, and rejected ones rolled back
    batch = ov_target.forward_batch([(ov_target.new_kv(), prompt), (ov_target.new_kv(), prompt[:4])])
    torch.testing.assert_close(batch[1].logits, _fresh(ov_target, prompt[:4]), atol=1e-5, rtol=1e-5)


def test_tree_pass_and_hidden_states_equal_the_transformers_backends(ov_target, tiny_dir):
    hf = load_model(str(tiny_dir))
    seq = _ids(15, seed=2)
    parents = [-1, 0, 0, -1, 3, 1]  # two roots, a node with two children, a chain under the second root
    tree = [7, 8, 9, 10, 11, 12]
    ov_kv, hf_kv = ov_target.new_kv(trees=True), hf.new_kv()
    paged = ov_target.new_kv()
    ov_target.forward(paged, seq[:10])
    with pytest.raises(ValueError, match="trees=True"):  # paged attention is causal only
        ov_target.forward(paged, seq[10:12] + tree, parents=parents)
    for target, kv in ((ov_target, ov_kv), (hf, hf_kv)):
        target.forward(kv, seq[:10])
        target.forward(kv, [4, 4, 4])  # a rejected draft first: the tree must not see it
        kv.truncate(10)
    got = ov_target.forward(ov_kv, seq[10:12] + tree, parents=parents, feature_layers=(0, 2, 1))
    want = hf.forward(hf_kv, seq[10:12] + tree, parents=parents, feature_layers=(0, 2, 1))
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert got.hidden.shape == want.hidden.shape == (8, 3, hf.model.config.hidden_size)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
    # the engine keeps a tree's accepted path (here the second root's chain, nodes 3 and 4) and drops the rest
    for kv in (ov_kv, hf_kv):
        kv.keep(12, [12 + 3, 12 + 4])
    assert len(ov_kv) == len(hf_kv) == 14
    torch.testing.assert_close(ov_target.forward(ov_kv, [8, 12]).logits, hf.forward(hf_kv, [8, 12]).logits,
                               atol=1e-4, rtol=1e-4)
    fresh = hf.forward(hf.new_kv(), seq[:12] + [10, 11, 8, 12]).logits[-2:]
    torch.testing.assert_close(ov_target.forward(ov_target.new_kv(), seq[:12] + [10, 11, 8, 12]).logits[-2:], fresh,
                               atol=1e-4, rtol=1e-4)
    ov_kv.truncate(14)
    torch.testing.assert_close(ov_target.forward(ov_kv, [8, 12]).logits, fresh, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot keep"):
        ov_kv.keep(12, [11])
    assert ov_target.forward(ov_target.new_kv(), seq[:3], last_only=True, feature_layers=(1,)).hidden is not None


def test_tree_and_eagle_drafters_equal_plain_decoding(ov_target):
    prompt = [1, 5, 9, 5, 9, 5, 9, 12, 5, 9]
    plain = SpeculativeDecoder(ov_target).generate(prompt, max_new_tokens=40)
    torch.manual_seed(0)
    embedding = ov_target.embedding_model
    head = EagleHead(head_config_for(embedding, ov_target.name, [1, 2], ov_target.vocab_size)).attach(embedding).eval()
    for drafter in (make_drafter("ngram", target=ov_target, branches=3),
                    EagleDrafter(ov_target, head), EagleDrafter(ov_target, head, tree=True, depth=3, width=2)):
        out = SpeculativeDecoder(ov_target, drafter, k=4).generate(prompt, max_new_tokens=40)
        assert out.token_ids == plain.token_ids, drafter.name


def test_a_decoder_has_the_graphs_its_passes_run_compiled_before_its_first_request(ov_target, tiny_dir):
    """The load compiles plain decoding's static graph only; a decoder compiles those its passes of up to k + 1
    tokens run, with the graphs returning its drafter's feature layers (or the stateful graph its token trees run
    on; ~1.3 s each on the real model), when it is built, not in the middle of the first requests that need them."""
    fresh = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths=(2, 4, 6))
    assert set(fresh._paged_requests) == {((), None), ((), 2)}
    SpeculativeDecoder(fresh).generate([1, 5, 9], max_new_tokens=4)
    SpeculativeDecoder(fresh).generate([1, 5, 9, 7, 3, 8], max_new_tokens=4)  # a 5-token prefill: dynamic, no compile
    assert set(fresh._paged_requests) == {((), None), ((), 2)}  # plain decoding: nothing more
    assert fresh.pass_width([5]) == 5  # what the controller prices: the graph that runs it
    SpeculativeDecoder(fresh, make_drafter("ngram", target=fresh), k=3)
    assert set(fresh._paged_requests) == {((), None), ((), 2), ((), 4)}
    assert fresh._masked is None  # token trees' stateful graph: compiled for the first decoder that drafts trees
    SpeculativeDecoder(fresh, make_drafter("ngram", target=fresh, branches=3), k=4)
    assert fresh._masked is not None and set(fresh._paged_requests) == {((), None), ((), 2), ((), 4)}
    torch.manual_seed(1)
    embedding = ov_target.embedding_model
    head = EagleHead(head_config_for(embedding, ov_target.name, [0, 2], ov_target.vocab_size)).attach(embedding).eval()
    layers = tuple(head.config.feature_layers)
    assert not any(key[0] == layers for key in ov_target._paged_requests)
    decoder = SpeculativeDecoder(ov_target, EagleDrafter(ov_target, head), k=3)
    compiled = set(ov_target._paged_requests)
    assert ov_target.static_widths[:3] == (2, 4, 6)  # fp32 pads one-token passes to 2 (min_width)
    assert {(layers, w) for w in (None, 2, 4)} <= compiled and (layers, 6) not in compiled
    decoder.generate([1, 5, 9, 5, 9, 5, 9, 12, 5, 9, 5, 9], max_new_tokens=24)  # a prefill past every static width
    assert set(ov_target._paged_requests) == compiled


def test_the_eagle_heads_openvino_graph_steps_like_the_torch_head(ov_target):
    """On the openvino backend the EAGLE head's chain steps run as an OpenVINO graph (``engine`` auto): in fp32 its
    g, logits (context-vocabulary rows included) and cached keys and values equal the torch head's, step after step;
    the int8 default drafts from rounded weights, still verified losslessly."""
    from verispec.eagle.head import HeadCache
    from verispec.eagle.openvino import HeadSteps

    torch.manual_seed(1)
    embedding = ov_target.embedding_model
    head = EagleHead(head_config_for(embedding, ov_target.name, [1, 2], ov_target.vocab_size)).attach(embedding).eval()
    assert EagleDrafter(ov_target, head).engine == "openvino"
    assert EagleDrafter(ov_target, head, engine="torch").steps is head
    with pytest.raises(InvalidRequest, match="eagle engine"):
        EagleDrafter(ov_target, head, engine="gpu")
    steps = HeadSteps(head, embedding, 1, "fp32")
    extra = embedding.get_output_embeddings().weight.detach()[:3]
    caches = HeadCache(), HeadCache()
    hidden = head.config.hidden_size
    feeds = [(torch.tensor([3, 4, 5, 6]), torch.randn(4, hidden)), (torch.tensor([7]), torch.randn(1, hidden)),
             (torch.tensor([8, 9]), torch.randn(2, hidden))]
    with torch.inference_mode():
        for tokens, features in feeds:
            g_t, logits_t = head.step_logits(tokens, features, caches[0], extra)
            g_o, logits_o = steps.step_logits(tokens, features, caches[1], extra)
            assert logits_o.shape == logits_t.shape == (1, head.config.draft_vocab_size + 3)
            torch.testing.assert_close(g_o, g_t, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits_o, logits_t, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-4, rtol=1e-4)
    assert len(caches[1]) == 7


def test_the_eagle_heads_openvino_graph_is_stored_once_and_read_back_until_the_head_changes(ov_target, tmp_path,
                                                                                            monkeypatch):
    """The converted head graph is stored under the cache, keyed by the head's weights (and format, code and
    versions): a second build reads it back without converting and steps exactly alike; other weights, or a
    broken file, are converted afresh."""
    import openvino as ov

    from verispec.eagle import openvino as head_graphs
    from verispec.eagle.head import HeadCache

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    torch.manual_seed(2)
    embedding = ov_target.embedding_model
    head = EagleHead(head_config_for(embedding, ov_target.name, [1, 2], ov_target.vocab_size)).attach(embedding).eval()
    first = head_graphs.HeadSteps(head, embedding, 1, "fp32")
    stored = head_graphs.graph_dir(head, "fp32")
    assert (stored / head_graphs.GRAPH_XML).exists() and stored.parent == tmp_path / "openvino" / "eagle-heads"
    converted = []
    real_convert = head_graphs._convert
    monkeypatch.setattr(head_graphs, "_convert", lambda *a: converted.append(1) or real_convert(*a))
    second = head_graphs.HeadSteps(head, embedding, 1, "fp32")
    assert converted == []
    tokens, features = torch.tensor([3, 4, 5]), torch.randn(3, head.config.hidden_size)
    with torch.inference_mode():
        outs = [steps.step_logits(tokens, features, HeadCache()) for steps in (first, second)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert head_graphs.graph_dir(head, "int8") != stored
    kept = head.fuse.weight.detach().clone()
    with torch.no_grad():
        head.fuse.weight.add_(0.01)
    assert head_graphs.graph_dir(head, "fp32") != stored
    head_graphs.HeadSteps(head, embedding, 1, "fp32")
    assert converted == [1]
    (stored / head_graphs.GRAPH_XML).write_text("not a graph")
    with torch.no_grad():
        head.fuse.weight.copy_(kept)
    assert head_graphs.graph_dir(head, "fp32") == stored
    head_graphs.HeadSteps(head, embedding, 1, "fp32")
    assert converted == [1, 1] and ov.Core().read_model(str(stored / head_graphs.GRAPH_XML))

    def full_disk(*args, **kwargs):
        raise RuntimeError("No space left on device")

    monkeypatch.setattr(ov, "save_model", full_disk)  # a graph that cannot be stored still drafts
    with torch.no_grad():
        head.fuse.weight.add_(0.02)
    unstored = head_graphs.HeadSteps(head, embedding, 1, "fp32")
    assert converted == [1, 1, 1] and not head_graphs.graph_dir(head, "fp32").exists()
    assert not list(stored.parent.glob(".tmp-*"))
    with torch.inference_mode():
        assert unstored.step_logits(tokens, features, HeadCache())[1].shape == outs[0][1].shape


def test_the_eagle_heads_openvino_graph_drafts_for_a_transformers_target_in_bfloat16(tiny_target):
    """``engine=openvino`` elsewhere too: a bfloat16 head drafting for the transformers target through the graph
    (float32 inside, the head's dtype outside) gives plain decoding's tokens."""
    torch.manual_seed(2)
    embedding = tiny_target.embedding_model
    head = EagleHead(head_config_for(embedding, tiny_target.name, [1, 2], tiny_target.vocab_size)).to(torch.bfloat16)
    head = head.attach(embedding).eval()
    drafter = EagleDrafter(tiny_target, head, engine="openvino")
    assert drafter.engine == "openvino" and drafter.steps is not head
    prompt = [1, 5, 9, 5, 9, 5, 9, 12, 5, 9]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=30)
    out = SpeculativeDecoder(tiny_target, drafter, k=4, k_policy="fixed").generate(prompt, max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.drafted > 0
    assert drafter._cache.k.dtype == torch.bfloat16


def test_refuses_what_it_does_not_take(ov_target):
    with pytest.raises(InvalidRequest, match=r"dtype \(--dtype\) applies to the transformers backend, not openvino"):
        load_model("smollm2-135m", backend="openvino", dtype="bfloat16")
    with pytest.raises(InvalidRequest, match=r"the openvino backend's weights \(--weights\) takes as-is, .*not 'q8_0'"):
        load_model("smollm2-135m", backend="openvino", weights="q8_0")
    with pytest.raises(InvalidRequest, match=r"compiled \(--compile\) applies to the transformers backend"):
        load_model("smollm2-135m", backend="openvino", compiled=True)


def test_weights_auto_times_fp32_and_bf16_once_and_remembers(tiny_dir, tmp_path, monkeypatch):
    from verispec.backends import timing
    from verispec.backends.openvino import model as ov_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    timings = {"fp32": {"1": 20.0, "2": 21.0, "5": 23.0, "9": 26.0, "prefill": 1.0},
               "bf16": {"1": 12.0, "2": 13.0, "5": 14.0, "9": 16.0, "prefill": 0.5}}
    timed = []
    monkeypatch.setattr(ov_model, "auto_candidates", lambda: ("fp32", "bf16"))
    monkeypatch.setattr(ov_model, "format_crashes", lambda *args: "")  # probed for real in the next tests
    monkeypatch.setattr(ov_model, "load", lambda ref, fmt, threads, kv, attention: fmt)  # the "model" is its format's name
    monkeypatch.setattr(timing, "time_widths", lambda model: timed.append(model) or timings[model])
    assert ov_model.choose_weights(str(tiny_dir), 2, "f32") == ("bf16", timings)
    assert sorted(timed) == ["bf16", "fp32"]
    (record,) = (tmp_path / "measurements").glob("openvino-weights-*.json")
    assert json.loads(record.read_text())["value"]["choice"] == "bf16"
    assert ov_model.choose_weights(str(tiny_dir), 2, "f32")[0] == "bf16" and len(timed) == 2  # remembered
    ov_model.choose_weights(str(tiny_dir), 1, "f32")
    assert len(timed) == 4  # another thread count is another measurement


def test_weights_auto_skips_a_format_that_crashes_its_process_and_says_why(tiny_dir, tmp_path, monkeypatch):
    """A format whose compile or first pass kills a child process (bf16 on an Intel Xeon with AMX) is not weighed:
    the choice is among the others and the record keeps the reason."""
    from verispec.backends import timing
    from verispec.backends.openvino import model as ov_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    timings = {"fp32": {"1": 20.0, "prefill": 1.0}, "bf16": {"1": 5.0, "prefill": 0.5}}
    monkeypatch.setattr(ov_model, "auto_candidates", lambda: ("fp32", "bf16"))
    monkeypatch.setattr(ov_model, "format_crashes",
                        lambda ref, fmt, *rest: "SIGFPE (Floating-point exception)" if fmt == "bf16" else "")
    loaded = []
    monkeypatch.setattr(ov_model, "load", lambda ref, fmt, threads, kv, attention: loaded.append(fmt) or fmt)
    monkeypatch.setattr(timing, "time_widths", lambda model: timings[model])
    assert ov_model.choose_weights(str(tiny_dir), 2, "f32")[0] == "fp32" and loaded == ["fp32"]
    (record,) = (tmp_path / "measurements").glob("openvino-weights-*.json")
    assert json.loads(record.read_text())["value"]["skipped"] == {"bf16": "SIGFPE (Floating-point exception)"}


def test_a_format_that_runs_is_probed_once_in_a_child(tiny_dir, tmp_path, monkeypatch):
    from verispec.backends.openvino.model import format_crashes

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    assert format_crashes(str(tiny_dir), "fp32", 1, None, "paged") == ""
    assert len(list((tmp_path / "measurements").glob("probe-*.json"))) == 1


def test_timed_passes_run_on_the_static_graphs_a_decoder_would_run(tiny_dir):
    """``--weights auto`` and the cost scripts time passes with ``timing.time_passes``: it compiles the static graphs
    covering its widths first (``prepare``), so a 5-token pass is timed on the graph of 6, as decoders run it, not
    on the dynamic graph a freshly loaded model would fall back to."""
    from verispec.backends.timing import time_passes

    model = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths=(2, 4, 6, 8))
    assert ((), 6) not in model._paged_requests  # the load compiles the narrowest only
    ms = time_passes(model, 8, (1, 5), 1)
    assert set(ms) == {1, 5} and all(v > 0 for v in ms.values())
    assert {((), 2), ((), 4), ((), 6)} <= set(model._paged_requests) and ((), 8) not in model._paged_requests


def test_weights_auto_weighs_fp16_on_every_cpu_and_bf16_only_where_the_cpu_has_it():
    import openvino as ov

    from verispec.backends.openvino.model import auto_candidates

    has_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert auto_candidates() == (("fp32", "fp16", "bf16") if has_bf16 else ("fp32", "fp16"))


def test_weights_auto_loads_what_it_chose(tiny_dir, tmp_path, monkeypatch):
    from verispec.backends import timing

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    timings = {"fp32": {"1": 20.0, "2": 21.0, "prefill": 1.0}, "fp16": {"1": 12.0, "2": 12.5, "prefill": 0.8},
               "bf16": {"1": 15.0, "2": 15.0, "prefill": 0.9}}
    monkeypatch.setattr(timing, "time_widths", lambda model: timings[model.weights])
    model = load_model(str(tiny_dir), backend="openvino", weights="auto", threads=1)
    assert model.weights == "fp16" and "fp16" in model.weight_timings_ms and "f32 inference" in model.kernel


def test_bf16_runs_in_bfloat16_where_the_cpu_has_it_and_is_refused_elsewhere(tiny_dir, tmp_path, monkeypatch):
    """Where the CPU has bf16: it runs in bfloat16, or, where OpenVINO's bf16 kernels kill their process (a floating
    point exception on a Sapphire Rapids VM), the child-process probe refuses it with the cause and the fix instead
    of this process dying."""
    from verispec.backends.openvino.model import auto_candidates, format_crashes

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    crashed = "bf16" in auto_candidates() and format_crashes(str(tiny_dir), "bf16", 1, "bf16", "paged")
    if crashed:
        with pytest.raises(InvalidRequest, match="kills its process on this CPU.*use --weights fp32 or fp16"):
            load_model(str(tiny_dir), backend="openvino", weights="bf16", threads=1)
    elif "bf16" in auto_candidates():
        model = load_model(str(tiny_dir), backend="openvino", weights="bf16", threads=1)
        # an export of its own: fp32 weights, projections unfused (verispec.backends.openvino.export.UNFUSED)
        assert "bf16 inference" in model.kernel and model.folder.name.startswith(tiny_dir.name + "-bf16-")
        assert model.forward(model.new_kv(), [1, 2, 3]).logits.shape == (3, model.vocab_size)
    else:
        with pytest.raises(InvalidRequest, match="bf16 instructions"):
            load_model(str(tiny_dir), backend="openvino", weights="bf16", threads=1)


def test_passes_of_two_or_more_tokens_give_a_position_the_same_logits_at_every_width(ov_target, tiny_dir):
    """min_width 2 (the default in every format, fp32 too): a one-token pass is padded, never run alone; on this
    CPU the load-time probe must tell the truth about whether rows then match bitwise, and padding must not leak."""
    padded = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2)
    unpadded = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=1)
    assert padded.min_width == ov_target.min_width == 2 and unpadded.min_width == 1  # fp32 pads by default
    assert unpadded.static_widths[:2] == (1, 2) and padded.static_widths[0] == 2
    seq = _ids(30, seed=4)
    kv = padded.new_kv()
    padded.forward(kv, seq[:10], last_only=True)
    wide = padded.forward(kv, seq[10:20]).logits
    kv.truncate(10)
    steps = torch.cat([padded.forward(kv, [t]).logits for t in seq[10:20]])
    assert len(kv) == 20  # the padding token stayed past the length
    assert torch.equal(wide, steps) == padded.width_invariant
    torch.testing.assert_close(steps, _fresh(padded, seq[:20])[10:20], atol=1e-4, rtol=1e-4)
    if padded.width_invariant:  # the CPUs seen so far: greedy speculation is identical by construction
        prompt = [1, 5, 9, 5, 9, 5, 9, 12, 5, 9]
        padded.eos_token_ids = frozenset()
        plain = SpeculativeDecoder(padded).generate(prompt, max_new_tokens=40)
        # fixed k: the controller, timing passes, stepped aside once on a loaded machine and verified no draft
        out = SpeculativeDecoder(padded, make_drafter("ngram", target=padded), k=4,
                                 k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert out.token_ids == plain.token_ids and sum(out.stats.step_accepted) > 0
    with pytest.raises(InvalidRequest, match="min_width"):
        load_model(str(tiny_dir), backend="openvino", threads=1, min_width=0)


def test_the_batch_engine_runs_rows_in_one_paged_pass_with_lone_output(tiny_dir):
    """Continuous batching on the paged graph: every step of several sequences is one infer call, and each answer
    equals that prompt's lone plain greedy answer (padded passes: bitwise, where the probe says so)."""
    from verispec.batching import generate_batch

    target = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2)
    target.eos_token_ids = frozenset()
    prompts = [[1, 5, 9, 5, 9, 5, 9, 12, 5, 9], [3, 4, 3, 4, 3, 4], [7] * 12, [2, 8, 11, 2, 8]]
    lone = [SpeculativeDecoder(target).generate(p, max_new_tokens=24).token_ids for p in prompts]
    calls = []
    request = target._paged_requests[(), None]
    original = request.infer
    target._paged_requests[(), None] = type("Counting", (), {
        "infer": staticmethod(lambda *a, **k: calls.append(len(a[0]["past_lens"])) or original(*a, **k)),
        "get_compiled_model": request.get_compiled_model})()
    decoders = [SpeculativeDecoder(target, make_drafter("ngram", target=target), k=4, k_policy="fixed")
                for _ in prompts]
    out = generate_batch(decoders, prompts, max_batch=4, max_new_tokens=24)
    assert max(calls) == 4  # four sequences' tokens in one infer call
    if target.width_invariant:
        assert [g.token_ids for g in out] == lone
    assert sum(g.stats.accepted for g in out) > 0


def test_sliding_window_models_are_limited_to_the_window():
    """The export's attention does not apply Gemma 3's sliding window: contexts stop at the window (where it changes
    nothing) instead of being computed wrong beyond it."""
    from types import SimpleNamespace

    from verispec.backends.openvino.model import OpenVINOModel

    def context(**config):
        return OpenVINOModel.context_length.fget(SimpleNamespace(config=SimpleNamespace(**config)))

    assert context(max_position_embeddings=32768, sliding_window=512,
                   layer_types=["sliding_attention", "full_attention"]) == 512
    assert context(max_position_embeddings=8192, sliding_window=4096, layer_types=["full_attention"]) == 8192
    assert context(max_position_embeddings=8192) == 8192


def test_a_padded_pass_computes_logits_at_every_fed_row_so_its_shapes_depend_on_its_width_alone():
    """OpenVINO re-plans its kernels whenever an input's shape changes (~4 ms a pass on 2 cores): a padded item asks
    for logits at all its fed rows, whatever it asked for, and hands back only the rows it wanted."""
    from verispec.backends.openvino.paged import PagedKV, pass_inputs

    class Pool:  # the block bookkeeping pass_inputs touches, without a compiled model
        size = 32

        def __init__(self):
            self.next = 0

        def take(self, n):
            self.next += n
            return list(range(self.next - n, self.next))

        def give(self, ids):
            pass

    kvs = [PagedKV(Pool()) for _ in range(3)]
    shapes, picked = set(), []
    for tokens, last_only in (([5], True), ([5, 6], False), ([5, 6, 7], True), ([5, 6, 7, 8], False)):
        inputs, rows, offsets, picks = pass_inputs([(kvs[0], tokens)], last_only, min_width=4)
        shapes.add((inputs["input_ids"].shape, inputs["logit_rows"].shape))
        picked.append(list(inputs["logit_rows"][picks[0]]))
        kvs[0].length = 40  # as if the pass ran (a fixed length keeps block_indices' shape)
    assert shapes == {((4,), (4,))}
    assert picked == [[0], [0, 1], [2], [0, 1, 2, 3]]
    # a batch: each item's rows and picks by its own padding; a long item is not padded
    inputs, rows, offsets, picks = pass_inputs([(kvs[1], [1]), (kvs[2], [1, 2, 3, 4, 5])], last_only=False,
                                               min_width=4)
    assert offsets == [0, 4] and list(inputs["logit_rows"]) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert [list(r[p]) for r, p in zip(rows, picks)] == [[0], [4, 5, 6, 7, 8]]
    # a static graph's pass: logits at every row even where the item is not padded
    inputs, rows, offsets, picks = pass_inputs([(kvs[1], [3, 4])], last_only=True, min_width=2, every_row=True)
    assert list(inputs["logit_rows"]) == [0, 1] and list(rows[0][picks[0]]) == [1]


def test_padding_slots_carry_guesses_and_greedy_output_stays_plain(tiny_dir):
    """A pass padded to a static width fills the padding with prompt-lookup guesses (counted apart from the
    drafter's tokens); greedy output equals plain decoding with or without them, and a drafter that never
    matches still gets tokens accepted through them."""
    target = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2)
    target.eos_token_ids = frozenset()
    prompt = [1, 5, 9, 5, 9, 5, 9, 12, 5, 9, 3, 4, 3, 4]
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40)
    assert plain.stats.filled == 0  # plain decoding stays plain
    runs = {}
    for fill in (True, False):
        for drafter in ("ngram", "suffix"):
            decoder = SpeculativeDecoder(target, make_drafter(drafter, target=target), k=4, k_policy="fixed",
                                         fill_padding=fill)
            out = decoder.generate(prompt, max_new_tokens=40)
            assert out.token_ids == plain.token_ids
            runs[fill, drafter] = out.stats
    for drafter in ("ngram", "suffix"):
        assert runs[True, drafter].filled > 0 and 0 <= runs[True, drafter].filled_accepted <= runs[True, drafter].filled
        assert runs[False, drafter].filled == 0
    never = SpeculativeDecoder(target, make_drafter("ngram", target=target, min_n=8, max_n=8), k=4)
    out = never.generate(prompt, max_new_tokens=40)
    assert out.token_ids == plain.token_ids and out.stats.drafted == 0
    assert out.stats.filled_accepted > 0 and out.stats.verify_steps < 40


def test_one_sequence_passes_run_padded_on_graphs_of_static_shapes_with_the_dynamic_graphs_logits(tiny_dir):
    """A one-sequence pass of up to 6 tokens runs padded to the next static width (2, 4, 6) on a graph of static
    shapes, which OpenVINO never re-plans; longer and batched passes run the dynamic graph. Each position gets the
    dynamic graph's logits (bitwise where the load's probe, which compares the two, says so)."""
    static = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths=(2, 4, 6))
    dynamic = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths=())
    assert static.static_widths == (2, 4, 6) and dynamic.static_widths == ()
    assert "static widths 2/4/6" in static.kernel and "static" not in dynamic.kernel
    static.prepare()  # every static width compiled now (the load compiles the narrowest only; the rest two at a time)
    assert {((), 2), ((), 4), ((), 6)} <= set(static._paged_requests)
    ran = []

    class Counting:  # the infer request, noting which graph each pass runs (infer: dynamic; start_async: static)
        def __init__(self, key, request):
            self._key, self._request = key, request

        def __getattr__(self, name):
            return getattr(self._request, name)

        def infer(self, *a, **k):
            ran.append(self._key[1])
            return self._request.infer(*a, **k)

        def start_async(self, *a, **k):
            ran.append(self._key[1])
            return self._request.start_async(*a, **k)

    for key, request in list(static._paged_requests.items()):
        static._paged_requests[key] = Counting(key, request)
    seq = _ids(40, seed=3)
    kv_s, kv_d = static.new_kv(), dynamic.new_kv()
    done = 0
    for width in (10, 1, 2, 3, 5, 6, 7, 4):
        got = static.forward(kv_s, seq[done:done + width]).logits
        want = dynamic.forward(kv_d, seq[done:done + width]).logits
        assert got.shape == want.shape == (width, static.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if static.width_invariant:
            assert torch.equal(got, want)
        done += width
    assert ran == [None, 2, 2, 4, 6, 6, None, 4]
    assert [static.pass_width([w]) for w in (1, 3, 6, 7)] == [2, 4, 6, 7] and static.pass_width([1, 1]) == 4
    assert dynamic.pass_width([3]) == 3
    for bad in ((0, 4), (1, 4), (65,)):
        with pytest.raises(InvalidRequest, match="static width"):
            load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths=bad)
    with pytest.raises(InvalidRequest, match=r"static_widths \(--static-widths\) applies to the openvino backend"):
        load_model(str(tiny_dir), static_widths=(2,))


def test_paged_passes_return_the_hidden_states_of_the_layers_asked_for_in_their_order(ov_target, tiny_target):
    """The paged graph with hidden states outputs only the layers a drafter reads (one graph per layer set), in the
    order asked: each equals the transformers model's hidden state of that layer."""
    seq = _ids(20, seed=7)
    with torch.no_grad():
        want = tiny_target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for layers in ((2, 0), (1,), (-1, 1)):
        got = ov_target.forward(ov_target.new_kv(), seq, feature_layers=layers)
        assert got.hidden.shape == (len(seq), len(layers), ov_target.config.hidden_size)
        for j, layer in enumerate(layers):
            torch.testing.assert_close(got.hidden[:, j], want[layer][0], atol=1e-4, rtol=1e-4)
    assert {((2, 0), None), ((1,), None), ((-1, 1), None), ((), None)} <= set(ov_target._paged_requests)


def test_verispec_models_lists_the_openvino_exports_and_stored_head_graphs(tiny_dir, tmp_path, monkeypatch, capsys):
    from verispec.cli import print_openvino_exports
    from verispec.eagle.openvino import HeadSteps

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    print_openvino_exports()
    assert capsys.readouterr().out.startswith(f"openvino exports: 0 in {tmp_path / 'openvino'}")
    target = load_model(str(tiny_dir), backend="openvino", threads=1)
    embedding = target.embedding_model
    head = EagleHead(head_config_for(embedding, target.name, [1], target.vocab_size)).attach(embedding).eval()
    HeadSteps(head, embedding, 1, "fp32")
    print_openvino_exports()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("openvino exports: 1 in") and lines[1].startswith(f"  {target.folder.name} · ")
    assert lines[2].startswith("  eagle-heads: 1 stored head graph(s) · ")


def test_static_passes_on_bound_inputs_follow_a_growing_block_table(tiny_dir, tiny_target):
    """Static-width passes write into inputs bound once to their request (paged.BoundInputs); the block table grows
    every 32 positions and the pool doubles past its blocks, and each position must still get transformers' logits."""
    model = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2)
    seq = _ids(120, seed=9)
    kv = model.new_kv()
    model.forward(kv, seq[:3])
    hoard = kv.pool.take(kv.pool.blocks - 1)  # nearly every block taken: the sequence's next blocks grow the pool
    got = [model.forward(kv, seq[i:i + 2]).logits for i in range(3, 119, 2)]  # 58 static passes of 2 tokens
    kv.pool.give(hoard)
    with torch.no_grad():
        want = tiny_target.model(torch.tensor([seq[:119]])).logits[0, 3:]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    bound = model._bound[(), 2]
    assert bound.arrays["block_indices"].shape == (4,)  # 119 positions: four blocks of 32


def test_static_widths_from_the_command_line(tiny_dir):
    """--static-widths reaches the backend (generate, audit, serve); it is refused on other backends and when it is
    not widths, naming the form it takes; the bench's static= reads the same way with +."""
    from verispec.backends.openvino.widths import parse_static_widths
    from verispec.cli import build_parser
    from verispec.cli.options import load_args_model

    args = build_parser().parse_args(["generate", "hi", "--backend", "openvino", "--threads", "1",
                                      "--static-widths", "2,4,6,8,10"])
    model = load_args_model(args, str(tiny_dir))
    assert model.static_widths == (2, 4, 6, 8, 10) and "static widths 2/4/6/8/10" in model.kernel
    assert parse_static_widths("none") == () and parse_static_widths("2+4", "+") == (2, 4)
    assert parse_static_widths("auto") == "auto" and parse_static_widths("auto", "+") == "auto"
    with pytest.raises(InvalidRequest, match=r"whole numbers joined by ',' \(2,4,6\), none or auto"):
        parse_static_widths("2;4")
    plain = build_parser().parse_args(["generate", "hi", "--static-widths", "2,4"])
    with pytest.raises(InvalidRequest, match=r"static_widths \(--static-widths\) applies to the openvino backend, not transformers"):
        load_args_model(plain, str(tiny_dir))


def test_a_server_runs_the_static_widths_it_is_given(tiny_dir):
    from verispec.server.config import ServeOptions, build_server_config

    options = ServeOptions.from_mapping({"target": str(tiny_dir), "backend": "openvino", "threads": 1,
                                         "drafter": "ngram", "static-widths": "2,4,6,8,10"})
    assert build_server_config(options).target.static_widths == (2, 4, 6, 8, 10)
    with pytest.raises(InvalidRequest, match=r"static_widths \(--static-widths\) applies to the openvino backend, not transformers"):
        build_server_config(ServeOptions(target=str(tiny_dir), drafter="ngram", backend_options={"static_widths": "2,4"}))


def test_static_widths_auto_keeps_the_extra_graphs_only_where_they_measure_cheaper(tiny_dir, tmp_path, monkeypatch):
    """--static-widths auto (the default) adds widths 8 and 10 to 1/2/4/6 where passes of 7-10 tokens cost at most
    0.9x the dynamic graph's on them; the choice is stored per model and CPU and read back without timing again; the
    graphs compiled to be timed and not chosen are dropped. A stand-in clock gives the timings."""
    from verispec.backends.openvino import model as ov_model
    from verispec.backends.openvino import widths

    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    timed = []

    def clock(static_ms):
        def time_static_widths(model, base, extended):
            timed.append((base, extended))
            for width in extended[len(base):]:  # compiled as the real timing compiles them
                model._paged_request((), width)
            return {"dynamic": {str(w): 10.0 for w in range(7, 11)},
                    "static": {str(w): static_ms for w in range(7, 11)}}
        return time_static_widths

    monkeypatch.setattr(widths, "time_static_widths", clock(8.5))  # 0.85x: kept
    model = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths="auto")
    assert timed == [((2, 4, 6), (2, 4, 6, 8, 10))]
    assert model.static_widths == (2, 4, 6, 8, 10) and "static widths 2/4/6/8/10 (auto)" in model.kernel
    assert model.static_timings_ms["static"]["7"] == 8.5 and model.pass_width([7]) == 8
    assert set(model._paged_requests) == {((), None), ((), 2), ((), 8), ((), 10)}  # timed, chosen: kept compiled
    (record,) = (tmp_path / "measurements").glob("openvino-static-widths-*.json")
    assert json.loads(record.read_text())["value"]["choice"] == "2/4/6/8/10"
    again = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths="auto")
    assert again.static_widths == (2, 4, 6, 8, 10) and len(timed) == 1  # remembered
    assert set(again._paged_requests) == {((), None), ((), 2)}  # nothing timed: 8 and 10 compiled when a decoder needs
    for path in (tmp_path / "measurements").glob("*.json"):
        path.unlink()
    monkeypatch.setattr(widths, "time_static_widths", clock(9.5))  # 0.95x: not worth two graphs
    slower = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths="auto")
    assert slower.static_widths == (2, 4, 6) and len(timed) == 2 and slower.pass_width([7]) == 7
    assert ((), 8) not in slower._paged_requests and ((), 10) not in slower._paged_requests
    load_model(str(tiny_dir), backend="openvino", weights="fp32", threads=1)  # auto and min_width 2: the defaults
    assert len(timed) == 2  # the same configuration as the last: its choice remembered
    load_model(str(tiny_dir), backend="openvino", weights="fp32", threads=1, min_width=1)
    assert timed[-1] == ((1, 2, 4, 6), (1, 2, 4, 6, 8, 10))  # another min_width, another measurement
    wide = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=9)  # 8 would never run: 10 alone
    assert timed[-1] == ((), (10,)) and wide.static_widths in ((), (10,))
    monkeypatch.setattr(ov_model.OpenVINOModel, "_graphs_that_fit", lambda self: 3)  # 2/4/6 fit, 8/10 would not
    tight = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=3)
    assert tight.static_widths == (4, 6) and len(timed) == 4 and tight.static_timings_ms is None  # not measured


def test_static_widths_auto_times_both_layouts_and_keeps_the_logits(tiny_dir, tmp_path, monkeypatch):
    """The real timing: passes of 7-10 tokens on the dynamic graph and on the static ones, each a median of positive
    milliseconds; whatever it chooses, passes give the dynamic graph's logits."""
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    model = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths="auto")
    timings = model.static_timings_ms
    assert set(timings) == {"dynamic", "static"} and all(set(t) == {"7", "8", "9", "10"} for t in timings.values())
    assert all(ms > 0 for t in timings.values() for ms in t.values())
    assert model.static_widths in ((2, 4, 6), (2, 4, 6, 8, 10))
    dynamic = load_model(str(tiny_dir), backend="openvino", threads=1, min_width=2, static_widths=())
    seq = _ids(40, seed=5)
    kv, kv_d = model.new_kv(), dynamic.new_kv()
    model.forward(kv, seq[:20]), dynamic.forward(kv_d, seq[:20])
    for width in (7, 9):
        got, want = model.forward(kv, seq[20:20 + width]).logits, dynamic.forward(kv_d, seq[20:20 + width]).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        kv.truncate(20), kv_d.truncate(20)


TWO_EXPORTS = """
import sys
from verispec.backends.openvino.export import export_dir
print(export_dir(sys.argv[1], "fp32"))
"""


def test_two_processes_exporting_into_one_cache_at_once_both_succeed(tiny_dir, tmp_path):
    """Two Ray replicas starting on a fresh cache: one exports while the other waits on the entry's lock, then both
    load the same complete export; nothing half-written is left behind."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "VERISPEC_CACHE": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", TWO_EXPORTS, str(tiny_dir)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outs]
    (folder,) = {out.strip().splitlines()[-1] for out, _ in outs}
    export = Path(folder)
    assert (export / "verispec_model.xml").exists() and (export / "verispec_export.json").exists()
    assert sorted(p.name for p in export.parent.iterdir() if p.is_dir()) == [export.name]  # no temporary folders
    assert sum("exporting" in err for _, err in outs) == 1  # the second found it done
