"""Benchmark prompt sets, method specs, summary arithmetic on synthetic records, and the bench / analyze
commands end to end on the tiny model."""

import json

import pytest
import torch

from verispec.bench import build_method, load_questions, markdown, parse_spec, select, summarize
from verispec.bench.summary import position_acceptance
from verispec.cli import main
from verispec.errors import InvalidRequest


def rec(method, qid, tokens, seconds, step_tokens, ids, turn=1, group="qa", drafted=None, accepted=None,
        lat=None, lossy=False, dpp=(), app=()):
    return {
        "method": method, "question_id": qid, "group": group, "category": group, "turn": turn,
        "new_tokens": tokens, "wall_seconds": seconds, "verify_steps": len(step_tokens), "step_tokens": step_tokens,
        "step_drafted": drafted, "step_accepted": accepted, "token_latencies": lat or [seconds / tokens] * tokens,
        "token_ids": ids, "lossy": lossy, "drafted_per_position": list(dpp), "accepted_per_position": list(app),
    }


def synthetic():
    return [
        rec("baseline", "1", 10, 2.0, [1] * 10, [1] * 10),
        rec("spec", "1", 10, 1.0, [3, 3, 4], [1] * 10, drafted=[4, 4, 4], accepted=[2, 2, 3], dpp=[3, 3, 3, 3],
            app=[3, 3, 1, 0]),
        # question 2 has two turns: tokens/s of a question sums tokens and seconds over its turns
        rec("baseline", "2", 6, 1.0, [1] * 6, [2] * 6, group="mt_bench"),
        rec("baseline", "2", 4, 1.0, [1] * 4, [3] * 4, turn=2, group="mt_bench"),
        rec("spec", "2", 6, 0.5, [2, 4], [2] * 6, group="mt_bench", drafted=[3, 3], accepted=[1, 3],
            dpp=[2, 2, 2], app=[2, 1, 1]),
        rec("spec", "2", 4, 0.5, [4], [9] * 4, turn=2, group="mt_bench", drafted=[3], accepted=[3],
            dpp=[1, 1, 1], app=[1, 1, 1]),
    ]


def test_summary_arithmetic_follows_spec_bench():
    s = summarize(synthetic(), "baseline", greedy=True)
    base, spec = s["overall"]["baseline"], s["overall"]["spec"]
    # per-question tokens/s: baseline 10/2 = 5 and 10/2 = 5; spec 10/1 = 10 and 10/1 = 10
    assert base["tokens_per_second"] == pytest.approx(5.0) and spec["tokens_per_second"] == pytest.approx(10.0)
    assert spec["speedup"] == pytest.approx(2.0) and base["speedup"] == pytest.approx(1.0)
    assert spec["mean_accepted_tokens"] == pytest.approx(20 / 6)  # 20 tokens over 6 verify steps
    assert base["mean_accepted_tokens"] == pytest.approx(1.0)
    assert spec["acceptance_rate"] == pytest.approx(14 / 21)  # (2+2+3+1+3+3) / (4*3+3+3+3)
    assert base["acceptance_rate"] is None and spec["drafted"] == 21
    assert spec["identical"] == pytest.approx(2 / 3)  # question 2 turn 2 differs
    assert spec["questions"] == 2 and spec["records"] == 3 and spec["new_tokens"] == 20
    assert s["groups"]["qa"]["spec"]["speedup"] == pytest.approx(2.0)
    assert s["groups"]["mt_bench"]["spec"]["tokens_per_second"] == pytest.approx(10.0)
    assert spec["position_acceptance"] == pytest.approx([6 / 6, 5 / 6, 3 / 6, 0 / 3])
    assert spec["latency_p50_ms"] == pytest.approx(100.0)


def test_speedup_is_ratio_of_mean_throughputs_not_mean_of_ratios():
    records = [rec("baseline", "a", 10, 1.0, [1] * 10, [1]), rec("m", "a", 10, 0.5, [2] * 5, [1]),
               rec("baseline", "b", 10, 10.0, [1] * 10, [1]), rec("m", "b", 10, 10.0, [1] * 10, [1])]
    s = summarize(records, "baseline", greedy=True)["overall"]["m"]
    # mean tps: method (20 + 1) / 2 = 10.5, baseline (10 + 1) / 2 = 5.5
    assert s["speedup"] == pytest.approx(10.5 / 5.5)


