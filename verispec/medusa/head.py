"""Medusa-1 heads (Cai et al. 2024): K small heads on the target's final hidden state, frozen target.

Notation: t_j is the token at position j and h_j the target's final (normed) hidden state there; the target's own
lm_head turns h_j into p(t_{j+1}). Head i (i = 0..K-1) guesses the token i + 1 places further:

    r_i(h) = h + SiLU(W_i h + b_i)                      one residual block per head (``layers`` of them)
    q_i(t_{j+i+2}) = softmax(lm_head_d(r_i(h_j)))         over the draft vocabulary

The lm_head is the target's, frozen and restricted to a reduced draft vocabulary (``d2t``: draft id -> target id),
as the EAGLE head does: it is never stored, so a trained set is the K residual blocks and d2t (a few MB). W_i starts
at zero, so an untrained head i repeats the target's own next-token guess.

Heads do not see the tokens drafted before them: q_i depends on the committed context only. That is what makes
Medusa cheap (one matrix product per head, no draft loop) and what limits its acceptance at depth.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..backends.torch_cpu.packing import PackedLinear, pack_linear_layers, should_pack
from ..errors import IncompatibleDrafter, ModelNotFound
from ..eagle.head import target_fingerprint

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
KIND = "medusa"


@dataclass
class MedusaConfig:
    target: str  # the model reference the heads were trained for (informational)
    target_fingerprint: str  # checked on load (see ``verispec.eagle.head.target_fingerprint``)
    hidden_size: int
    num_heads: int
    draft_vocab_size: int
    final_layer: int  # index of the final normed state in the target's ``hidden_states`` (= its layer count)
    layers: int = 1  # residual blocks per head
    kind: str = KIND
    training: dict = field(default_factory=dict)  # how they were trained, for the record

    def save(self, folder: Path) -> None:
        (folder / CONFIG).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "MedusaConfig":
        raw = json.loads((folder / CONFIG).read_text())
        if raw.get("kind") != KIND:
            raise ModelNotFound(f"{folder} holds no Medusa heads (its config.json is not of kind {KIND!r}; an EAGLE "
                                "head goes to --drafter eagle); train heads with `verispec train-medusa`")
        return cls(**raw)


def config_for(target_model, name: str, num_heads: int, draft_vocab_size: int, layers: int = 1) -> MedusaConfig:
    return MedusaConfig(target=name, target_fingerprint=target_fingerprint(target_model),
                        hidden_size=target_model.config.hidden_size, num_heads=num_heads,
                        draft_vocab_size=draft_vocab_size, final_layer=target_model.config.num_hidden_layers,
                        layers=layers)


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # identity at the start: the head repeats the target's guess
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(h) for _ in range(config.layers)])
                                   for _ in range(config.num_heads))
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)  # draft id -> target id
        self.lm_head_d: torch.Tensor | None = None  # [draft_vocab, H], the target's rows, never saved
        # the same rows packed for oneDNN when drafting on a CPU that runs it: a few rows against a wide weight are
        # where MKL does poorly (docs/kernels.md)
        self._lm_head_packed = None

    def attach(self, target_model) -> "MedusaHeads":
        """Borrow the draft-vocabulary rows of the target's frozen lm_head (refused for another target)."""
        fp = target_fingerprint(target_model)
        if fp != self.config.target_fingerprint:
            raise IncompatibleDrafter(
                f"these Medusa heads were trained for {self.config.target!r} (fingerprint "
                f"{self.config.target_fingerprint}), but the target has fingerprint {fp}. Heads only draft for the "
                "target they were trained on: train them for this target with `verispec train-medusa --target REF`")
        weight = target_model.get_output_embeddings().weight
        self.lm_head_d = weight.detach()[self.d2t.to(weight.device)].to(self.heads[0][0].linear.weight.dtype)
        self._lm_head_packed = None
        if not self.training and should_pack(self.lm_head_d):  # drafting on a CPU: oneDNN's prepacked weights
            pack_linear_layers(self)
            object.__setattr__(self, "_lm_head_packed", PackedLinear(self.lm_head_d))  # not a submodule: never saved
        return self

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def states(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """[..., H] final hidden states -> [..., K, H]: each head's transformed state (the first ``count`` heads)."""
        hidden = hidden.to(self.heads[0][0].linear.weight.dtype)
        return torch.stack([head(hidden) for head in self.heads[: count or self.num_heads]], dim=-2)

    def logits(self, states: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] from head states [..., H]; with ``extra`` (rows of the
        target's lm_head [E, H]) the logits of those tokens too, appended: [..., draft_vocab + E]."""
        states = states.to(self.lm_head_d.dtype)
        out = states @ self.lm_head_d.T if self._lm_head_packed is None else self._lm_head_packed(states)
        if extra is not None and extra.shape[0]:
            out = torch.cat([out, states @ extra.to(states.dtype).T], dim=-1)
        return out

    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().to(torch.bfloat16) if v.is_floating_point() else v.detach().cpu()
                 for k, v in self.state_dict().items()}
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS))
        self.config.save(folder)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / CONFIG).exists() or not (folder / WEIGHTS).exists():
            raise ModelNotFound(f"{folder} holds no Medusa heads (needs {CONFIG} and {WEIGHTS}); train them with "
                                "`verispec train-medusa` and pass the folder it wrote")
        heads = cls(MedusaConfig.load(folder))
        state = load_file(str(folder / WEIGHTS))
        heads.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
        return heads.to(dtype).eval()
