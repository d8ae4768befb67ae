"""Medusa heads and drafter on tiny random models: training/inference alignment, greedy identity (chains and
trees), the exact sampling distribution, checkpoints bound to their target, and train-medusa end to end."""

import json
import random
from pathlib import Path

import pytest
import safetensors.torch
import torch

from statistical_helpers import ALPHA, PROMPT, joint_p_value
from tiny import loaded, make_model
from verispec import IncompatibleDrafter, ModelNotFound, SamplingParams, SpeculativeDecoder
from verispec.drafters.medusa import MedusaDrafter
from verispec.training.data import build_dataset
from verispec.errors import InvalidRequest
from verispec.medusa.head import MedusaHeads, config_for
from verispec.medusa.train import MedusaTrainConfig, head_mask, train_medusa

PROMPTS = [[5, 9, 3, 5, 9, 4, 7], [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], [12, 30, 7]]


def random_heads(target, vocab=None, seed=0, num_heads=3, scale=0.3):
    torch.manual_seed(seed)
    vocab = vocab or target.vocab_size
    heads = MedusaHeads(config_for(target.model, target.name, num_heads, vocab))
    heads.d2t.copy_(torch.arange(target.vocab_size)[torch.randperm(target.vocab_size)[:vocab]].sort().values)
    with torch.no_grad():  # not the zero start: every head's guess differs from the target's
        for p in heads.parameters():
            p.normal_(0, scale)
    return heads.attach(target.model).eval()


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory, small_target):
    """Heads trained by the real pipeline on the tiny target's own answers (seconds on CPU)."""
    root = tmp_path_factory.mktemp("medusa")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randrange(3, 12))] for _ in range(400)]
    build_dataset(small_target, prompts, root / "data", layers=(), max_new_tokens=24, batch_size=64, shard_size=64,
                  progress=False)
    config = MedusaTrainConfig(num_heads=3, epochs=20, lr=3e-3, warmup_steps=5, batch_tokens=2048,
                               draft_vocab_size=28, val_sequences=16, val_every=40, bf16_autocast=False)
    report = train_medusa(small_target, root / "data", root / "heads", config, progress=False, log=lambda m: None)
    return root / "heads", report


def final_states(target, ids):
    with torch.no_grad():
        return target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def test_an_untrained_head_repeats_the_targets_guess(small_target):
    heads = MedusaHeads(config_for(small_target.model, small_target.name, 2, small_target.vocab_size)).attach(
        small_target.model)
    h = final_states(small_target, PROMPTS[0])
    target_logits = small_target.model.lm_head(h)
    for i in range(2):
        assert torch.allclose(heads.logits(heads.states(h)[:, i]), target_logits, atol=1e-5)


def test_training_labels_line_up_with_what_the_drafter_reads(small_target, trained_heads):
    """Head i at position j is trained on t_{j+i+2}; the drafter asks it, at the pending position m, for t_{m+1+i}
    from the state at m - 1: the same offset."""
    lengths, starts = torch.tensor([6, 4]), torch.tensor([2, 3])
    assert head_mask(lengths, starts, 6, 0, False)[0].tolist() == [True] * 4 + [False] * 2
    assert head_mask(lengths, starts, 6, 1, False)[1].tolist() == [True] + [False] * 5
    assert head_mask(lengths, starts, 6, 0, True)[1].tolist() == [False, True] + [False] * 4
    heads = MedusaHeads.load(trained_heads[0]).attach(small_target.model)
    ids = PROMPTS[1]
    h = final_states(small_target, ids)
    drafter = MedusaDrafter(small_target, heads)
    m = 6
    draft = drafter.propose(ids[: m + 1], 3, features=h[:m, None])
    expected = [int(heads.d2t[heads.logits(heads.states(h[m - 1])[i]).argmax()]) for i in range(3)]
    assert draft.tokens == expected and draft.probs is None and len(draft.confidence) == 3


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_medusa_greedy_equals_plain_greedy(small_target, trained_heads, k):
    drafters = [MedusaDrafter(small_target, trained_heads[0], precision="float32"),
                MedusaDrafter(small_target, trained_heads[0], precision="bfloat16"),
                MedusaDrafter(small_target, random_heads(small_target, 20))]
    assert drafters[1].heads.lm_head_d.dtype == torch.bfloat16 and drafters[0].heads.lm_head_d.dtype == torch.float32
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40).token_ids
        for drafter in drafters:
            got = SpeculativeDecoder(small_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=40)
            assert got.token_ids == expected, (k, prompt)


