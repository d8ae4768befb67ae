"""Medusa drafter: K trained heads read the target's final hidden state at the last verified position and each guess
one more token ahead (see ``verispec.medusa.head``). No draft loop: one small matrix product per head per step.

The engine keeps the target's final hidden states from the passes it runs anyway. The state at position m - 1 (the
one that chose the pending token t_m) is what head i reads to guess t_{m+1+i}.

A chain takes each head's most likely token (greedy) or draws it from the head's q_i (processed like the target's:
temperature, top-k, top-p), which is returned for strict rejection sampling; q_i depends on the committed context
only, which keeps the rule exact. With ``tree=True`` it proposes Medusa's tree instead: the candidates are the
``width`` most likely tokens of each head, and the k nodes kept are the paths with the largest product of head
probabilities (a dynamic version of Medusa's fixed sparse tree). Nodes are chosen deterministically, so the engine
verifies them as one-hot candidates at any temperature (``verify.verify_tree``).
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Sequence

import torch

from ..backends.base import TargetModel, provides_features
from ..errors import InvalidRequest, check_whole
from ..medusa.head import MedusaHeads
from ..medusa.weights import resolve_heads
from ..sampling import SamplingParams, greedy_tokens, probabilities, sample
from .base import EMPTY_DRAFT, Draft, DrafterBase
from .precision import HEAD_DTYPES, head_dtype
from .registry import DrafterSpec, Option, register
from .vocabulary import ContextVocabulary


class MedusaDrafter(DrafterBase):
    name = "medusa"

    def __init__(self, target: TargetModel, heads: MedusaHeads | str | Path | None = None, *, tree: bool = False,
                 width: int = 4, context_vocab: bool = True, precision: str = "auto"):
        check_whole("medusa tree width", width)
        resolved = head_dtype(precision, target)  # ``verispec.drafters.precision``
        if not isinstance(heads, MedusaHeads):
            heads = MedusaHeads.load(resolve_heads(target.name, heads), dtype=resolved)
        elif precision != "auto" and heads.heads[0][0].linear.weight.dtype != resolved:
            heads = heads.to(resolved)  # in place: a caller's heads given with an explicit precision
        if not provides_features(target, (heads.config.final_layer,)):
            raise InvalidRequest(f"the medusa drafter reads the target's final hidden state, which this "
                                 f"{target.backend} target does not return; use --backend transformers or llamacpp")
        self.heads = heads.to(target.device).attach(target.embedding_model)
        self.feature_layers = (heads.config.final_layer,)
        self.tree, self.width = bool(tree), width
        # the heads read the last position's state only: on llama.cpp, where a row's state costs its logits, the
        # rest of a prompt is prefilled without them
        self.prompt_feature_rows = 1 if target.hidden_states_cost_logits else None
        self.context_vocab = context_vocab
        self.vocab = ContextVocabulary(self.heads.d2t, target.embedding_model.get_output_embeddings().weight.detach(),
                                       target.vocab_size, self.heads.lm_head_d.dtype)
        self.reset(SamplingParams(), None)

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        self.sampling = sampling
        self.generator = generator
        self.vocab.reset()

    @property
    def tree_depth(self) -> int | None:
        """The tree's depth (one level per head) in tree mode, else None."""
        return self.heads.num_heads if self.tree else None

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, features: torch.Tensor | None = None) -> Draft:
        if features is None:
            raise InvalidRequest("the medusa drafter reads the target's hidden states; run it through "
                                 "SpeculativeDecoder, which passes them")
        m = len(context) - 1  # position of the pending token; the last feature row is position m-1's
        if m < 1 or not features.shape[0] or k < 1:
            return EMPTY_DRAFT
        if self.context_vocab:
            self.vocab.grow(context)
        count = self.heads.num_heads if self.tree else min(k, self.heads.num_heads)
        logits = self.heads.logits(self.heads.states(features[-1, 0], count), self.vocab.extra)  # [count, D]
        if self.tree:
            return self._tree(logits, k)
        probs = torch.softmax(logits.float(), dim=-1)
        # the head's largest probability: a property of its distribution, not of the token drawn from it
        confidence = probs.max(dim=-1).values.tolist()
        if self.sampling.greedy:
            tokens = [self.vocab.ids[i] for i in greedy_tokens(logits)]
            return Draft(tokens, None, confidence=confidence)
        q = torch.stack([probabilities(self.vocab.full(row), self.sampling) for row in logits])
        tokens = [sample(row, self.generator) for row in q]
        return Draft(tokens, q, confidence=confidence)

    def _tree(self, logits: torch.Tensor, budget: int) -> Draft:
        """The ``budget`` most likely paths through the heads' top-``width`` candidates (best first)."""
        top = torch.log_softmax(logits.float(), dim=-1).topk(min(self.width, logits.shape[-1]), dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
        depth_of = len(values)
        tokens: list[int] = []
        parents: list[int] = []
        # (-log-prob of the path, tie-break, depth, candidate rank, parent node)
        heap = [(-values[0][r], r, 0, r, -1) for r in range(len(values[0]))]
        heapq.heapify(heap)
        order = len(heap)
        while heap and len(tokens) < budget:
            score, _, depth, rank, parent = heapq.heappop(heap)
            tokens.append(self.vocab.ids[indices[depth][rank]])
            parents.append(parent)
            node = len(tokens) - 1
            if depth + 1 < depth_of:  # a path's log-prob only falls with depth, so parents always come first
                for r, v in enumerate(values[depth + 1]):
                    heapq.heappush(heap, (score - v, order, depth + 1, r, node))
                    order += 1
        return Draft(tokens, None, parents)

    # observe(): nothing to learn; heads read the next verified state afresh


register(DrafterSpec(
    "medusa", "trained heads on the target's last hidden state guess several tokens ahead at once (Medusa-1); "
              "one set ships for smollm2-135m",
    lambda target, draft_model, **options: MedusaDrafter(target, **options),
    options=(Option("heads", str, None, "heads for --drafter medusa, as written by `verispec train-medusa` (default: "
                    "the set shipped for the built-in target)"),
             Option("tree", bool, False, "with --drafter medusa, verify a tree of --k candidates built from each "
                    "head's top tokens instead of a chain (lossless at any temperature)"),
             Option("width", int, 4, "candidates per head in the medusa tree (default: 4)"),
             Option("precision", str, "auto", "dtype of the medusa heads: auto (bfloat16 on a CPU with native bfloat16 "
                    "dot products under a float32 target, else the target's dtype), float32 or bfloat16; drafts "
                    "only, the output is the target's either way", choices=HEAD_DTYPES)),
    hidden_states=True,
    inner_layers=lambda target, options: False,  # the final normed state only: no llama.cpp callback
    trees=lambda options: bool(options.get("tree")), tree_option="tree",
    reference_option="heads",
    share=lambda drafter: {"heads": drafter.heads},
))
