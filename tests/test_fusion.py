"""Fused projections for the OpenVINO export (verispec.backends.openvino.fusion), on the tiny model in torch alone:
the fused model computes the same logits, the model's own modules come back afterwards, and a projection called on
another input than its group's first one is refused (the export then traces the model unfused)."""

import pytest
import torch
from torch import nn

from tiny import make_model
from verispec.backends.openvino.fusion import FusionError, fused_projections


def test_fused_projections_give_the_same_logits_and_are_undone():
    model = make_model(seed=3, layers=3)
    ids = torch.randint(3, 32, (2, 11), generator=torch.Generator().manual_seed(0))
    originals = {name: module for name, module in model.named_modules()}
    with torch.no_grad():
        want = model(ids).logits
        with fused_projections(model) as groups:
            assert groups == 2 * 3  # q/k/v and gate/up in each of the three layers
            assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4 * 3 + 1  # + the lm_head
            got = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert {name: module for name, module in model.named_modules()} == originals
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_a_projection_of_another_input_is_refused():
    model = make_model(seed=3, layers=1)
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 4, model.config.hidden_size)
    with fused_projections(model):
        attention.q_proj(x)
        with pytest.raises(FusionError, match="k_proj was called on another input"):
            attention.k_proj(x.clone())
    assert type(attention.k_proj) is nn.Linear
