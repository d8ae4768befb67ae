"""Self-speculative drafting with skipped layers: the view, its drafts, losslessness, the layer search and errors."""

import copy
import dataclasses

import pytest
import torch

from statistical_helpers import ALPHA, joint_p_value
from tiny import loaded, make_model
from verispec import InvalidRequest, SamplingParams, SpeculativeDecoder
from verispec.backends.base import TargetModelBase
from verispec.backends.hf.cache import TorchKV
from verispec.drafters import get_spec, make_drafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.layerskip_search import Calibration, calibrate, calibrated, format_layers, parse_skip


@pytest.fixture(scope="module")
def deep_target():
    """A tiny target with 6 layers (the shared tiny target has 2)."""
    return loaded(make_model(seed=11, layers=6))


def without_layers_by_hand(model, skip):
    """The reference: a copy of the model with the layers deleted and the rest renumbered."""
    other = copy.deepcopy(model)
    kept = [layer for i, layer in enumerate(other.model.layers) if i not in skip]
    for i, layer in enumerate(kept):
        layer.self_attn.layer_idx = i
    other.model.layers = torch.nn.ModuleList(kept)
    other.config.num_hidden_layers = len(kept)
    return other


@torch.inference_mode()
def test_the_view_computes_the_model_without_those_layers_and_leaves_the_target_alone(deep_target):
    ids = torch.tensor([[1, 5, 9, 7, 3, 12, 30, 4]])
    before = deep_target.model(input_ids=ids).logits
    view = deep_target.without_layers((2, 4))
    assert view.skipped_layers == (2, 4) and view.num_layers == 4 and deep_target.num_layers == 6
    expected = without_layers_by_hand(deep_target.model, {2, 4})(input_ids=ids).logits
    torch.testing.assert_close(view.model(input_ids=ids).logits, expected)
    assert not torch.equal(expected, before)  # skipping changed something
    torch.testing.assert_close(deep_target.model(input_ids=ids).logits, before)  # the target did not change
    # weights are shared, not copied
    assert view.model.model.layers[0] is deep_target.model.model.layers[0]
    assert view.model.lm_head.weight.data_ptr() == deep_target.model.lm_head.weight.data_ptr()
    assert view.measurement_key is None  # a view's costs are never stored as the model's


@torch.inference_mode()
def test_the_views_cache_grows_and_rolls_back_like_a_models(deep_target):
    view = deep_target.without_layers((1, 3))
    tokens = [1, 5, 9, 7, 3, 12, 30, 4, 8]
    kv = view.new_kv()
    view.forward(kv, tokens[:5])
    view.forward(kv, [22, 23])  # a rejected draft
    kv.truncate(5)
    assert len(kv) == 5
    step = view.forward(kv, tokens[5:]).logits
    whole = view.model(input_ids=torch.tensor([tokens])).logits[0, 5:]
    torch.testing.assert_close(step, whole, atol=1e-5, rtol=1e-5)
    assert isinstance(kv, TorchKV) and kv.cache.layers[1].get_seq_length() == 0  # the skipped slot stays empty


def test_greedy_output_is_the_plain_output(deep_target):
    prompt = [1, 5, 9, 7, 3]
    plain = SpeculativeDecoder(deep_target).generate(prompt, max_new_tokens=40)
    for layers in ("2", "1,3-4", [4]):
        drafter = LayerSkipDrafter(deep_target, layers)
        result = SpeculativeDecoder(deep_target, drafter, k=3, k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert result.token_ids == plain.token_ids, layers
        assert result.stats.drafted > 0 and result.stats.accepted > 0


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=8)])
def test_sampled_output_follows_the_exact_joint_distribution(tiny_target, sampling):
    deep = loaded(make_model(seed=0, layers=3), tiny_target.tokenizer)
    decoder = SpeculativeDecoder(deep, LayerSkipDrafter(deep, "1"), k=3, k_policy="fixed")
    assert joint_p_value(decoder, sampling) > ALPHA


def test_layer_lists_are_parsed_and_printed_both_ways():
    assert parse_skip("3,5-8", 10) == (3, 5, 6, 7, 8) == parse_skip("3+5-8", 10) == parse_skip([8, 7, 6, 5, 3], 10)
    assert format_layers((3, 5, 6, 7, 8)) == "3,5-8"
    for bad, words in (("", "no layers"), ("a-b", "numbers and ranges"), ("0,2", "layer 0 is always kept"),
                       ("9-12", "layers 0-9")):
        with pytest.raises(InvalidRequest, match=words):
            parse_skip(bad, 10)


def test_backends_that_cannot_skip_layers_say_so(deep_target):
    class WholeGraph(TargetModelBase):  # a backend that runs its whole graph in one call (declares no skipping)
        backend = "llamacpp"

    with pytest.raises(InvalidRequest, match="llamacpp backend cannot.*--backend transformers"):
        LayerSkipDrafter(WholeGraph(), "1")
    with pytest.raises(InvalidRequest, match="layerskip drafter needs a target that runs a subset of its own layers "
                                             r"\(transformers\), which the llamacpp backend's target is not"):
        make_drafter("layerskip", WholeGraph(), layers="1")