def test_sampling_runs_report_identity_as_not_applicable():
    s = summarize(synthetic(), "baseline", greedy=False)
    assert s["overall"]["spec"]["identical"] is None
    assert "n/a (sampling)" in markdown(s)


def test_markdown_has_group_columns_and_marks_lossy():
    records = synthetic()
    for r in records:
        if r["method"] == "spec":
            r["lossy"] = True
    text = markdown(summarize(records, "baseline", greedy=True))
    assert "| method | qa | mt_bench | overall |" in text
    assert "| spec (LOSSY) | 2.00x | 2.00x | 2.00x |" in text  # in both tables
    assert "| spec (LOSSY) | 2 | 20 |" in text


def test_markdown_marks_a_changed_model_and_counts_looping_answers_beside_its_speed():
    records = synthetic()
    for r in records:
        if r["method"] == "spec":
            r["changed_model"] = "OpenVINO int4 re-quantizes the weights (NNCF)"
            r["token_ids"] = [5, 6, 7, 8, 9, 10, 11] * 10  # ends in a loop
    summary = summarize(records, "baseline", greedy=True)
    assert summary["overall"]["spec"]["looping"] == 3 and summary["overall"]["baseline"]["looping"] == 0
    summary["quality"] = {"spec": {"perplexity": 40.4, "top1_agreement": 0.6284, "tokens": 100},
                          "baseline": {"perplexity": 31.9, "top1_agreement": 1.0, "tokens": 100}}
    text = markdown(summary)
    assert "| spec (CHANGED MODEL) | 2.00x |" in text
    assert "| 3/3 | 40.400 | 62.84% |" in text and "| 0/3 | 31.900 | 100.00% |" in text
    assert "- spec: OpenVINO int4 re-quantizes the weights (NNCF)" in text


def test_charts_mark_a_changed_model_and_name_the_machine(tmp_path):
    from verispec.bench import plots

    records = synthetic()
    for r in records:
        if r["method"] == "spec":
            r["changed_model"] = "OpenVINO int4 re-quantizes the weights (NNCF)"
    summary = summarize(records, "baseline", greedy=True)
    summary["environment"] = {"cpu": "AMD EPYC", "cpu_flags": ["avx", "avx2"], "cpu_count": 2,
                              "date": "2026-11-29T17:15:42+00:00"}
    assert plots._label(summary, "spec") == "spec (CHANGED MODEL)" and plots._label(summary, "baseline") == "baseline"
    assert plots._where(summary) == "AMD EPYC (avx2), 2 cores, 2026-11-29"
    assert plots.speedup_by_group(summary, tmp_path / "s.png").stat().st_size > 0


def test_the_pass_cost_chart_draws_each_engines_curve_and_the_floor(tmp_path):
    """``verispec costs --plot``'s chart from a summary with a memory floor, engines timed at different widths and one
    engine's products timed with their weights in cache."""
    import matplotlib.image

    from verispec.bench import plots

    summary = {"target": "m", "threads": 2, "context": 256, "cpu": "AMD EPYC (avx2, family 25, model 1)",
               "floor_ms": 30.0, "bandwidth_gbs": 35.0,
               "engines": {"a": {"ms": {"1": 40.0, "2": 50.0, "8": 120.0},  # with --arithmetic-floor: dashed
                                 "products_in_cache_ms": {"1": {"all": 20.0}, "2": {"all": 30.0}, "8": {"all": 100.0}}},
                           "b": {"ms": {"1": 36.0, "4": 100.0}}}}
    path = plots.pass_costs(summary, tmp_path / "c.png")
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > height > 300


def test_a_loop_is_an_answer_whose_tail_repeats_itself():
    from verispec.bench.quality import loops

    assert loops([1, 2, 3, 4, 5, 6, 7, 8] * 10)
    assert not loops(list(range(100)))
    assert not loops([1, 2, 3] * 10)  # shorter than the window: not judged
    assert not loops(list(range(40)) + [1, 2, 3, 4, 5, 6, 7] * 4)  # a repeat that has not taken over


