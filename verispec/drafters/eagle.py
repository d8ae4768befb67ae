"""EAGLE drafter: a trained head drafts from the target's own hidden states (see ``verispec.eagle.head``).

Per proposal the head first reads the pairs (f_i, t_{i+1}) the target has verified since the last proposal, in
one forward of width (accepted + 1), then drafts k tokens one at a time, feeding its own output g back as the
feature. Its KV cache then drops the drafted positions, so it only ever keeps pairs built from true target
features. Greedy drafts are deterministic (q is one-hot); when sampling, each draft token is drawn from q (the
head's distribution over its draft vocabulary, processed like the target's: temperature, top-k, top-p) and q is
returned for strict rejection sampling.

With ``context_vocab=True`` (the default) the draft vocabulary of a request also holds every token of its context:
tokens the answer copies from the prompt are often rare ones the fixed draft vocabulary lacks. Their logits come
from the same frozen target lm_head applied to g.

With ``lookup=True`` (tree mode only) a prompt-lookup branch joins the tree: the n-gram drafter's continuation
of the context's suffix, merged into the head's tree where they share a prefix. The drafter is then named
``eagle+lookup`` in stats and benchmarks.

With ``suffix=True`` (chain mode only) a step whose context's suffix has a continuation in the suffix store
(``verispec.drafters.suffix``: this request's text and, scope ``process``, earlier requests') drafts that
continuation and skips the head; the head drafts where the store has nothing, catching up on the skipped pairs in
its next read. Copies of the prompt (translation, summarization, code edits) are where the head is weakest and a
store's drafts are long and free. Greedy decoding only: when sampling, a copied token is accepted with the target's
probability of it, the head's sampled drafts with sum(min(p, q)), and the head alone measured better there
(docs/suffix.md), so every step asks the head. The drafter is then
named ``eagle+suffix``.

With ``tree=True`` it proposes a tree instead (EAGLE-2's dynamic tree): each round expands the ``width`` most
likely frontier nodes (by the head's cumulative log-probability) by their ``width`` best children, for ``depth``
rounds, and returns the k most likely nodes; the engine verifies all of them in one pass. The nodes are chosen
deterministically (no sampling), so at any temperature the engine verifies them as one-hot candidates: try each
child with probability equal to the target's residual mass on it (``verify.verify_tree``), which keeps the target's
distribution exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..eagle.engines import ENGINES, choose_engine
from ..eagle.head import CONFIG, EagleHead, HeadCache, HeadConfig
from ..eagle.weights import resolve_head
from ..errors import InvalidRequest, ModelNotFound, check_whole
from ..prefix import common_prefix_length
from ..backends.base import TargetModel, provides_features
from ..sampling import SamplingParams, greedy_tokens, probabilities, sample
from .base import EMPTY_DRAFT, Draft, DrafterBase
from .ngram import NgramDrafter
from .precision import HEAD_DTYPES, head_dtype
from .suffix import SuffixDrafter
from .registry import DrafterSpec, Option, register
from .vocabulary import ContextVocabulary

log = logging.getLogger(__name__)


class EagleDrafter(DrafterBase):
    name = "eagle"

    def __init__(self, target: TargetModel, head: EagleHead | str | Path | None = None, *, tree: bool = False,
                 depth: int = 4, width: int = 4, context_vocab: bool = True, lookup: bool = False,
                 engine: str = "auto", suffix: bool = False, precision: str = "auto",
                 prompt_rows: int | str | None = "auto"):
        check_whole("eagle tree depth", depth)
        check_whole("eagle tree width", width)
        self.tree, self.depth, self.width = bool(tree), depth, width
        self.stops_early = not self.tree  # a chain pays a head step a token: it stops where draft_more says
        if lookup and not tree:
            raise InvalidRequest("the eagle drafter's lookup branch needs tree mode (tree=True / --eagle-tree)")
        if suffix and tree:
            raise InvalidRequest("the eagle drafter's suffix drafts are for chains; a tree takes a prompt-lookup "
                                 "branch instead (lookup=True / --eagle-lookup)")
        # in a tree the extra nodes ride on a pass that is wide anyway, so the lookup branch always proposes
        self._lookup = NgramDrafter() if lookup else None
        self._suffix = SuffixDrafter() if suffix else None
        self.name = "eagle+lookup" if lookup else "eagle+suffix" if suffix else "eagle"
        # what runs the head's chain steps (``verispec.eagle.engines``): the torch head, its compiled program or its
        # graph on OpenVINO
        self._engine = choose_engine(engine, precision, target, lambda: head_dtype(precision, target))
        resolved = self._engine.dtype
        if not isinstance(head, EagleHead):
            folder = resolve_head(target.name, head, prefer_final=target.final_feature_layer is not None)
            if (folder / CONFIG).is_file():  # before the weights load (a folder without one: load says so)
                _check_features(target, HeadConfig.load(folder).feature_layers)
            head = EagleHead.load(folder, dtype=resolved)
        else:
            _check_features(target, head.config.feature_layers)
            if precision != "auto" and head.fc.weight.dtype != resolved:
                head = head.to(resolved)  # in place: a caller's head given with an explicit precision
        self.head = head.to(target.device).attach(target.embedding_model)
        self.feature_layers = tuple(head.config.feature_layers)
        self.context_vocab = context_vocab
        self.vocab = ContextVocabulary(self.head.d2t, target.embedding_model.get_output_embeddings().weight.detach(),
                                       target.vocab_size, self.head.lm_head_d.dtype)
        self.steps = self._engine.steps(self.head, target)
        self.engine = self._engine.name
        self._target = target
        self.prompt_feature_rows = prompt_feature_rows(prompt_rows, target)
        self._cache = HeadCache()
        self._tokens: list[int] = []  # the cache holds the pairs of positions origin..origin+len(cache)-1 of these
        self._origin = 0  # the position of the cache's first pair (after a prompt read from its last rows only)
        self.reset(SamplingParams(), None)

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        self.sampling = sampling
        self.generator = generator
        upgraded = self._engine.upgrade(self.head, self._target)
        if upgraded is not None:
            self.steps, self.engine = upgraded, self._engine.name
        self.vocab.reset()  # the draft vocabulary grows by the request's context tokens
        self._lookup_draft: tuple[int, list[int]] | None = None  # (pending position, tokens) of the last branch
        if self._lookup is not None:
            self._lookup.reset(sampling, generator)
        if self._suffix is not None:
            self._suffix.reset(sampling, generator)
        # the KV cache is kept: the next propose() keeps the pairs still valid for the new context

    def isolate(self) -> None:
        """With suffix drafts: draft from this drafter's own earlier text only (``SuffixDrafter.isolate``)."""
        if self._suffix is not None:
            self._suffix.isolate()

    def join_siblings(self, group: dict | None) -> None:
        if self._suffix is not None:
            self._suffix.join_siblings(group)

    @property
    def tree_depth(self) -> int | None:
        """The tree's depth when this drafter drafts trees (tree mode), else None."""
        return self.depth if self.tree else None

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, features: torch.Tensor | None = None,
                enough: Callable[[list[float]], bool] | None = None) -> Draft:
        """A chain of up to ``k`` tokens (``enough``, if given, asked after each with the confidences so far, ends it
        where it says), or a tree of ``k`` nodes."""
        if features is None:
            raise InvalidRequest("the eagle drafter reads the target's hidden states; run it through "
                                 "SpeculativeDecoder, which passes them")
        m = len(context) - 1  # position of the pending token; features cover positions first..m-1
        if m < 1 or not features.shape[0]:
            return EMPTY_DRAFT
        first = m - features.shape[0]
        if self._suffix is not None and self.sampling.greedy:
            copied = self._suffix.propose(context, k)
            if len(copied):
                return copied  # the head catches up on this step's pairs in its next read
        # pair i needs t_{i+1}: a cached pair stays valid while tokens 0..i+1 are unchanged. The head reads on from
        # the first invalid pair, or starts again at the first position with features when those before it are gone
        # (its rotary positions count from its first pair: only their differences matter)
        keep = min(self._origin + len(self._cache), common_prefix_length(self._tokens, context) - 1, m - 1)
        if keep < max(first, self._origin):
            keep, self._origin = first, first
            self._cache.truncate(0)
        self._cache.truncate(keep - self._origin)
        head = self.head
        device = features.device
        if self.context_vocab:
            if self.vocab.scanned > len(context):  # a different sequence: start over
                self.reset(self.sampling, self.generator)
            self.vocab.grow(context)
        new_tokens = torch.tensor(context[keep + 1 : m + 1], device=device)
        g, logits = self.steps.step_logits(new_tokens, head.fuse_features(features[keep - first :]), self._cache,
                                           self.vocab.extra)
        g, logits = g[-1], logits[-1]  # [H], [draft vocabulary]
        if self.tree:
            branch = self._lookup_branch(context, m, k)
            draft = self._grow_tree(g, logits, m - self._origin, k - len(branch))
            if branch:
                draft = _merge_chain(draft, branch)
            self._cache.truncate(m - self._origin)
            self._tokens = list(context)
            return draft
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        confidence: list[float] = []
        for depth in range(k):
            # the head's largest probability: a property of the distribution, not of the token drawn from it
            confidence.append(float(torch.softmax(logits.float(), dim=-1).max()))
            if self.sampling.greedy:
                token = self.vocab.ids[greedy_tokens(logits[None])[0]]
            else:
                q = probabilities(self.vocab.full(logits), self.sampling)
                token = sample(q, self.generator)
                probs.append(q)
            tokens.append(token)
            if depth + 1 < k and enough is not None and enough(confidence):
                break
            if depth + 1 < k:
                g, logits = self.steps.step_logits(torch.tensor([token], device=device), g[None], self._cache,
                                                   self.vocab.extra)
                g, logits = g[-1], logits[-1]
        self._cache.truncate(m - self._origin)  # drop the drafted pairs: they were built from the head's own features
        self._tokens = list(context)
        return Draft(tokens, torch.stack(probs) if probs else None, confidence=confidence)

    def _lookup_branch(self, context: Sequence[int], m: int, k: int) -> list[int]:
        if self._lookup is None or k < 2:
            return []
        if self._lookup_draft is not None:  # how much of the last branch the target took
            at, tokens = self._lookup_draft
            self._lookup.observe(common_prefix_length(tokens, context[at + 1 :]))
        tokens = self._lookup.propose(context, max(0, min(k - 1, k // 2))).tokens
        self._lookup_draft = (m, tokens) if tokens else None
        return tokens

    def _grow_tree(self, g0: torch.Tensor, logits0: torch.Tensor, m: int, budget: int) -> Draft:
        """``m``: the pending token's position counted from the head cache's first pair."""
        head, cache, width = self.head, self._cache, self.width
        device = g0.device
        d2t = self.vocab.ids
        # node: [token, parent node (-1 = pending), depth, cumulative log-prob, head cache index, g]
        nodes: list[list] = []
        top = torch.log_softmax(logits0.float(), dim=-1).topk(width)
        for value, index in zip(top.values.tolist(), top.indices.tolist()):
            nodes.append([d2t[index], -1, 1, value, None, None])
        frontier = list(range(len(nodes)))
        for depth in range(2, min(self.depth, budget) + 1):
            expand = sorted(frontier, key=lambda i: -nodes[i][3])[:width]
            start = len(cache)
            visible = torch.zeros(len(expand), start + len(expand), dtype=torch.bool, device=device)
            visible[:, :m] = True  # the pairs built from true target features
            for row, i in enumerate(expand):
                visible[row, start + row] = True
                parent = nodes[i][1]
                while parent >= 0:
                    visible[row, nodes[parent][4]] = True
                    parent = nodes[parent][1]
                nodes[i][4] = start + row
            feats = torch.stack([g0 if nodes[i][1] < 0 else nodes[nodes[i][1]][5] for i in expand])
            tokens = torch.tensor([nodes[i][0] for i in expand], device=device)
            positions = torch.full((len(expand),), m + depth - 2, device=device)  # the pair of a depth-d node
            g = head.step(tokens, feats, cache, positions, visible)  # [w, H]
            top = torch.log_softmax(head.logits(g, self.vocab.extra).float(), dim=-1).topk(width, dim=-1)
            frontier = []
            for row, i in enumerate(expand):
                nodes[i][5] = g[row]
                for value, index in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    nodes.append([d2t[index], i, depth, nodes[i][3] + value, None, None])
                    frontier.append(len(nodes) - 1)
        # the budget's most likely nodes; a parent is never less likely than its child, so ties aside this is a
        # tree already, and requiring the parent first makes sure
        chosen: dict[int, int] = {}
        for i in sorted(range(len(nodes)), key=lambda i: (-nodes[i][3], nodes[i][2])):
            if len(chosen) == budget:
                break
            if nodes[i][1] < 0 or nodes[i][1] in chosen:
                chosen[i] = len(chosen)
        order = list(chosen)
        return Draft([nodes[i][0] for i in order], None,
                     [-1 if nodes[i][1] < 0 else chosen[nodes[i][1]] for i in order])

    # observe(): nothing to learn; the next propose() realigns the cache with the committed context


PROMPT_ROWS_LLAMACPP = 128  # see prompt_feature_rows


def prompt_feature_rows(setting: int | str | None, target: TargetModel) -> int | None:
    """How many of a prompt's last positions the head reads (None: all). ``auto``: all where hidden states come
    with the pass anyway (transformers, OpenVINO); ``PROMPT_ROWS_LLAMACPP`` on llama.cpp, whose passes return a
    row's hidden state only with the row's logits, so reading all of a prompt runs the lm_head over every row
    (a long prefill then costs a good deal more than plain; docs/llamacpp.md)."""
    if setting == "auto":
        return PROMPT_ROWS_LLAMACPP if target.hidden_states_cost_logits else None
    if setting is None or setting == "all":
        return None
    if isinstance(setting, str) and setting.isdigit():
        setting = int(setting)
    if not isinstance(setting, int) or isinstance(setting, bool) or setting < 1:
        raise InvalidRequest(f"eagle prompt rows must be a whole number of at least 1, 'all' or 'auto'; got "
                             f"{setting!r}")
    return setting


def _merge_chain(tree: Draft, chain: list[int]) -> Draft:
    """The tree with a chain of tokens from the pending token added, sharing the nodes it already has."""
    tokens, parents = list(tree.tokens), list(tree.parents or [])
    children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
    node = -1
    for token in chain:
        child = children.get((node, token))
        if child is None:
            tokens.append(token)
            parents.append(node)
            child = len(tokens) - 1
            children[(node, token)] = child
        node = child
    return Draft(tokens, None, parents)


def _reads_inner_layers(target_ref: str, head) -> bool:
    """Whether the head that ``--eagle-head`` names (or the one shipped for ``target_ref`` on llama.cpp) reads layers
    before the final normed state; True where that cannot be told before loading (the drafter then speaks)."""
    if isinstance(head, EagleHead):
        return head.config.reads_inner_layers()
    try:
        return HeadConfig.load(resolve_head(target_ref, head, prefer_final=True)).reads_inner_layers()
    except (ModelNotFound, OSError, ValueError, TypeError, IndexError):
        return True


def _check_features(target: TargetModel, layers) -> None:
    if provides_features(target, layers):
        return
    final = target.final_feature_layer
    if final is not None:  # llama.cpp loaded without its eval callback: the final normed state only
        raise InvalidRequest(f"this eagle head reads the target's hidden states at layers {list(layers)}, and this "
                             f"{target.backend} model was loaded without them (it returns layer {final} only); load it "
                             "with features=True (the CLI does for --drafter eagle with such a head), or use a head "
                             f"that reads layer {final} alone (`verispec train-eagle --layers {final}`)")
    raise InvalidRequest(f"the eagle drafter reads the target's hidden states, which the {target.backend} backend does "
                         "not return; use --backend transformers or llamacpp")


register(DrafterSpec(
    "eagle", "a trained head drafts from the target's own hidden states (EAGLE); one ships for smollm2-135m",
    lambda target, draft_model, **options: EagleDrafter(target, **options),
    options=(Option("head", str, None, "head for --drafter eagle: a folder written by `verispec train-eagle`, or "
                    "fused / final for the built-in target's shipped heads (four fused layers / the final state alone; "
                    "default: fused, and final on --backend llamacpp, where it needs no per-pass callback)"),
             Option("tree", bool, False, "with --drafter eagle, draft a tree of --k candidate tokens (EAGLE-2 style) "
                    "instead of a chain, verified losslessly at any temperature"),
             Option("lookup", bool, False, "with --eagle-tree, add a prompt-lookup (n-gram) branch to each tree "
                    "(drafter 'eagle+lookup')"),
             Option("suffix", bool, False, "with --drafter eagle (chains), greedy decoding: draft the suffix store's "
                    "continuation where it has one and the head elsewhere (drafter 'eagle+suffix')"),
             Option("depth", int, 4, "depth of the eagle tree (default: 4)"),
             Option("width", int, 4, "children per expanded node and nodes expanded per depth in the eagle tree "
                    "(default: 4)"),
             Option("engine", str, "auto", "what runs the eagle head's chain steps: auto (openvino on the openvino "
                    "backend; compiled where the target runs compiled and `verispec compile` stored the head's "
                    "program; torch elsewhere), torch, compiled (an AOTInductor program of a float32 head, compiled "
                    "once, ~1 min), openvino (an OpenVINO graph of the head with int8 weights, one thread) or "
                    "openvino-fp32", choices=ENGINES),
             Option("precision", str, "auto", "dtype of the torch eagle head: auto (bfloat16 on a CPU with native "
                    "bfloat16 dot products under a float32 target, else the target's dtype), float32 or bfloat16; "
                    "drafts only, the output is the target's either way", choices=HEAD_DTYPES),
             Option("prompt_rows", str, "auto", "how many of a prompt's last positions the eagle head reads: auto "
                    f"(all, but the last {PROMPT_ROWS_LLAMACPP} on --backend llamacpp, where a row's hidden state "
                    "costs its logits too), all, or a number", metavar="N")),
    hidden_states=True,
    inner_layers=lambda target, options: _reads_inner_layers(target, options.get("head")),
    trees=lambda options: bool(options.get("tree")), tree_option="tree",
    reference_option="head",
    share=lambda drafter: {"head": drafter.head},
))
