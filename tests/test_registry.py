"""The drafter registry: every registered drafter reaches every entry point, and a new one needs no entry point
change (a drafter registered here, in the test, is offered by the command line, the server and bench specs)."""

from __future__ import annotations

import pytest

from verispec.bench import build_method
from verispec.cli import build_parser
from verispec.drafters import (Draft, DrafterBase, DrafterSpec, Option, drafter_names, drafter_specs, make_drafter,
                               options_from)
from verispec.drafters import registry
from verispec.errors import InvalidRequest
from verispec.server.config import ServeOptions, build_server_config


class RepeatDrafter(DrafterBase):
    """Proposes the last token `times` times: a drafter in a dozen lines, as a new one would start."""

    name = "repeat"

    def __init__(self, times: int = 2, cap: bool = False) -> None:
        self.times = times

    def propose(self, context, k):
        return Draft([context[-1]] * min(k, self.times))


SPEC = DrafterSpec("repeat", "repeats the last token", lambda target, draft_model, **o: RepeatDrafter(**o),
                   options=(Option("times", int, 3, "how many times to repeat (default: 3)"),
                            Option("cap", bool, False, "a switch, to test switches")))


@pytest.fixture
def repeat_registered(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "repeat", SPEC)
    yield SPEC


def test_the_shipped_drafters_are_registered_in_order():
    assert drafter_names() == ("none", "ngram", "suffix", "model", "eagle", "layerskip", "lookahead", "medusa")
    for spec in drafter_specs():
        assert spec.summary and all(o.flag.startswith(spec.name) for o in spec.options), spec.name
        for o in spec.options:
            assert o.help and o.type in (int, float, bool, str)


def test_every_registered_option_is_a_flag_of_generate_audit_and_serve():
    parser = build_parser()
    for command in ("generate", "audit", "serve"):
        argv = [command, "x"] if command == "generate" else [command]
        args = parser.parse_args(argv)
        assert set(drafter_names()) <= set(_choices(parser, command, "drafter"))
        for spec in drafter_specs():
            for o in spec.options:  # a bare command sets every option to its default (switches on by default too)
                assert getattr(args, o.dest) == o.default, (command, o.dest)
            assert options_from(args, spec.name) == {}, (command, spec.name)
        if command == "serve":
            assert ServeOptions.from_args(args).drafter_options == {}  # a bare serve asks for no drafter's options
    assert set(ServeOptions.names()) >= {o.dest for s in drafter_specs() for o in s.options}


def _choices(parser, command, dest):
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if a.dest == dest).choices


def test_a_new_drafter_reaches_the_cli_serve_options_bench_and_the_server(repeat_registered, tiny_target,
                                                                          tiny_dir):
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--drafter", "repeat", "--repeat-times", "5", "--repeat-cap"])
    assert (args.drafter, args.repeat_times, args.repeat_cap) == ("repeat", 5, True)
    assert registry.options_from(args, "repeat") == {"times": 5, "cap": True}

    options = ServeOptions.from_mapping({"drafter": "repeat", "repeat-times": "4", "repeat_cap": "true"})
    assert options.repeat_times == 4 and options.repeat_cap is True
    assert options.changed() == {"drafter": "repeat", "repeat_times": 4, "repeat_cap": True}

    method = build_method("repeat:k=4:times=2", tiny_target, load=None)
    assert method.drafter == "repeat" and method.k == 4
    ids = method.run([5, 6, 7], 6).token_ids
    assert len(ids) == 6

    config = build_server_config(ServeOptions(target=str(tiny_dir), drafter="repeat", drafter_options={
        "repeat_times": 2}))
    assert {"ngram", "repeat"} <= set(config.drafters) and "model" not in config.drafters  # no draft model given
    assert config.drafters["repeat"]().times == 2


def test_unknown_options_name_the_known_ones():
    with pytest.raises(InvalidRequest, match="has no option 'colour'; its options: min_n, max_n, branches"):
        make_drafter("ngram", colour=3)
    with pytest.raises(InvalidRequest, match="unknown drafter 'magic'; choose one of none, ngram"):
        make_drafter("magic")
    with pytest.raises(InvalidRequest, match="takes no options"):
        make_drafter("none", k=3)
    with pytest.raises(InvalidRequest, match="needs a draft model"):
        make_drafter("model")


def test_options_parse_strings_from_specs_and_config_files(repeat_registered):
    times, cap = SPEC.options
    assert times.parse("7", "spec") == 7 and cap.parse("1", "spec") is True and cap.parse("no", "spec") is False
    with pytest.raises(InvalidRequest, match="whole number"):
        times.parse("seven", "spec")
    with pytest.raises(InvalidRequest, match="switch"):
        cap.parse("maybe", "spec")


def test_trees_are_declared_and_refused_where_they_cannot_run(tiny_target):
    ngram = registry.get_spec("ngram")
    assert not ngram.drafts_trees({"branches": 1}) and ngram.drafts_trees({"branches": 3})
    assert make_drafter("ngram", branches=3).tree_depth and make_drafter("ngram").tree_depth is None
    assert registry.get_spec("eagle").drafts_trees({"tree": True})
    with pytest.raises(InvalidRequest, match="--ngram-branches verifies one sequence per pass"):
        ServeOptions(drafter_options={"ngram_branches": 3}).check()
    ServeOptions(max_batch=1, drafter_options={"ngram_branches": 3}).check()


def test_which_drafters_need_the_llama_cpp_callback():
    """Only heads that read layers before the final normed state need llama.cpp's per-pass eval callback (loaded
    with features=True); Medusa and the shipped final-state EAGLE head (the default on llama.cpp) read the final
    state, which llama.cpp returns as its embeddings output."""
    from verispec.eagle.head import HeadConfig
    from verispec.eagle.weights import SHIPPED, SHIPPED_FINAL, resolve_head

    parser = build_parser()
    needs = lambda *argv: registry.needs_layer_callback(parser.parse_args(["generate", "hi", *argv]))  # noqa: E731
    assert not needs("--drafter", "medusa") and not needs("--drafter", "ngram") and not needs("--drafter", "eagle")
    assert needs("--drafter", "eagle", "--eagle-head", "fused")
    assert needs("--drafter", "eagle", "--eagle-head", "/no/such/head")  # unknown: the drafter's own error speaks
    assert resolve_head("smollm2-135m", None, prefer_final=True) == SHIPPED_FINAL["smollm2-135m"]
    assert resolve_head("smollm2-135m", None) == resolve_head("smollm2-135m", "fused", prefer_final=True) \
        == SHIPPED["smollm2-135m"]
    assert resolve_head("smollm2-135m", "final") == SHIPPED_FINAL["smollm2-135m"]
    fused, final = (HeadConfig.load(resolve_head("smollm2-135m", name)) for name in ("fused", "final"))
    assert fused.target_layers == final.target_layers == 30 and final.feature_layers == [30]
    assert fused.reads_inner_layers() and not final.reads_inner_layers()
    assert fused.target_fingerprint == final.target_fingerprint