@pytest.mark.parametrize("k", [2, 6, 12])
def test_medusa_tree_greedy_equals_plain_greedy(small_target, trained_heads, k):
    drafter = MedusaDrafter(small_target, trained_heads[0], tree=True, width=3)
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40).token_ids
        out = SpeculativeDecoder(small_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert out.token_ids == expected, (k, prompt)
        assert out.stats.accepted > 0


def test_trained_heads_draft_tokens_the_target_accepts(small_target, trained_heads):
    heads_dir, report = trained_heads
    trained = SpeculativeDecoder(small_target, MedusaDrafter(small_target, heads_dir), k=3, k_policy="fixed")
    untrained = SpeculativeDecoder(small_target, MedusaDrafter(small_target, random_heads(small_target)), k=3,
                                   k_policy="fixed")
    trained_mat = sum(trained.generate(p, max_new_tokens=40).stats.mean_accepted_tokens for p in PROMPTS)
    random_mat = sum(untrained.generate(p, max_new_tokens=40).stats.mean_accepted_tokens for p in PROMPTS)
    assert trained_mat / 3 > 1.8 and trained_mat > random_mat + 1.0
    first, best = report.val_history[0], report.best
    assert best["top1"][0] > 0.5 and best["top1"][0] >= first["top1"][0]
    assert best["top1"][0] >= best["top1"][-1]  # the nearer guess is the easier one
    assert all(0 <= b <= 1 for b in best["beta"])


def test_tree_nodes_are_the_most_likely_paths(small_target, trained_heads):
    drafter = MedusaDrafter(small_target, trained_heads[0], tree=True, width=3)
    h = final_states(small_target, PROMPTS[1])
    draft = drafter.propose(PROMPTS[1], 7, features=h[: len(PROMPTS[1]) - 1, None])
    assert len(draft.tokens) == 7 and draft.parents[0] == -1
    assert all(p < i for i, p in enumerate(draft.parents))  # parents come first
    assert drafter.tree_depth == 3 and draft.depth <= 3
    children: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        children.setdefault(p, []).append(draft.tokens[i])
    assert all(len(set(c)) == len(c) for c in children.values())  # siblings differ


SAMPLING = {"t0.3": SamplingParams(temperature=0.3), "topk-topp": SamplingParams(temperature=0.3, top_k=8, top_p=0.9)}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", SAMPLING)
def test_medusa_sampling_matches_exact_joint_distribution(small_target, trained_heads, case, precision):
    """Drafts drawn from each head's q (28-token draft vocabulary, plus the context's tokens), float32 heads or
    bfloat16 ones under the float32 target; the committed tokens still follow the target exactly."""
    drafter = MedusaDrafter(small_target, trained_heads[0], precision=precision)
    assert drafter.heads.lm_head_d.dtype == getattr(torch, precision)
    decoder = SpeculativeDecoder(small_target, drafter, k=3, k_policy="fixed")
    assert joint_p_value(decoder, SAMPLING[case]) > ALPHA
    out = decoder.generate(PROMPT, max_new_tokens=20, seed=1, temperature=0.3)
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_medusa_sampling_at_temperature_1_with_untrained_heads(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, MedusaDrafter(tiny_target, random_heads(tiny_target, 20)), k=3,
                                 k_policy="fixed")
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA


def test_medusa_trees_when_sampling_match_exact_joint_distribution(small_target, trained_heads):
    drafter = MedusaDrafter(small_target, trained_heads[0], tree=True, width=2)
    decoder = SpeculativeDecoder(small_target, drafter, k=5, k_policy="fixed")
    assert joint_p_value(decoder, SAMPLING["t0.3"]) > ALPHA
    out = decoder.generate(PROMPT, max_new_tokens=20, seed=1, temperature=0.3)
    assert out.stats.drafted > 0 and max(out.stats.step_drafted) >= 2 and out.stats.accepted > 0


def test_checkpoint_roundtrip_and_wrong_target(small_target, trained_heads, tmp_path):
    heads_dir = trained_heads[0]
    cfg = json.loads((heads_dir / "config.json").read_text())
    assert cfg["kind"] == "medusa" and cfg["num_heads"] == 3 and cfg["final_layer"] == 2
    assert cfg["draft_vocab_size"] == 28 and cfg["training"]["best_validation"]["top1"]
    heads = MedusaHeads.load(heads_dir)
    heads.save(tmp_path / "copy")
    again = MedusaHeads.load(tmp_path / "copy")
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), again.state_dict().values()))
    other = loaded(make_model(seed=7), small_target.tokenizer, name="tiny-other")
    with pytest.raises(IncompatibleDrafter, match="trained for 'tiny'.*train-medusa"):
        MedusaDrafter(other, heads_dir)
    with pytest.raises(ModelNotFound, match="train-medusa"):
        MedusaDrafter(small_target, tmp_path / "nowhere")
    eagle_like = tmp_path / "eagle"
    eagle_like.mkdir()
    (eagle_like / "config.json").write_text(json.dumps({"feature_layers": [1]}))
    (eagle_like / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="not of kind 'medusa'"):
        MedusaDrafter(small_target, eagle_like)
    with pytest.raises(ModelNotFound, match="no Medusa heads ship for target 'tiny'"):
        MedusaDrafter(small_target)
    with pytest.raises(InvalidRequest, match="width must be"):
        MedusaDrafter(small_target, heads_dir, tree=True, width=0)


