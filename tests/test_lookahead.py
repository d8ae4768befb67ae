"""Lookahead decoding: the tree it feeds (the paper's attention pattern), its Jacobi window and n-gram pool,
losslessness (greedy identity, the exact joint distribution) and where it cannot run."""

import pytest
import torch

from statistical_helpers import ALPHA, joint_p_value
from tiny import ancestors
from verispec import InvalidRequest, SamplingParams, SpeculativeDecoder
from verispec.drafters import make_drafter
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.tree import depths

CONTEXT = [1, 5, 9, 7, 3, 12, 30, 4]


def test_the_lookahead_branch_is_the_papers_window_as_a_tree():
    drafter = LookaheadDrafter(window=4, ngram=4, candidates=0, context_pool=False)
    draft = drafter.propose(CONTEXT, 64)
    levels = drafter._levels  # [3 levels][4 columns], level 0 column 0 = the pending token
    # (W - 1) level-0 tokens plus W columns of N - 2 tokens above them
    assert len(draft) == 3 + 4 * 2 and draft.depth == drafter.tree_depth == 4 - 1 + 4 - 2
    last = drafter._fed
    for c in range(4):
        path = [draft.tokens[i] for i in ancestors(draft.parents, last[c])]
        # column c sees level 0 up to column c, then its own column: at consecutive positions after the pending token
        assert path == levels[0][1 : c + 1] + [levels[1][c], levels[2][c]]
        assert depths(draft.parents)[last[c]] == c + 2


def test_the_window_moves_up_a_level_and_pools_each_columns_ngram():
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=2, context_pool=False)
    draft = drafter.propose(CONTEXT, 64)
    before = [list(level) for level in drafter._levels]
    vocab = 40
    logits = torch.zeros(1 + len(draft), vocab)
    guesses = [31, 32, 33]
    for c, node in enumerate(drafter._fed):
        logits[1 + node, guesses[c]] = 5.0
    drafter.observe(0)
    drafter.observe_logits(logits)
    assert drafter._levels == [before[1], guesses]
    # column 0's n-gram starts with the pending token, the others with their level-0 guess
    assert drafter._pool[CONTEXT[-1]] == [(before[1][0], 31)]
    for c in (1, 2):
        assert (before[1][c], guesses[c]) in drafter._pool[before[0][c]]
    # the next proposal after that pending token verifies the pooled n-gram first
    nxt = drafter.propose(CONTEXT + [before[1][0]], 64)
    assert drafter._pool.get(before[1][0]) is None or nxt.tokens
    again = drafter.propose(CONTEXT, 64)  # not an extension of the last context: a new request starts over
    assert drafter._pool == {} and len(again) == 2 + 3


def test_the_context_pool_verifies_what_followed_the_pending_token_before():
    context = [1, 5, 9, 7, 3, 5, 9, 8, 6, 5]
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=4)
    draft = drafter.propose(context, 16)
    # the n-grams after the earlier 5s, newest first: (9, 8) then (9, 7), merged into a trie, before the window
    assert draft.tokens[:3] == [9, 8, 7] and draft.parents[:3] == [-1, 0, 0]
    assert drafter._pool[9] == [(7, 3), (8, 6)]
    pure = LookaheadDrafter(window=3, ngram=3, candidates=4, context_pool=False).propose(context, 16)
    assert len(pure) == 2 + 3  # the window only


def test_candidates_take_at_most_half_the_budget_and_columns_what_is_left():
    drafter = LookaheadDrafter(window=5, ngram=3, candidates=8, context_pool=False)
    drafter._sync(CONTEXT)
    drafter._pool[CONTEXT[-1]] = [(20 + i, 21 + i) for i in range(8)]
    for k in (1, 4, 9, 16, 40):
        draft = drafter.propose(CONTEXT, k)
        columns = sum(node is not None for node in drafter._fed)
        pooled = len(draft) - (2 * columns - 1 if columns else 0)  # the window's nodes come after the candidates
        assert all(t >= 20 for t in draft.tokens[:pooled])
        assert len(draft) <= k and pooled <= k // 2
        assert columns == min(5, (k - pooled + 1) // 2)


def test_greedy_output_is_plain_decodings_and_guesses_get_accepted(tiny_target):
    prompt = [1, 5, 9, 7, 3, 5, 9, 7, 3]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=60)
    for window, ngram, k in ((4, 3, 12), (5, 4, 24), (2, 3, 3)):
        decoder = SpeculativeDecoder(tiny_target, LookaheadDrafter(window, ngram, 4), k=k, k_policy="fixed")
        got = decoder.generate(prompt, max_new_tokens=60)
        assert got.token_ids == plain.token_ids, (window, ngram)
        assert got.stats.drafted > 0
    assert got.stats.accepted > 0 or decoder.drafter._pool  # it guessed and pooled


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sampled_output_follows_the_exact_joint_distribution(tiny_target, sampling):
    decoder = SpeculativeDecoder(tiny_target, LookaheadDrafter(3, 3, 3), k=8, k_policy="fixed")
    assert joint_p_value(decoder, sampling) > ALPHA


def test_options_are_checked_and_whole_graph_backends_refuse_it():
    with pytest.raises(InvalidRequest, match="n-gram size"):
        LookaheadDrafter(ngram=2)
    with pytest.raises(InvalidRequest, match="window"):
        LookaheadDrafter(window=0)

    class Llama:
        backend = "llamacpp"
        supports_trees = False

    with pytest.raises(InvalidRequest, match="lookahead drafter needs a target that verifies token trees .*llamacpp"):
        make_drafter("lookahead", Llama())


def test_a_server_offers_it_unbatched_only_and_says_why(tiny_dir, capsys):
    from verispec.cli import main
    from verispec.server.config import ServeOptions, build_server_config

    batched = build_server_config(ServeOptions(target=str(tiny_dir), drafter="ngram"))
    assert "lookahead" not in batched.drafters and "ngram" in batched.drafters
    unbatched = build_server_config(ServeOptions(target=str(tiny_dir), drafter="ngram", max_batch=1))
    assert isinstance(unbatched.drafters["lookahead"](), LookaheadDrafter)
    assert main(["serve", "--target", str(tiny_dir), "--drafter", "lookahead"]) == 2
    assert "--drafter lookahead verifies one sequence per pass; add --max-batch 1" in capsys.readouterr().err


def test_a_batched_server_asked_for_it_says_how_to_get_it(tiny_dir):
    import httpx
    from serving import Server

    server = Server("--target", str(tiny_dir), "--drafter", "ngram")
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": str(tiny_dir), "prompt": "w5 w9 w7", "max_tokens": 4, "verispec": {"drafter": "lookahead"}})
        assert reply.status_code == 400
        assert "lookahead drafts token trees" in reply.json()["error"]["message"]
        assert "--max-batch 1" in reply.json()["error"]["message"]
    finally:
        server.stop()


def test_a_backend_without_trees_is_refused_before_any_work(tiny_target):
    class ChainsOnly(type(tiny_target)):
        supports_trees = False

    target = ChainsOnly(model=tiny_target.model, tokenizer=tiny_target.tokenizer, name="chains",
                        eos_token_ids=frozenset())
    with pytest.raises(InvalidRequest, match="lookahead drafter's token trees need a backend .*transformers or "
                                             "openvino"):
        SpeculativeDecoder(target, LookaheadDrafter())