def layer_priced_passes(fixed_ms: float = 1.0, layer_ms: float = 0.5):
    """A stand-in for ``time_passes``: a pass costs ``fixed_ms`` plus ``layer_ms`` a layer run (a 5-token pass 1.5x),
    so the search's cost model is tested on known timings instead of a noisy clock."""
    def passes(model, context, widths, repeats):
        one = fixed_ms + layer_ms * model.num_layers  # a view without layers counts only the ones it runs
        return {w: one * (1.0 if w == 1 else 1.5) for w in widths}
    return passes


def test_the_search_drops_the_least_needed_layers_and_is_stored(deep_target, tmp_path, monkeypatch):
    import verispec.drafters.layerskip_search as search

    monkeypatch.setattr(search, "time_passes", layer_priced_passes())
    result = calibrate(deep_target, prompts=("w5 w9 w7", "w3 w12 w30"), new_tokens=12, max_rounds=3, progress=False)
    assert result.layers == 6 and 1 <= len(result.path) <= 3
    assert [len(c.skip) for c in result.path] == list(range(1, len(result.path) + 1))
    for before, after in zip(result.path, result.path[1:]):
        assert set(before.skip) < set(after.skip)  # greedy: each round adds one layer to the set
        assert after.cost_ratio < before.cost_ratio
    # 6 layers at 0.5 ms and 1 ms fixed: a step is 4 ms, each skipped layer takes 0.5 ms off it
    expected = [(4 - 0.5 * n) / 4 for n in range(1, len(result.path) + 1)]
    assert [c.cost_ratio for c in result.path] == pytest.approx(expected)
    assert all(0 not in c.skip and 5 not in c.skip for c in result.path)  # the first and last layers stay
    assert all(0 <= c.agreement <= 1 and c.predicted_speedup > 0 for c in result.path)
    best = max(result.path, key=lambda c: c.predicted_speedup)
    assert result.skip == best.skip and result.predicted_speedup == best.predicted_speedup
    assert Calibration.from_record(dataclasses.asdict(result)) == result

    # stored under the target's measurement key: the second call reads it instead of searching
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(type(deep_target), "measurement_key", property(lambda self: {"model": "deep-tiny"}))
    calls = []
    monkeypatch.setattr(search, "calibrate", lambda target, progress: calls.append(1) or result)
    first = calibrated(deep_target, progress=False)
    second = calibrated(deep_target, progress=False)
    assert calls == [1] and first == second == result and list(tmp_path.glob("layerskip-*.json"))
    drafter = LayerSkipDrafter(deep_target)  # "auto": the stored choice
    assert drafter.skipped == result.skip and drafter.calibration == result and calls == [1]
    assert drafter.idle == (result.predicted_speedup <= 1.0)


def test_a_clock_that_prices_half_the_layers_above_all_of_them_makes_layers_free_not_negative(deep_target, monkeypatch,
                                                                                           caplog):
    import verispec.drafters.layerskip_search as search

    # timing noise on a tiny model: the view without half its layers measured slower than the whole model
    monkeypatch.setattr(search, "time_passes", layer_priced_passes(fixed_ms=4.0, layer_ms=-0.1))
    with caplog.at_level("WARNING"):
        result = calibrate(deep_target, prompts=("w5 w9 w7",), new_tokens=8, max_rounds=2, progress=False)
    assert [c.cost_ratio for c in result.path] == [1.0] * len(result.path)  # a draft costs a whole step
    assert all(c.predicted_speedup < 1.0 for c in result.path) and "not predicted to pay" in caplog.text


def test_an_automatic_choice_predicted_to_lose_drafts_nothing_and_named_layers_always_draft(deep_target):
    choice = Calibration((2,), 0.7, 0.9, 0.8, 1, 6, 1.0)
    losing = LayerSkipDrafter(deep_target, choice)
    assert losing.idle and len(losing.propose([1, 5, 9], 3)) == 0
    result = SpeculativeDecoder(deep_target, losing, k=3, k_policy="fixed").generate([1, 5, 9], max_new_tokens=8)
    assert result.stats.drafted == 0 and len(result.token_ids) == 8
    winning = LayerSkipDrafter(deep_target, dataclasses.replace(choice, predicted_speedup=1.3))
    assert not winning.idle and len(winning.propose([1, 5, 9], 3)) == 3
    named = LayerSkipDrafter(deep_target, "2")
    assert not named.idle and named.calibration is None and len(named.propose([1, 5, 9], 3)) == 3
    # a server's later drafters get the first one's choice, idle or not, without searching again
    spec = get_spec("layerskip")
    assert spec.build(deep_target, None, **spec.share(losing)).idle
    assert spec.build(deep_target, None, **spec.share(named)).skipped == (2,)