def test_bfloat16_target_runs_the_heads(trained_heads):
    target = loaded(make_model(seed=0, scale=0.1).to(torch.bfloat16))
    target.dtype = torch.bfloat16
    drafter = MedusaDrafter(target, trained_heads[0])
    out = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate(PROMPTS[1], max_new_tokens=20)
    assert out.token_ids == SpeculativeDecoder(target).generate(PROMPTS[1], max_new_tokens=20).token_ids
    assert drafter.heads.lm_head_d.dtype == torch.bfloat16


def test_train_medusa_command_end_to_end(tiny_dir, tmp_path, capsys):
    """docs/drafters.md's training command on the tiny model: data, training, held-out check, then the heads draft,
    in the CLI and as a bench method."""
    from verispec.cli import main

    rng = random.Random(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, 32)}" for _ in range(6))}) + "\n"
                               for _ in range(50)))
    out = tmp_path / "heads"
    code = main(["train-medusa", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--data", str(tmp_path / "data"), "--samples", "40", "--max-new-tokens", "8", "--epochs", "2",
                 "--heads", "2", "--draft-vocab", "16", "--val-every", "5", "--check-prompts", "2"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["held_out_check"]["prompts"] == 2 and summary["held_out_check"]["k"] == 2
    assert len(summary["best_validation"]["top1"]) == 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["held_out_check"] and cfg["training"]["data"]["sequences"] == 40
    assert main(["generate", "w5 w9 w3", "--raw", "--target", str(tiny_dir), "--drafter", "medusa", "--medusa-heads",
                 str(out), "--medusa-tree", "--max-new-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["drafter"] == "medusa" and result["stats"]["new_tokens"] >= 1
    # continue training on the same data: the draft vocabulary is kept, the weights move
    more = tmp_path / "more"
    assert main(["train-medusa", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(more),
                 "--data", str(tmp_path / "data"), "--samples", "40", "--max-new-tokens", "8", "--epochs", "1",
                 "--val-every", "5", "--check-prompts", "0", "--init-heads", str(out)]) == 0
    capsys.readouterr()
    first, second = MedusaHeads.load(out), MedusaHeads.load(more)
    assert torch.equal(first.d2t, second.d2t) and second.num_heads == 2
    # the heads written are the best validated ones, the starting heads included (validated at step 0)
    record = json.loads((more / "config.json").read_text())["training"]
    history = record["validation_history"]
    assert history[0]["step"] == 0 and len(history) >= 2
    assert record["best_validation"]["est_tokens_per_step"] == max(m["est_tokens_per_step"] for m in history)
    assert torch.equal(first.heads[0][0].linear.weight, second.heads[0][0].linear.weight) == \
        (record["best_validation"]["step"] == 0)
    assert main(["train-medusa", "--prompts", str(prompts), "--out", str(more), "--heads", "0"]) == 2
    assert "--heads must be >= 1" in capsys.readouterr().err


def test_a_continued_run_that_trains_no_step_leaves_the_heads_it_started_from(small_target, trained_heads, tmp_path):
    data = trained_heads[0].parent / "data"
    config = MedusaTrainConfig(epochs=1, batch_tokens=2048, val_sequences=16, bf16_autocast=False,
                               init_heads=str(trained_heads[0]))
    report = train_medusa(small_target, data, tmp_path / "out", config, progress=False, log=lambda m: None,
                          should_stop=lambda step: True)
    assert report.steps == 0 and not report.finished and report.best["step"] == 0
    start, kept = MedusaHeads.load(trained_heads[0]), MedusaHeads.load(tmp_path / "out")
    assert torch.equal(start.heads[0][0].linear.weight, kept.heads[0][0].linear.weight)


def test_batch_engine_runs_medusa_rows_with_plain_greedy_output(small_target, trained_heads):
    from verispec.batching import BatchEngine

    engine = BatchEngine(small_target, max_batch=3)
    seqs = []
    for prompt in PROMPTS + [PROMPTS[0][:4]]:
        d = SpeculativeDecoder(small_target, MedusaDrafter(small_target, trained_heads[0]), k=3, k_policy="fixed")
        seqs.append((prompt, engine.submit(d, d.request(prompt, max_new_tokens=24))))
    while engine.busy:
        engine.step()
    plain = SpeculativeDecoder(small_target)
    for prompt, seq in seqs:
        assert seq.error is None and seq.result.token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
    assert sum(seq.result.stats.accepted for _, seq in seqs) > 0


def test_bench_and_analyze_with_medusa_methods(small_dir, trained_heads, tmp_path, capsys):
    from verispec.cli import main

    heads = trained_heads[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [t]}) + "\n"
                               for i, t in enumerate(["w5 w9 w3 w5 w9", "w12 w30 w7", "w3 w4 w5 w6"])))
    methods = [f"medusa:{heads}:k=3", f"medusa:{heads}:tree=1:k=8:width=3"]
    assert main(["bench", "--target", str(small_dir), "--prompts", str(prompts), "--max-new-tokens", "24",
                 "--methods", ",".join(["baseline", *methods]), "--k-policy", "fixed", "--out", str(tmp_path / "b"),
                 "--no-plots"]) == 0
    overall = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["overall"]
    for name in methods:
        assert overall[name]["identical"] == 1.0 and overall[name]["mean_accepted_tokens"] > 1.5, name
    assert main(["analyze", "--target", str(small_dir), "--prompts", str(prompts), "--drafter", f"medusa:{heads}",
                 "--k-max", "3", "--max-new-tokens", "16", "--repeats", "1", "--out", str(tmp_path / "a")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.3 < result["teacher_forced_beta"] <= 1.0
    assert len(result["position_acceptance"]) == 3 and result["position_acceptance"][0] > 0.3
    # any registered drafter is analyzed; a tree's acceptance is by depth, without the chain model's predictions
    for drafter in ("lookahead", f"medusa:{heads}:tree=1"):
        assert main(["analyze", "--target", str(small_dir), "--prompts", str(prompts), "--drafter", drafter,
                     "--k-max", "6", "--max-new-tokens", "16", "--repeats", "1", "--out", str(tmp_path / "t")]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["predictions"] == [] and 0 < len(result["position_acceptance"]) <= 4, drafter
        assert main(["analyze", "--target", str(small_dir), "--prompts", str(prompts), "--drafter", drafter,
                     "--sweep-k"]) == 2
        assert "drafts token trees" in capsys.readouterr().err
    assert main(["analyze", "--target", str(small_dir), "--prompts", str(prompts), "--drafter", "nothing"]) == 2
    assert "medusa" in capsys.readouterr().err


def test_medusa_trains_on_token_only_data_and_a_stopped_run_resumes_exactly(small_target, tmp_path):
    """The EAGLE pipeline's token-only data trains Medusa heads too (the target's final state computed per batch),
    and a run stopped after a step then resumed ends with the weights of one that never stopped."""
    import dataclasses

    from verispec.training.data import load_sequences
    from verispec.training.checkpoints import CHECKPOINT

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randrange(3, 9))] for _ in range(40)]
    build_dataset(small_target, prompts, tmp_path / "data", layers=(), max_new_tokens=10, batch_size=16,
                  shard_size=16, progress=False, features=False)
    assert all(s.features is None for s in load_sequences(tmp_path / "data"))
    config = MedusaTrainConfig(num_heads=2, epochs=3, lr=3e-3, warmup_steps=2, batch_tokens=128, draft_vocab_size=24,
                               val_sequences=6, val_every=3, bf16_autocast=False)
    whole = train_medusa(small_target, tmp_path / "data", tmp_path / "whole", config, progress=False,
                         log=lambda m: None)
    assert whole.finished and whole.steps > 6 and whole.best["top1"][0] > 0
    first = train_medusa(small_target, tmp_path / "data", tmp_path / "split", config, progress=False,
                         log=lambda m: None, should_stop=lambda step: step >= 5)
    assert not first.finished and first.steps == 5
    rest = train_medusa(small_target, tmp_path / "data", tmp_path / "split", dataclasses.replace(config, resume=True),
                        progress=False, log=lambda m: None)
    assert rest.finished and rest.steps == whole.steps
    a = torch.load(tmp_path / "whole" / CHECKPOINT, weights_only=False)["weights"]
    b = torch.load(tmp_path / "split" / CHECKPOINT, weights_only=False)["weights"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    MedusaHeads.load(tmp_path / "split").attach(small_target.model)


def test_heads_are_packed_where_the_cpu_can_with_the_same_logits_and_save_unchanged(small_target, trained_heads,
                                                                                    tmp_path):
    from verispec.backends.torch_cpu.packing import PackedLinear, packing_available

    if not packing_available(torch.float32):
        pytest.skip("this CPU cannot run oneDNN's packed float32 kernel (tests/test_packing.py covers the fallback)")
    heads = MedusaHeads.load(trained_heads[0]).attach(small_target.model)
    plain = MedusaHeads.load(trained_heads[0]).train().attach(small_target.model).eval()  # not packed
    assert isinstance(heads.heads[0][0].linear, PackedLinear) and not isinstance(plain.heads[0][0].linear, PackedLinear)
    assert heads._lm_head_packed is not None and plain._lm_head_packed is None
    hidden = torch.randn(3, small_target.model.config.hidden_size)
    with torch.inference_mode():
        a, b = heads.logits(heads.states(hidden)), plain.logits(plain.states(hidden))
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # within the last bits of MKL's result
    heads.save(tmp_path / "again")
    saved = safetensors.torch.load_file(tmp_path / "again" / "model.safetensors")
    assert saved.keys() == safetensors.torch.load_file(Path(trained_heads[0]) / "model.safetensors").keys()
