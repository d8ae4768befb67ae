"""The arctic-inference SuffixDecoding peer: its cache drafts, verispec verifies. arctic-inference builds from source
with a workaround (docs/suffix.md), so CI runs the adapter against a fake cache with the same interface (the calls a
request makes, chains and trees); the last test runs the real cache where it is installed."""

import importlib.util
import sys
import types
from dataclasses import dataclass, field

import pytest

from verispec import SpeculativeDecoder
from verispec.bench.method_specs import build_method
from verispec.errors import InvalidRequest

PROMPT = [5, 9, 3, 5, 9, 3, 5]


@dataclass
class FakeDraft:
    token_ids: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    probs: list = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class FakeCache:
    """Proposes what followed the latest earlier occurrence of the context's last token in the request's text."""

    instances: list = []

    def __init__(self, max_tree_depth=64, max_cached_requests=-1):
        self.calls, self.texts = [], {}
        FakeCache.instances.append(self)

    def start_request(self, rid, prompt):
        assert rid not in self.texts, "a request id is started twice"
        self.calls.append(("start", rid, list(prompt)))
        self.texts[rid] = list(prompt)

    def add_active_response(self, rid, tokens):
        self.calls.append(("add", rid, list(tokens)))
        self.texts[rid] += list(tokens)

    def stop_request(self, rid):
        self.calls.append(("stop", rid))

    def speculate(self, rid, context, max_spec_tokens=8, max_spec_factor=1.0, max_spec_offset=0.0,
                  min_token_prob=0.1, use_tree_spec=False):
        assert list(context) == self.texts[rid], "the cache was not told every committed token"
        text = self.texts[rid]
        for start in range(len(text) - 2, -1, -1):
            if text[start] == text[-1]:
                tokens = text[start + 1 : start + 1 + max_spec_tokens]
                parents = list(range(-1, len(tokens) - 1))
                return FakeDraft(tokens, parents, [0.5] * len(tokens), 0.5 * len(tokens), 1)
        return FakeDraft()


@pytest.fixture()
def fake_arctic(monkeypatch):
    FakeCache.instances.clear()
    package = types.ModuleType("arctic_inference")
    module = types.ModuleType("arctic_inference.suffix_decoding")
    module.SuffixDecodingCache = FakeCache
    monkeypatch.setitem(sys.modules, "arctic_inference", package)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", module)
    return FakeCache


@pytest.mark.parametrize("spec", ["arctic:suffix:k=4", "arctic:suffix:tree=1:k=4"])
def test_peer_greedy_output_equals_plain_and_the_cache_sees_every_token(tiny_target, fake_arctic, spec):
    method = build_method(spec, tiny_target, load=None)
    assert method.family == "arctic-inference" and method.drafter == "arctic-suffix"
    plain = SpeculativeDecoder(tiny_target).generate(PROMPT, max_new_tokens=24).token_ids
    for _ in range(2):  # a second request: the first is stopped, a new id started
        run = method.run(PROMPT, 24, 0.0, 1.0, 0)
        assert run.token_ids == plain
    calls = fake_arctic.instances[-1].calls
    assert calls[0][:2] == ("start", 0) and calls[0][2][:len(PROMPT)] == PROMPT  # the controller may step first
    second = next(c for c in calls if c[:2] == ("start", 1))  # the second request, after the first was stopped
    assert calls.index(("stop", 0)) < calls.index(second) and second[2][: len(PROMPT)] == PROMPT
    assert any(c[0] == "add" for c in calls)


def test_missing_package_and_bad_options_name_the_fix(tiny_target, monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference", None)  # import fails
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(InvalidRequest, match="no-build-isolation"):
        build_method("arctic:suffix", tiny_target, load=None)
    with pytest.raises(InvalidRequest, match="arctic:suffix"):
        build_method("arctic:lookup", tiny_target, load=None)
    with pytest.raises(InvalidRequest, match="unknown option"):
        build_method("arctic:suffix:foo=1", tiny_target, load=None)
    with pytest.raises(InvalidRequest, match="numbers"):
        build_method("arctic:suffix:min_prob=high", tiny_target, load=None)


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is None,
                    reason="arctic-inference is not installed (it builds from source: docs/suffix.md)")
def test_real_cache_drafts_and_output_equals_plain(tiny_target):
    method = build_method("arctic:suffix:k=4", tiny_target, load=None)
    plain = SpeculativeDecoder(tiny_target).generate(PROMPT, max_new_tokens=24).token_ids
    assert method.run(PROMPT, 24, 0.0, 1.0, 0).token_ids == plain
