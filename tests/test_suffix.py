"""The suffix drafter on its store and on tiny random targets: longest matches and their most frequent continuations,
drafts from earlier requests (scope process) and not (scope request), the store's token bound, greedy output
identical to plain decoding (chains and trees), and sampled output following the target's exact distribution while
the store fills with earlier samples."""

import pytest

from statistical_helpers import ALPHA, joint_p_value
from verispec import SamplingParams, SpeculativeDecoder, make_drafter
from verispec.drafters import get_spec
from verispec.drafters.suffix import SuffixDrafter, SuffixStore, _Trie
from verispec.errors import InvalidRequest


def test_longest_match_wins_and_its_continuations_are_counted():
    store = SuffixStore(n=2)
    a, b = store.open(), store.open()
    store.extend(a, [1, 2, 3, 4, 5, 9, 2, 3, 7])  # (2, 3) is followed by 4 after a 3-match "1 2 3", by 7 after "9 2 3"
    store.extend(b, [8, 1, 2, 3, 4, 6])
    m, conts = store.matches([0, 1, 2, 3], max_match=32, depth=3)
    assert m == 3 and conts == [[4, 6], [4, 5, 9]]  # most recent first; "9 2 3" matches 2 tokens only
    m, conts = store.matches([5, 2, 3], max_match=32, depth=2)
    assert m == 2 and sorted(conts) == [[4, 5], [4, 6], [7]]
    assert store.matches([3, 3], 32, 2) == (0, [])
    assert store.matches([3], 32, 2) == (0, [])


def test_the_last_token_alone_drafts_only_where_no_two_tokens_match():
    store = SuffixStore(n=2)
    sid = store.open()
    store.extend(sid, [1, 2, 3, 4, 9, 3, 5, 1, 2])
    # (7, 3) never occurred: the last token alone matches (m = 1), both of its continuations, most recent first
    assert store.matches([7, 3], 32, 2, min_n=1) == (1, [[5, 1], [4, 9]])
    assert store.matches([7, 3], 32, 2) == (0, [])  # min_n defaults to the store's n
    # where two tokens match, the single-token matches are not mixed in
    assert store.matches([9, 3], 32, 2, min_n=1) == (2, [[5, 1]])
    assert store.matches([0, 8], 32, 2, min_n=1) == (0, [])  # a token never seen
    # the context's own end is no match: a token that occurred only there drafts nothing
    assert store.matches([1, 2], 32, 2, exclude_end=(sid, 9), min_n=1) == (2, [[3, 4]])
    drafter = SuffixDrafter(store=SuffixStore())
    assert drafter.propose([1, 2, 3, 4, 7, 3], k=2).tokens == [4, 7]  # only "3" repeats: drafted at min_n = 1
    assert SuffixDrafter(store=SuffixStore(), min_n=2).propose([1, 2, 3, 4, 7, 3], k=2).tokens == []
    # trees keep two-token matches unless told (their one-token drafts were never measured)
    assert SuffixDrafter(tree=True, store=SuffixStore()).propose([1, 2, 3, 4, 7, 3], k=2).tokens == []
    assert SuffixDrafter(tree=True, store=SuffixStore(), min_n=1).propose([1, 2, 3, 4, 7, 3], k=2).tokens == [4, 7]
    assert make_drafter("suffix", min_n=2).min_n == 2 and make_drafter("suffix").min_n == 1
    with pytest.raises(InvalidRequest, match="min_n"):
        SuffixDrafter(min_n=3)


def test_trie_chain_follows_the_majority_and_tree_takes_the_largest_shares():
    trie = _Trie([[4, 5, 6], [4, 5, 7], [4, 8], [9]])
    assert trie.best_chain(5, min_share=0.2) == ([4, 5, 6], [0.75, 0.5, 0.25])
    assert trie.best_chain(5, min_share=0.3)[0] == [4, 5]
    draft = trie.best_tree(4)
    # shares: 4 (3/4), 5 (2/4), then 9, 8, 6, 7 (1/4 each; among equals the one reached first, the shallower)
    assert draft.tokens == [4, 5, 9, 8] and draft.parents == [-1, 0, -1, 0]


def test_store_keeps_its_token_bound_but_never_drops_a_sequence_being_written():
    store = SuffixStore(n=2, max_tokens=100)
    for i in range(50):
        sid = store.open()
        store.extend(sid, [(i * 7 + j) % 50 for j in range(30)])
        store.close(sid)
    assert store.tokens <= 100 and len(store.sequences) <= 4
    assert sum(len(v) for v in store.index.values()) <= 10 * (store.tokens + 4096)  # stale entries get rebuilt away
    live = store.open()
    store.extend(live, list(range(300)))  # alone over the bound: it stays while written
    assert live in store.sequences and store.tokens >= 300
    store.close(live)
    assert store.tokens <= 100 or list(store.sequences) == [live]


