"""The EAGLE draft head: one decoder layer that drafts from the target's own hidden states.

Notation (EAGLE-1/3): t_i is the token at position i and h_i the target's hidden state there (h_i predicts
t_{i+1}). The head's input at position i is the pair (f_i, t_{i+1}):

    x_i = fc([norm(embed(t_{i+1})); norm(f_i)])        f_i = fuse([norm_l(h_i at layer l) for each feature layer])
    g_i = decoder_layer(x_≤i)                          the head's own estimate of the next hidden state
    q(t_{i+2}) = softmax(lm_head_d(norm(g_i)))          over the draft vocabulary

When drafting past the last verified position the true features are unknown, so the head feeds its own
output back: the pair at position i+1 is (g_i, drafted t_{i+2}). Training unrolls exactly that ("training-time
test", EAGLE-3) with the attention pattern the drafter sees.

The embedding and lm_head are the target's own, frozen, and never stored in the checkpoint; the lm_head is
restricted to a reduced draft vocabulary (``d2t``: draft id -> target id), which makes each draft step cheap.
The checkpoint (safetensors + config.json) names the target it was trained for; loading it for another target
is an error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import IncompatibleDrafter, ModelNotFound
from ..backends.torch_cpu.packing import PackedLinear, pack_linear_layers, should_pack

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


@dataclass
class HeadConfig:
    target: str  # the model reference the head was trained for (informational)
    target_fingerprint: str  # what is checked on load: shapes + a hash of the target's lm_head/embedding
    hidden_size: int
    feature_layers: list[int]  # indices into the target's ``hidden_states`` (0 = embeddings)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    training: dict = field(default_factory=dict)  # how it was trained (data, steps, validation), for the record

    def save(self, folder: Path) -> None:
        (folder / CONFIG).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "HeadConfig":
        return cls(**json.loads((folder / CONFIG).read_text()))

    @property
    def target_layers(self) -> int:
        """The target's decoder layers (from its fingerprint): ``hidden_states[target_layers]`` is its final normed
        state."""
        return int(self.target_fingerprint.split("-L", 1)[1].split("-", 1)[0])

    def reads_inner_layers(self) -> bool:
        """Whether the head reads hidden states before the final normed state (on llama.cpp those need the eval
        callback; the final one is llama.cpp's embeddings output)."""
        return any(i != self.target_layers for i in self.feature_layers)


def target_fingerprint(model) -> str:
    """Shapes of the target plus a hash of a slice of its output and input embeddings: equal for the same weights
    in any dtype (rounded through bfloat16), different for another model."""
    cfg = model.config
    out_w = model.get_output_embeddings().weight
    in_w = model.get_input_embeddings().weight
    digest = hashlib.sha256()
    for w in (out_w, in_w):
        digest.update(w[:64, :64].detach().cpu().to(torch.bfloat16).float().mul(64).round().to(torch.int32).numpy().tobytes())
    shape = f"{cfg.model_type}-L{cfg.num_hidden_layers}-H{cfg.hidden_size}-V{out_w.shape[0]}"
    return f"{shape}-{digest.hexdigest()[:16]}"


def head_config_for(target_model, name: str, feature_layers: list[int], draft_vocab_size: int,
                    intermediate_size: int | None = None) -> HeadConfig:
    cfg = target_model.config
    heads = cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    return HeadConfig(
        target=name, target_fingerprint=target_fingerprint(target_model), hidden_size=cfg.hidden_size,
        feature_layers=list(feature_layers), num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=intermediate_size or cfg.intermediate_size, draft_vocab_size=draft_vocab_size,
        rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class HeadCache:
    """The head's own keys and values for one sequence ([1, kv_heads, T, head_dim]); rolled back by slicing."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def truncate(self, length: int) -> None:
        if length < len(self):
            self.k = self.k[:, :, :length]
            self.v = self.v[:, :, :length]


class EagleHead(nn.Module):
    """Trainable part of the drafter. ``embed`` and ``lm_head_d`` (the target's, frozen, restricted to the draft
    vocabulary) are attached with :meth:`attach` and are not parameters of the head."""

    compiled_steps = None  # its program compiled ahead of time, once loaded (``verispec.eagle.engines``)

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = c = config
        h, n_feat = c.hidden_size, len(c.feature_layers)
        # per-layer RMSNorm first: intermediate layers carry a few massive dimensions (|x| in the hundreds) that
        # would otherwise swamp the fusion; train_head starts them from the target's own input norms
        self.feature_layer_norms = nn.ModuleList(nn.RMSNorm(h, eps=c.rms_norm_eps) for _ in range(n_feat))
        self.fuse = nn.Linear(n_feat * h, h, bias=False)
        self.embed_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.feature_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attn_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.out_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.register_buffer("d2t", torch.arange(c.draft_vocab_size), persistent=True)  # draft id -> target id
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.embed: nn.Module | None = None
        self.lm_head_d: torch.Tensor | None = None  # [draft_vocab, H]
        self._lm_head_packed: PackedLinear | None = None

    # ------------------------------------------------------------------ target parts
    def attach(self, target_model) -> "EagleHead":
        """Borrow the target's frozen embedding and the draft-vocabulary rows of its lm_head."""
        fp = target_fingerprint(target_model)
        if fp != self.config.target_fingerprint:
            raise IncompatibleDrafter(
                f"this EAGLE head was trained for {self.config.target!r} (fingerprint "
                f"{self.config.target_fingerprint}), but the target has fingerprint {fp}. A head only drafts for the "
                "target it was trained on: train one for this target with `verispec train-eagle --target REF`"
            )
        # borrowed, not registered: the head's own .to(dtype) must never convert the target's embedding in place
        object.__setattr__(self, "embed", target_model.get_input_embeddings())
        weight = target_model.get_output_embeddings().weight
        self.lm_head_d = weight.detach()[self.d2t.to(weight.device)].to(self.fuse.weight.dtype)
        self._lm_head_packed = None
        if not self.training and should_pack(self.lm_head_d):  # inference in bfloat16 on CPU: prepacked weights
            pack_linear_layers(self)
            object.__setattr__(self, "_lm_head_packed", PackedLinear(self.lm_head_d))  # not a submodule: never saved
        return self

    # ------------------------------------------------------------------ pieces
    def fuse_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., L, H] target hidden states at the feature layers -> [..., H]."""
        hidden = hidden.to(self.fuse.weight.dtype)
        normed = [norm(hidden[..., i, :]) for i, norm in enumerate(self.feature_layer_norms)]
        return self.fuse(torch.cat(normed, dim=-1))

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Layer input for pairs (f_i, t_{i+1}): ``tokens`` [..., T] are the t_{i+1}, ``features`` [..., T, H]."""
        return self.pair_inputs(self.embed(tokens).to(self.fc.weight.dtype), features)

    def pair_inputs(self, emb: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``inputs`` from the tokens' embeddings ``emb`` [..., T, H] (the OpenVINO graph gets them as input)."""
        return self.fc(torch.cat([self.embed_norm(emb), self.feature_norm(features)], dim=-1))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [B, heads, T, d], positions [B, T] or [T]
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # [.., T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        if emb.dim() == 2:
            emb = emb[None]
        cos, sin = emb.cos()[:, None].to(x.dtype), emb.sin()[:, None].to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = self.q_proj(y).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """Attention (keys/values given) + MLP, residual stream in and out: returns g [B, T, H]."""
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        b, _, t, _ = att.shape
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, -1))
        y = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def logits(self, g: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] from head outputs [..., H]; with ``extra`` (rows of the
        target's lm_head [E, H]) also the logits of those tokens, appended: [..., draft_vocab + E]."""
        n = self.out_norm(g).to(self.lm_head_d.dtype)
        out = n @ self.lm_head_d.T if self._lm_head_packed is None else self._lm_head_packed(n)
        if extra is not None and extra.shape[0]:
            out = torch.cat([out, n @ extra.T], dim=-1)
        return out

    # ------------------------------------------------------------------ inference
    def step(self, tokens: torch.Tensor, features: torch.Tensor, cache: HeadCache,
             positions: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Feed T new pairs (one sequence: ``tokens`` [T], ``features`` [T, H]) after the ``len(cache)`` cached
        ones; returns g [T, H]. By default they sit at the next positions and see the cache and each other
        causally; a tree passes its own ``positions`` [T] and ``visible`` [T, len(cache) + T] (bool)."""
        start = len(cache)
        t = tokens.shape[0]
        x = self.inputs(tokens[None], features[None])
        if positions is None:
            positions = torch.arange(start, start + t, device=x.device)
        q, k, v = self.qkv(x, positions)
        k_all, v_all = cache.append(k, v)
        mask = visible
        if mask is None and t > 1:  # new positions see the whole cache and each other causally
            mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(diagonal=start)
        return self.finish(x, q, k_all, v_all, mask)[0]

    def step_logits(self, tokens: torch.Tensor, features: torch.Tensor, cache: HeadCache,
                    extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` for a chain (the new pairs at the next positions), then the logits of its last row: (g [T, H],
        logits [1, draft_vocab (+ E)]). ``verispec.eagle.openvino.HeadSteps`` runs the same on OpenVINO."""
        g = self.step(tokens, features, cache)
        return g, self.logits(g[-1:], extra)

    # ------------------------------------------------------------------ persistence
    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # the head's own weights only: an attached head also holds the target's embedding module
        state = {k: v.detach().cpu().to(torch.bfloat16) if v.is_floating_point() else v.detach().cpu()
                 for k, v in self.state_dict().items() if not k.startswith("embed.")}
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS))
        self.config.save(folder)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "EagleHead":
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / CONFIG).exists() or not (folder / WEIGHTS).exists():
            raise ModelNotFound(f"{folder} is not an EAGLE head (needs {CONFIG} and {WEIGHTS}); train one with "
                                "`verispec train-eagle` or pass the folder it wrote")
        head = cls(HeadConfig.load(folder))
        state = load_file(str(folder / WEIGHTS))
        head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
        return head.to(dtype).eval()


