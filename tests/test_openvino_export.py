"""The OpenVINO export (verispec.backends.openvino.export) on the tiny random model: the stateful graph gives the
transformers logits at every pass width and cache length, resets to an empty cache, and is cached by source and
format; OpenVINO GenAI's pipeline loads it, and as a bench peer answers greedily as verispec's plain decoding does."""

import numpy as np
import pytest
import torch

from conftest import require_openvino  # noqa: E402

require_openvino()

from verispec.backends.openvino import export as ov_export  # noqa: E402
from verispec.errors import InvalidRequest  # noqa: E402


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
    return ov_export.export_dir(str(tiny_dir), "fp32")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_stateful_export_matches_transformers_at_every_width(exported, tiny_target):
    import openvino as ov

    # f32 cache: OpenVINO's CPU plugin keeps a stateful model's cache in u8 by default
    compiled = ov.Core().compile_model(exported / ov_export.MODEL_XML, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                                               "KV_CACHE_PRECISION": "f32"})
    request = compiled.create_infer_request()
    ids = torch.randint(3, 32, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny_target.model(ids).logits[0].numpy()
    for _ in range(2):  # a reset starts again from an empty cache
        request.reset_state()
        done = 0
        for width in (5, 1, 1, 4, 9, 1, 6):
            feed = {"input_ids": ids[:, done:done + width].numpy(),
                    "attention_mask": np.ones((1, done + width), np.int64),
                    "position_ids": np.arange(done, done + width, dtype=np.int64)[None],
                    "beam_idx": np.zeros(1, np.int32)}
            got = request.infer(feed)["logits"][0]
            np.testing.assert_allclose(got, want[done:done + width], atol=1e-4, rtol=1e-4)
            done += width
    assert {p.get_any_name() for p in compiled.inputs} == {"input_ids", "attention_mask", "position_ids", "beam_idx"}
    assert len(request.query_state()) == 2 * tiny_target.model.config.num_hidden_layers


def test_verispec_graph_fuses_the_projections_of_one_input(exported, tiny_target):
    import openvino as ov

    def matmuls(xml):
        return sum(op.get_type_name() == "MatMul" for op in ov.Core().read_model(exported / xml).get_ops())

    layers = tiny_target.model.config.num_hidden_layers
    # GenAI's graph as optimum-intel lays it out; verispec's: q/k/v one matmul (2 fewer), gate/up one (1 fewer)
    assert matmuls(ov_export.MODEL_XML) - matmuls(ov_export.VERISPEC_XML) == 3 * layers


def test_bf16_gets_an_unfused_export_of_its_own(exported, tiny_dir):
    import openvino as ov

    bf16 = ov_export.export_dir(str(tiny_dir), "bf16")
    assert bf16 != exported

    def matmuls(xml):
        return sum(op.get_type_name() == "MatMul" for op in ov.Core().read_model(bf16 / xml).get_ops())

    # fused matmuls made bf16 passes width-dependent on a Zen 4, so bf16 runs the projections one by one
    assert matmuls(ov_export.MODEL_XML) == matmuls(ov_export.VERISPEC_XML)


def test_an_outdated_export_of_the_same_source_is_removed(exported, tiny_dir):
    import json
    import shutil

    old = exported.parent / f"{exported.name.rsplit('-', 1)[0]}-0123456789abcdef"
    other = exported.parent / f"{exported.name.rsplit('-', 1)[0]}-fedcba9876543210"
    for folder, source in ((old, str(tiny_dir)), (other, "/somewhere/else")):
        folder.mkdir()
        (folder / "verispec_export.json").write_text(json.dumps(
            {"source": source, "weights": "fp32", "export_version": ov_export.EXPORT_VERSION - 1}))
    moved = exported.with_name(exported.name + ".kept")
    shutil.move(exported, moved)  # the next call exports again, as after a version bump
    try:
        assert ov_export.export_dir(str(tiny_dir), "fp32") == exported
        assert not old.exists() and other.exists()  # only the same source's older export goes
    finally:
        shutil.rmtree(other)
        shutil.rmtree(moved)


def test_export_is_cached_by_source_and_format(exported, tiny_dir):
    assert ov_export.export_dir(str(tiny_dir), "fp32") == exported  # the second call exports nothing
    assert (exported / "config.json").exists() and (exported / "verispec_export.json").exists()
    with pytest.raises(InvalidRequest, match="unknown OpenVINO weight format 'q4'"):
        ov_export.export_dir(str(tiny_dir), "q4")
    with pytest.raises(InvalidRequest, match="hub id"):
        ov_export.export_dir("someone/some-model", "fp32")


def test_genai_peers_answer_as_verispec_plain_decoding(exported, tiny_dir, tiny_target):
    require_openvino("openvino_genai")
    if not (exported / "openvino_tokenizer.xml").exists():
        pytest.skip("openvino-tokenizers could not convert the tiny word-level tokenizer")
    from verispec.backends import load_model
    from verispec.bench import build_method

    target = load_model(str(tiny_dir))
    target.eos_token_ids = frozenset()  # random weights: run every answer to the limit
    base = build_method("baseline", target, None)
    prompt = [1, 5, 9, 5, 9, 5, 9, 12]
    want = base.run(prompt, 24).token_ids
    for spec in ("openvino:kv=f32", "openvino:lookup:k=3:kv=f32"):
        peer = build_method(spec, target, None, threads=1)
        run = peer.run(prompt, 24)
        assert run.token_ids == want, spec
        assert sum(run.step_tokens) == 24 and peer.family == "openvino"
    with pytest.raises(InvalidRequest, match="unknown option"):
        build_method("openvino:beam=2", target, None)
    with pytest.raises(InvalidRequest, match="weights= takes"):
        build_method("openvino:weights=q4", target, None)
    from verispec.backends.openvino.model import auto_candidates

    # bf16 compute: GenAI's kernel keeps a bf16 cache only (said before any pipeline is built); no bf16 here: said too
    with pytest.raises(InvalidRequest, match="kv=bf16" if "bf16" in auto_candidates() else "bf16 instructions"):
        build_method("openvino:weights=bf16:kv=f32", target, None)