def test_earlier_requests_draft_the_repeat_and_scope_request_does_not(tiny_target):
    prompt = [3, 7, 11, 4, 9, 13, 6]
    decoders = {scope: SpeculativeDecoder(tiny_target, SuffixDrafter(scope=scope, store=SuffixStore()
                                                                    if scope == "process" else None),
                                          k=6, k_policy="fixed") for scope in ("process", "request")}
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=30).token_ids
    accepted = {}
    for scope, decoder in decoders.items():
        first = decoder.generate(prompt, max_new_tokens=30)
        second = decoder.generate(prompt, max_new_tokens=30)
        assert first.token_ids == second.token_ids == plain
        accepted[scope] = (first.stats.accepted, second.stats.accepted)
    # the second answer repeats the first: drafted from it under scope process, nearly all accepted
    assert accepted["process"][1] >= 20 > accepted["process"][0], accepted  # 30 tokens: at most ~24 drafted
    assert accepted["request"][1] == accepted["request"][0]  # nothing carried over


@pytest.mark.parametrize("tree", [False, True])
def test_ids_outside_the_targets_vocabulary_are_never_fed_to_it(tiny_target, tree):
    """The process's store holds every model's sequences: another model's ids after the same context (here ids past
    the tiny model's vocabulary) are drafted, and the engine ends the draft before them instead of feeding them to
    the target (llama.cpp refused such a batch, an embedding raises)."""
    vocab = tiny_target.vocab_size
    prompt = [3, 7, 11, 4, 9, 13, 6]
    store = SuffixStore()
    other = store.open()
    store.extend(other, prompt + [vocab + 5, vocab + 9, 3, 4])
    store.close(other)
    assert SuffixDrafter(tree=tree, store=store).propose(prompt, 4).tokens[0] >= vocab
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=20).token_ids
    got = SpeculativeDecoder(tiny_target, SuffixDrafter(tree=tree, store=store), k=4, k_policy="fixed").generate(
        prompt, max_new_tokens=20)
    assert got.token_ids == plain


@pytest.mark.parametrize("options", [{}, {"tree": True}])
def test_greedy_output_equals_plain_decoding(tiny_target, options):
    drafter = make_drafter("suffix", target=tiny_target, scope="request", **options)
    assert (drafter.tree_depth is not None) == bool(options)
    decoder = SpeculativeDecoder(tiny_target, drafter, k=5, k_policy="fixed")
    plain = SpeculativeDecoder(tiny_target)
    for prompt in ([1, 5, 9, 5, 9, 5, 9, 12, 5, 9], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [20, 21, 22]):
        got = decoder.generate(prompt, max_new_tokens=40)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=40).token_ids
    assert got.stats.drafted > 0 or prompt == [20, 21, 22]


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_follows_the_exact_distribution_with_a_filling_store(tiny_target, tree):
    """2,500 samples of one prompt: every later sample drafts from the earlier ones' text (one-hot q)."""
    drafter = SuffixDrafter(tree=tree, store=SuffixStore(), min_share=0.0)
    decoder = SpeculativeDecoder(tiny_target, drafter, k=3, k_policy="fixed")
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA
    assert drafter.store.tokens > 1000  # the store really held the earlier samples


def test_bad_options_name_the_fix():
    with pytest.raises(InvalidRequest, match="scope must be one of process, request"):
        SuffixDrafter(scope="server")
    with pytest.raises(InvalidRequest, match=r"min_share must be within \[0, 1\]"):
        SuffixDrafter(min_share=1.5)
    with pytest.raises(InvalidRequest, match="takes process, request"):
        get_spec("suffix").option("scope").parse("global", "suffix:scope=global")
    assert get_spec("suffix").drafts_trees({"tree": True}) and not get_spec("suffix").drafts_trees({})


def test_bench_methods_draft_from_their_own_answers_only(tiny_target):
    from verispec.bench import build_method

    a, b = (build_method(spec, tiny_target, None) for spec in ("suffix", "suffix:tree=true"))
    prompt = [3, 7, 11, 4, 9, 13, 6]
    first = a.run(prompt, 20)
    second = b.run(prompt, 20)  # the same answer: it would be drafted whole from a's if they shared a store
    assert first.token_ids == second.token_ids
    assert sum(second.step_tokens) == 20 and max(second.step_tokens) <= 2