def test_position_acceptance_pools_records():
    assert position_acceptance([{"drafted_per_position": [2, 1], "accepted_per_position": [1, 0]},
                                {"drafted_per_position": [2], "accepted_per_position": [2]}]) == [0.75, 0.0]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_sets_and_selection(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "again"] if c in ("writing", "math") else [f"q{i}"]}
            for i, c in enumerate(["writing", "writing", "math", "math", "rag", "rag", "rag"])]
    qs = load_questions(write_jsonl(tmp_path / "q.jsonl", rows))
    assert [q.group for q in qs[:3]] == ["mt_bench", "mt_bench", "mt_bench"]
    # mt_bench categories take turns, so a limit of 2 samples writing and math
    assert [q.category for q in select(qs, ["mt_bench"], 2)] == ["writing", "math"]
    assert [q.question_id for q in select(qs, ["rag"], 2)] == ["4", "5"]
    assert len(select(qs, None, None)) == 7
    assert len(select(qs, ["writing", "mt_bench"], None)) == 4  # no duplicates
    with pytest.raises(InvalidRequest, match="unknown category translation"):
        select(qs, ["translation"], None)
    with pytest.raises(InvalidRequest, match="--limit"):
        select(qs, None, 0)
    plain = load_questions(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": "bye"}]))
    assert [(q.question_id, q.category, q.turns) for q in plain] == [("1", "prompts", ("hello",)),
                                                                      ("2", "prompts", ("bye",))]


@pytest.mark.parametrize("content, words", [
    ("{not json\n", "not valid JSON"),
    ('{"text": "x"}\n', '"turns"'),
    ('{"prompt": ""}\n', "non-empty"),
    ("\n", "holds no prompts"),
])
def test_bad_prompt_files_are_clear_errors(tmp_path, content, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match=words):
        load_questions(path)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(InvalidRequest, match="does not exist"):
        load_questions(tmp_path / "nope.jsonl")


def test_method_specs(tiny_target):
    assert parse_spec("model:some/path:k=4") == ("model", ["some/path"], {"k": "4"})
    assert parse_spec("hf:assisted:REF") == ("hf:assisted", ["REF"], {})
    assert parse_spec("ngram:k=3:max_n=5") == ("ngram", [], {"k": "3", "max_n": "5"})
    m = build_method("ngram:k=3:max_n=5", tiny_target, load=None)
    assert (m.family, m.drafter, m.k) == ("verispec", "ngram", 3)
    assert build_method("hf:pld", tiny_target, load=None).k == 10
    assert build_method("baseline", tiny_target, load=None).k is None


def test_transformers_methods_run_plain_weights_unless_asked(tiny_dir):
    from verispec import load_model
    from verispec.backends.torch_cpu.packing import packing_available

    if not packing_available(torch.float32):
        pytest.skip("this torch build cannot pack float32 weights")
    target = load_model(str(tiny_dir), dtype="float32")
    plain = load_model(str(tiny_dir), dtype="float32", pack=False)
    assert target.packed_layers and not plain.packed_layers
    calls = []

    def load(ref, pack=None, compiled=None):
        assert not compiled  # transformers' generate never runs verispec's compiled step
        calls.append((ref, pack))
        return plain

    method = build_method("hf:greedy", target, load)
    assert calls == [(str(tiny_dir), False)]
    ids = [5, 9, 3, 5, 9]
    with torch.inference_mode():
        expected = plain.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    assert method.run(ids, 8).token_ids == expected
    build_method("hf:greedy:pack=1", target, load)
    assert len(calls) == 1  # pack=1: the target's own packed weights, nothing loaded


@pytest.mark.parametrize("spec, words", [
    ("bogus", "unknown method"),
    ("hf", "needs a kind"),
    ("hf:beam", "unknown transformers method"),
    ("model", "needs a draft model"),
    ("ngram:k=x", "must be a number"),
    ("ngram:colour=3", "colour"),
    ("ngram:extra", "unexpected part"),
    ("hf:greedy:k=2", "takes no options"),
])
def test_bad_method_specs(tiny_target, spec, words):
    with pytest.raises(InvalidRequest, match=words):
        build_method(spec, tiny_target, load=None)


@pytest.fixture()
def tiny_prompts(tmp_path):
    rows = [{"question_id": 1, "category": "writing", "turns": ["w3 w4 w5 w6 w3 w4 w5", "w7 w8"]},
            {"question_id": 2, "category": "rag", "turns": ["w9 w10 w11 w9 w10"]},
            {"question_id": 3, "category": "rag", "turns": ["w12 w13 w14 w12 w13 w14"]}]
    return write_jsonl(tmp_path / "tiny.jsonl", rows)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_command_on_tiny_model(tiny_dir, tiny_prompts, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    code = main(["bench", "--target", str(tiny_dir), "--prompts", str(tiny_prompts), "--max-new-tokens", "12",
                 "--methods", "baseline,ngram:k=4,hf:greedy,hf:pld:k=4", "--out", str(out_dir)])
    assert code == 0
    out = capsys.readouterr().out
    result = last_json(out)
    assert "| method | mt_bench | rag | overall |" in out
    assert set(result["groups"]) == {"mt_bench", "rag"}
    assert result["environment"]["dtype"] == "float32" and result["environment"]["versions"]["torch"]
    for name, s in result["overall"].items():
        assert s["identical"] == 1.0, name  # greedy: every method reproduces plain decoding
        assert s["questions"] == 3 and s["records"] == 4
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 4
    assert {r["turn"] for r in records if r["question_id"] == "1"} == {1, 2}
    assert all(sum(r["step_tokens"]) == r["new_tokens"] == len(r["token_ids"]) for r in records)
    for name in ("summary.md", "summary.json", "speedup.png", "acceptance_by_position.png"):
        assert (out_dir / name).stat().st_size > 0


def test_bench_sampling_run_reports_identity_not_applicable(tiny_dir, tiny_prompts, tmp_path, capsys):
    code = main(["bench", "--target", str(tiny_dir), "--prompts", str(tiny_prompts), "--max-new-tokens", "6",
                 "--methods", "baseline,ngram", "--temperature", "1", "--limit", "1", "--no-plots",
                 "--out", str(tmp_path / "b")])
    assert code == 0
    result = last_json(capsys.readouterr().out)
    assert result["greedy"] is False and result["overall"]["ngram"]["identical"] is None


@pytest.mark.parametrize("args, words", [
    (["--methods", "baseline,baseline"], "twice"),
    (["--methods", "nope"], "unknown method"),
    (["--categories", "translation"], "unknown category"),
    (["--temperature", "-1"], "temperature"),
])
def test_bench_errors_exit_2(tiny_dir, tiny_prompts, capsys, args, words):
    assert main(["bench", "--target", str(tiny_dir), "--prompts", str(tiny_prompts), *args]) == 2
    assert words in capsys.readouterr().err


def test_analyze_command_with_the_target_as_its_own_draft(tiny_dir, tiny_prompts, tmp_path, capsys):
    """A draft model identical to the target: teacher-forced beta is 1 and every draft is accepted."""
    code = main(["analyze", "--target", str(tiny_dir), "--prompts", str(tiny_prompts), "--drafter",
                 f"model:{tiny_dir}", "--k-max", "4", "--max-new-tokens", "10", "--repeats", "1",
                 "--sweep-k", "1,4", "--out", str(tmp_path / "a")])
    assert code == 0
    out = capsys.readouterr().out
    result = last_json(out)
    assert result["teacher_forced_beta"] == pytest.approx(1.0)
    assert result["position_acceptance"] == pytest.approx([1.0] * len(result["position_acceptance"]))
    assert [p["k"] for p in result["predictions"]] == [1, 2, 3, 4]
    assert sorted(result["verify_cost_ms"], key=int) == ["0", "1", "2", "3", "4"]
    assert [m["k"] for m in result["measured"]] == [1, 4]
    assert all(m["identical"] == 1.0 for m in result["measured"])
    assert 1 <= result["optimal_k"] <= 4 and "predicted optimal k" in out
    assert (tmp_path / "a" / "analysis.png").stat().st_size > 0


def test_analyze_rejects_a_k_in_the_drafter_spec(tiny_dir, tiny_prompts, capsys):
    assert main(["analyze", "--target", str(tiny_dir), "--prompts", str(tiny_prompts), "--drafter", "ngram:k=3"]) == 2
    assert "--k-max" in capsys.readouterr().err


def test_per_method_target_options_load_their_own_target(tiny_target):
    """baseline:dtype=bfloat16 and ngram:backend=...:weights=... ask the loader for their own target; options a
    method cannot use are refused by name."""
    calls = []

    def load(ref, **options):
        calls.append((ref, options))
        return tiny_target

    build_method("baseline:dtype=bfloat16", tiny_target, load)
    assert calls[-1] == (tiny_target.name, dict(backend=None, features=False, dtype="bfloat16"))
    build_method("ngram:backend=llamacpp:weights=f16:k=4", tiny_target, load)
    assert calls[-1][1] == dict(backend="llamacpp", features=False, weights="f16")
    with pytest.raises(InvalidRequest, match="weights= is an option of the llamacpp and openvino backends, not "
                                             "transformers: add backend=llamacpp"):
        build_method("ngram:weights=f16", tiny_target, load)  # the run's target is a transformers one
    build_method("ngram:backend=openvino:static=2+4", tiny_target, load)
    assert calls[-1][1]["static_widths"] == "2+4"
    build_method("baseline:compile=1", tiny_target, load)
    assert calls[-1][1]["compiled"] == "on"
    build_method("ngram:compile=0", tiny_target, load)
    assert calls[-1][1]["compiled"] == "off"
    build_method("ngram:compile=auto", tiny_target, load)
    assert calls[-1][1]["compiled"] == "auto"
    build_method("ngram:backend=openvino:weights=int4:min_width=6", tiny_target, load)
    assert calls[-1][1]["min_width"] == 6 and calls[-1][1]["backend"] == "openvino"
    with pytest.raises(InvalidRequest, match="min_width= is an option of the openvino backend, not transformers"):
        build_method("ngram:min_width=6", tiny_target, load)
    with pytest.raises(InvalidRequest, match="compile= takes 0 / off, 1 / on or auto"):
        build_method("baseline:compile=yes", tiny_target, load)
    with pytest.raises(InvalidRequest, match="compile= is an option of verispec methods"):
        build_method("hf:greedy:compile=1", tiny_target, load)
    with pytest.raises(InvalidRequest, match="weights="):
        build_method("ngram:backend=llamacpp:dtype=bfloat16", tiny_target, load)
    with pytest.raises(InvalidRequest, match="transformers backend"):
        build_method("hf:greedy:backend=llamacpp", tiny_target, load)
    with pytest.raises(InvalidRequest, match="policy"):
        build_method("llamacpp:policy=fixed", tiny_target, load)


def test_the_environment_records_verispec_settings_but_no_token(monkeypatch):
    from verispec.bench.environment import environment

    monkeypatch.setenv("VERISPEC_LLAMACPP_LAYER_INPUTS", "0")
    monkeypatch.setenv("VERISPEC_ADMIN_TOKEN", "secret")
    settings = environment("float32", "cpu")["settings"]
    assert settings["VERISPEC_LLAMACPP_LAYER_INPUTS"] == "0" and "VERISPEC_ADMIN_TOKEN" not in settings


def test_the_shipped_code_workload_has_two_groups_of_at_least_eight_prompts():
    from verispec.bench.prompts import load_questions, select

    questions = load_questions("code")
    groups = {}
    for q in questions:
        groups.setdefault(q.group, []).append(q)
    assert set(groups) == {"code_edit", "code_generation"} and all(len(g) >= 8 for g in groups.values())
    assert all("```" in q.turns[0] for q in groups["code_edit"])  # an edit rewrites code given in the prompt
    assert len({q.question_id for q in questions}) == len(questions)
    assert [q.group for q in select(questions, ["code_edit"], 2)] == ["code_edit", "code_edit"]
