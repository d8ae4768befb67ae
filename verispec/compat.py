"""Can a draft model's tokens be verified by the target? Same token->id map, same special tokens. A different chat
template is no obstacle: the draft reads the target's token ids, never formats a prompt itself."""

from __future__ import annotations

import logging

from .errors import IncompatibleDrafter

log = logging.getLogger(__name__)


def different_vocabulary(target_tokenizer, draft_tokenizer) -> str | None:
    """The first difference between the two token->id maps over their shared id range (a sentence), None if the
    draft's token ids mean what the target's do. Vocabularies may differ in length (padded embeddings, extra added
    tokens)."""
    t_by_id = {i: tok for tok, i in target_tokenizer.get_vocab().items()}
    d_by_id = {i: tok for tok, i in draft_tokenizer.get_vocab().items()}
    for i in range(min(len(t_by_id), len(d_by_id))):
        if t_by_id.get(i) != d_by_id.get(i):
            return f"the tokenizers differ at id {i}: target has {t_by_id.get(i)!r}, draft has {d_by_id.get(i)!r}"
    return None


def check_compatible(target_tokenizer, draft_tokenizer, *, check_chat_template: bool = True) -> None:
    """Raise IncompatibleDrafter naming the first difference: the token->id map over the shared id range
    (``different_vocabulary``), the special tokens; a different chat template is logged (``check_chat_template``)."""
    difference = different_vocabulary(target_tokenizer, draft_tokenizer)
    if difference is not None:
        raise IncompatibleDrafter(
            f"{difference}. ModelDrafter needs the target's tokenizer; a draft model with another tokenizer drafts "
            "through text (make_drafter('model', ...) or --drafter model, which choose RetokenizingDrafter for it)"
        )
    for attr in ("eos_token_id", "bos_token_id"):
        t, d = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if t is not None and d is not None and t != d:
            raise IncompatibleDrafter(f"draft and target disagree on {attr}: target {t}, draft {d}")
    if check_chat_template:
        t = getattr(target_tokenizer, "chat_template", None)
        d = getattr(draft_tokenizer, "chat_template", None)
        if t and d and t != d:
            # a note, not a refusal: the draft reads the target's token ids (the prompt as the target's template
            # formats it), never its own template, so drafts stay verifiable; only acceptance may differ
            log.info("draft and target have different chat templates; the draft reads the prompt as the target's "
                     "template formats it")