class StepGraph(nn.Module):
    """A head's draft step as a function of plain tensors, what the graph compilers take (``verispec.eagle.openvino``
    converts it to OpenVINO, ``verispec.eagle.compiled`` to an AOTInductor program): embeddings ``emb`` and features
    ``feat`` of T new pairs at ``positions`` after P cached ones (``past_k``, ``past_v`` [1, kv_heads, P, head_dim]),
    ``visible`` [T, P + T] (bool), ``last`` [1] -> (g [T, H], the T pairs' keys and values, out_norm(g) of row
    ``last`` [1, H], its draft-vocabulary logits [1, V_d]). ``head`` is an unpacked copy (``plain_copy``)."""

    def __init__(self, head: EagleHead) -> None:
        super().__init__()
        self.head = head
        self.lm_head = nn.Parameter(head.lm_head_d.detach().clone(), requires_grad=False)

    def forward(self, emb, feat, positions, past_k, past_v, visible, last):
        h = self.head
        x = h.pair_inputs(emb, feat)[None]
        q, k, v = h.qkv(x, positions)
        g = h.finish(x, q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2), visible[None, None])[0]
        n = h.out_norm(g.index_select(0, last))
        return g, k, v, n, n @ self.lm_head.T


def plain_copy(head: EagleHead, embedding_model) -> EagleHead:
    """A float32 copy of ``head`` attached to ``embedding_model`` with plain ``nn.Linear`` layers: oneDNN's packed
    linears neither trace nor export."""
    plain = EagleHead(head.config)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("embed.")}, strict=False)
    plain.train()  # attach() packs a head in eval mode
    plain.attach(embedding_model)
    return plain.eval()


def ttt_mask(length: int, step: int, device=None) -> torch.Tensor:
    """Which keys a query of unrolled step ``step`` at position i sees, over keys [step 0 | step 1 | ... | step s]
    (``length`` positions each): step-0 keys at positions <= i - s (true features), and the step-r key at
    position i - s + r for r = 1..s (the head's own earlier drafts). This is the drafter's view at draft depth s."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    blocks = [j <= i - step]
    for r in range(1, step + 1):
        blocks.append(j == i - step + r)
    return torch.cat(blocks, dim=1)  # [T, (s+1)T]
