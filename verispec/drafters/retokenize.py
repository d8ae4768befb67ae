"""A draft model with another tokenizer: its drafts travel as text (string-level exact match).

The draft model reads the committed text in its own tokens and continues it greedily; the continuation's text is
tokenized with the target's tokenizer and proposed as target tokens. The proposal is deterministic, so q is one-hot
on each proposed token and the engine's rejection rule keeps the target's distribution exactly, at any temperature
(a token x is accepted with probability p(x); on rejection the target samples from p with x removed). This is the
string-level exact match (SLEM) algorithm of Timor et al. (ICML 2025, "lossless speculative decoding algorithms for
heterogeneous vocabularies"), which is also what Universal Assisted Generation does for greedy decoding. A sampled
draft is never used: its q lives in the draft's vocabulary, not the target's.

Token boundaries: a text piece is tokenized as the continuation of the text before it (an anchor of a few tokens),
so leading-space rules (byte-level BPE's 'Ġ', SentencePiece's '▁') see it mid-text; the last target token of a
draft is dropped unless the draft ended, since the draft's text may stop inside a word. Special tokens travel by
role (beginning and end of sequence) or by spelling where both tokenizers have the same one; the others are left
out of what the draft reads (another family's chat markers mean nothing to it); a draft ends at its first special
token, proposing the target's counterpart if there is one. None of this can change the output, only how much
of a draft is accepted: the target verifies every proposed token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends.base import TargetModel
from ..prefix import common_prefix_length, reusable_prefix
from ..sampling import SamplingParams, greedy_tokens
from .base import EMPTY_DRAFT, Draft, DrafterBase

ANCHOR = 4  # tokens of context decoded or tokenized with a piece of text, for its boundary
TAIL = 64  # committed target tokens translated again at each proposal; older text is translated once, in chunks


def decode_after(tokenizer, ids: Sequence[int], start: int) -> str:
    """The text that ``ids[start:]`` add to ``ids[:start]`` (decoded with a few tokens before them, so a leading
    space or a character split over tokens comes out as it does in the whole text). Special tokens are left out."""
    begin = max(0, start - ANCHOR)
    before = tokenizer.decode(ids[begin:start], skip_special_tokens=True)
    whole = tokenizer.decode(ids[begin:], skip_special_tokens=True)
    if whole.startswith(before):
        return whole[len(before):]
    return tokenizer.decode(ids[start:], skip_special_tokens=True)


def encode_after(tokenizer, anchor: str, text: str) -> list[int]:
    """Token ids for ``text`` where it follows ``anchor``: the tokens of ``anchor + text`` after those of
    ``anchor``. Where the text's first token would merge with the anchor's last (a word continued), the anchor's
    tokens are committed and cannot change: the text is tokenized on its own if that spells the same text after the
    anchor's tokens (byte-level BPE), else nothing is returned (a tokenizer that would add a leading space)."""
    if not anchor:
        return tokenizer.encode(text, add_special_tokens=False)
    base = tokenizer.encode(anchor, add_special_tokens=False)
    both = tokenizer.encode(anchor + text, add_special_tokens=False)
    if common_prefix_length(base, both) == len(base):
        return both[len(base):]
    alone = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(base + alone, skip_special_tokens=True) == tokenizer.decode(both, skip_special_tokens=True):
        return alone
    return []


