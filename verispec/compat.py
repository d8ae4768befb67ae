"""Can a draft model's tokens be verified by the target? Same token->id map, same special tokens."""

from __future__ import annotations

from .errors import IncompatibleDrafter


def check_compatible(target_tokenizer, draft_tokenizer, *, check_chat_template: bool = True) -> None:
    """Raise IncompatibleDrafter naming the first difference. Vocabularies may differ in length (padded
    embeddings, extra added tokens) as long as the shared id range maps to the same tokens."""
    t_vocab = target_tokenizer.get_vocab()
    d_vocab = draft_tokenizer.get_vocab()
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    d_by_id = {i: tok for tok, i in d_vocab.items()}
    shared = min(len(t_by_id), len(d_by_id))
    for i in range(shared):
        if t_by_id.get(i) != d_by_id.get(i):
            raise IncompatibleDrafter(
                f"draft and target tokenizers differ at id {i}: target has {t_by_id.get(i)!r}, draft has "
                f"{d_by_id.get(i)!r}. A draft model must share the target's tokenizer (same family); use the "
                "ngram drafter or a draft model trained with the target's tokenizer"
            )
    for attr in ("eos_token_id", "bos_token_id"):
        t, d = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if t is not None and d is not None and t != d:
            raise IncompatibleDrafter(f"draft and target disagree on {attr}: target {t}, draft {d}")
    if check_chat_template:
        t = getattr(target_tokenizer, "chat_template", None)
        d = getattr(draft_tokenizer, "chat_template", None)
        if t and d and t != d:
            raise IncompatibleDrafter(
                "draft and target have different chat templates, so the draft would see a differently "
                "formatted prompt; pass check_chat_template=False if that is intended"
            )
