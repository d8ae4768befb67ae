"""arctic-inference's SuffixDecoding as a bench peer: its suffix trees draft, verispec's engine verifies.

SuffixDecoding ships in ``arctic-inference`` (Snowflake; vLLM's ``suffix`` method runs the same cache), whose
server side needs vLLM on a GPU. Its drafting half, ``arctic_inference.suffix_decoding.SuffixDecodingCache`` (a C++
suffix tree per request's prompt and one over earlier responses), runs anywhere it builds; here it drafts for
verispec's engine on the same target, so the comparison with verispec's ``suffix`` drafter is drafts against
drafts: the same passes, acceptance rule and controller. Options follow vLLM's defaults for the method
(``--suffix-decoding-max-tree-depth 24``, ``max-spec-factor 1.0``, ``min-token-prob 0.1``, 10,000 cached responses).

    arctic:suffix  arctic:suffix:tree=1:k=16  arctic:suffix:min_prob=0.2:factor=2
"""

from __future__ import annotations

import itertools
from typing import Sequence

from ..drafters.base import EMPTY_DRAFT, Draft, DrafterBase
from ..errors import InvalidRequest

INSTALL = ("arctic-inference is not installed. It builds from source (C++, nanobind) against the torch already "
           "installed: pip install setuptools wheel ninja cmake nanobind==2.9.2 protobuf==5.29.6 grpcio-tools; then "
           "CMAKE_PREFIX_PATH=$(python -m nanobind --cmake_dir) pip install --no-build-isolation --no-deps "
           "arctic-inference==0.3.0 (with build isolation pip would fetch another torch, and cmake may not find "
           "nanobind)")


class ArcticSuffixDrafter(DrafterBase):
    """Drafts from an ``arctic_inference`` ``SuffixDecodingCache``: the current request's prompt and response, and
    the responses of earlier requests of this drafter."""

    name = "arctic-suffix"

    def __init__(self, tree: bool = False, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1,
                 cached: int = 10_000) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise InvalidRequest(f"{INSTALL} ({exc})") from None
        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached)
        self.tree, self.factor, self.min_prob = bool(tree), factor, min_prob
        self.tree_depth = depth if self.tree else None
        self._ids = itertools.count()
        self._request: int | None = None
        self._seen = 0  # tokens of the current request given to the cache

    def reset(self, sampling=None, generator=None) -> None:
        if self._request is not None:
            self.cache.stop_request(self._request)  # its response stays cached for later requests
        self._request, self._seen = None, 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        context = list(context)
        if self._request is None:
            self._request = next(self._ids)
            self.cache.start_request(self._request, context)  # the prompt (its last token still pending)
        elif len(context) > self._seen:
            self.cache.add_active_response(self._request, context[self._seen:])
        self._seen = len(context)
        draft = self.cache.speculate(self._request, context, max_spec_tokens=k, max_spec_factor=self.factor,
                                     min_token_prob=self.min_prob, use_tree_spec=self.tree)
        if not draft.token_ids:
            return EMPTY_DRAFT
        if self.tree:
            return Draft(list(draft.token_ids), None, list(draft.parents))
        return Draft(list(draft.token_ids), confidence=[min(1.0, float(p)) for p in draft.probs])


OPTIONS = {"tree": int, "depth": int, "factor": float, "min_prob": float, "cached": int}


def arctic_drafter(spec: str, kind: str, opts: dict[str, str]) -> ArcticSuffixDrafter:
    if kind != "suffix":
        raise InvalidRequest(f"{spec!r}: arctic-inference peers: arctic:suffix (options tree=0|1, depth=, factor=, "
                             "min_prob=, cached=, k=, policy=)")
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise InvalidRequest(f"{spec!r}: unknown option(s) {', '.join(sorted(unknown))}; arctic:suffix takes "
                             f"{', '.join(OPTIONS)}, k= and policy=")
    try:
        values = {key: OPTIONS[key](value) for key, value in opts.items()}
    except ValueError:
        raise InvalidRequest(f"{spec!r}: arctic:suffix options are numbers ({', '.join(OPTIONS)})") from None
    return ArcticSuffixDrafter(**values)