def special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (named ones and added tokens marked special)."""
    ids = set(tokenizer.all_special_ids)
    for i, token in tokenizer.added_tokens_decoder.items():
        if token.special:
            ids.add(int(i))
    return ids


def special_map(source, into) -> dict[int, int]:
    """Tokenizer ``source``'s special token ids to tokenizer ``into``'s: beginning and end of sequence by role, the
    others by their spelling where ``into`` has the same special token; tokens with no counterpart are left out."""
    found: dict[int, int] = {}
    into_specials = special_ids(into)
    for i in special_ids(source):
        spelling = source.convert_ids_to_tokens(i)
        j = into.convert_tokens_to_ids(spelling)  # an unknown spelling gives the unknown token's id: checked below
        if isinstance(j, int) and j in into_specials and into.convert_ids_to_tokens(j) == spelling:
            found[i] = j
    # beginning and end of sequence by role (None where a tokenizer has none)
    for i, j in ((source.bos_token_id, into.bos_token_id), (source.eos_token_id, into.eos_token_id)):
        if i is not None and j is not None:
            found[i] = j
    return found


class RetokenizingDrafter(DrafterBase):
    """Greedy drafts of a model with another tokenizer, proposed as the target's tokens (see the module doc).

    Per request it translates the prompt for the draft once and the answer in chunks of ``TAIL`` tokens as it
    settles; each proposal translates only the last ``TAIL`` to ``2 TAIL`` tokens (a bounded cost at any length)
    and feeds the draft model only what its cache lacks (the longest shared prefix is kept, as ``ModelDrafter``
    does). Text runs are translated as text; special tokens by ``special_map`` (or left out). ``draft_steps``
    counts the draft model's one-token steps, ``proposed`` the target tokens proposed."""

    name = "model"

    def __init__(self, draft: TargetModel, target: TargetModel):
        self.draft = draft
        self.target_tokenizer = target.tokenizer
        self.draft_tokenizer = draft.tokenizer
        self.vocab_size = target.vocab_size
        self.target_specials = special_ids(target.tokenizer)
        self.to_draft = special_map(target.tokenizer, draft.tokenizer)
        self.to_target = special_map(draft.tokenizer, target.tokenizer)
        self.draft_specials = special_ids(draft.tokenizer) | set(draft.eos_token_ids)
        self.draft_start = draft.tokenizer.encode("", add_special_tokens=True)  # e.g. the draft's BOS
        self.draft_steps = self.proposed = 0
        # the draft's cache, kept across requests: a proposal keeps the prefix its draft ids share with it
        self._cache = None
        self._cached: list[int] = []  # draft ids whose keys/values are in _cache
        self.reset(SamplingParams(), None)

    def reset(self, sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        self._frozen: list[int] | None = None  # committed target ids translated once (the prompt, settled answer)
        self._frozen_draft: list[int] = []  # the same in draft ids

    def translate(self, ids: Sequence[int], start: int, prefix: list[int]) -> list[int]:
        """Draft ids for target ``ids[start:]``, following ``prefix`` (the draft ids of ``ids[:start]``)."""
        out = list(prefix)
        i = start
        while i < len(ids):
            if ids[i] in self.target_specials:
                if ids[i] in self.to_draft:
                    out.append(self.to_draft[ids[i]])
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] not in self.target_specials:
                j += 1
            text = decode_after(self.target_tokenizer, ids[:j], i)
            anchor = self.draft_tokenizer.decode(out[-ANCHOR:], skip_special_tokens=True)
            out += encode_after(self.draft_tokenizer, anchor, text)
            i = j
        return out

    def draft_context(self, context: Sequence[int]) -> list[int]:
        """The committed target tokens ``context`` as draft tokens: what has settled once, the tail each time."""
        frozen = self._frozen
        if frozen is None or len(context) <= len(frozen) or list(context[: len(frozen)]) != frozen:
            frozen = self._frozen = list(context[:-1])  # a new request: its prompt
            self._frozen_draft = self.translate(frozen, 0, [])
            if self.draft_start and self._frozen_draft[: len(self.draft_start)] != self.draft_start:
                self._frozen_draft = self.draft_start + self._frozen_draft
        settled = len(context) - TAIL
        if settled - len(frozen) >= TAIL:  # a chunk of the answer will not be translated again
            self._frozen_draft = self.translate(context[:settled], len(frozen), self._frozen_draft)
            frozen = self._frozen = list(context[:settled])
        return self.translate(context, len(frozen), self._frozen_draft)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        ids = self.draft_context(context)
        if not ids:
            return EMPTY_DRAFT
        if self._cache is None:
            self._cache = self.draft.new_kv()
        keep = reusable_prefix(self._cached, ids)
        self._cache.truncate(keep)
        del self._cached[keep:]
        feed = ids[keep:]
        drafted: list[int] = []
        special = None
        for _ in range(k + 1):  # one more than k: the last target token of the text is dropped
            logits = self.draft.forward(self._cache, feed, last_only=True).logits[-1]
            self._cached.extend(feed)
            self.draft_steps += 1
            token = greedy_tokens(logits[None])[0]
            if token in self.draft_specials:  # the draft ends here (with the target's counterpart, if it has one)
                special = token
                break
            drafted.append(token)
            feed = [token]
        text = decode_after(self.draft_tokenizer, ids + drafted, len(ids))
        anchor = self.target_tokenizer.decode(list(context[-ANCHOR:]), skip_special_tokens=True)
        tokens = encode_after(self.target_tokenizer, anchor, text) if text else []
        if special is None:
            tokens = tokens[:-1]  # the text may stop inside a word
        elif special in self.to_target:
            tokens.append(self.to_target[special])
        tokens = tokens[:k]
        valid = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size), len(tokens))
        tokens = tokens[:valid]
        self.proposed += len(tokens)
        return Draft(tokens) if tokens else EMPTY_DRAFT
