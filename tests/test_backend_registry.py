"""The backend registry: a backend is one module (its target class, a load function, one ``register(BackendSpec(...))``
call). A fake backend registered here reaches ``load_model``, the command line, the server, Ray Serve's options and
bench method specs without an edit to any of them; options a backend does not take are refused by name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from verispec.backends import entry_options, load_model, registry
from verispec.backends.registry import BackendSpec
from verispec.errors import InvalidRequest
from verispec.options import Option

from test_bench import last_json, tiny_prompts  # noqa: F401 (a fixture)


@pytest.fixture
def echo_backend():
    """"echo": the transformers model under another backend name, with an option of its own; records each load."""
    from verispec.backends.hf import LoadedModel, load

    class EchoModel(LoadedModel):
        backend = "echo"

    loads = []

    def load_echo(ref, echo_note="", threads=None):
        loads.append({"ref": ref, "echo_note": echo_note, "threads": threads})
        model = load(ref)
        model.__class__ = EchoModel
        return model

    registry.register(BackendSpec(
        "echo", summary="the transformers model under another name (a test)", load=load_echo,
        options=(Option("echo_note", str, "", "a note each load records", metavar="TEXT"),
                 Option("threads", int, None, "threads it would run"))))
    yield loads
    registry.unregister("echo")


def test_load_model_runs_a_registered_backend_with_its_options(echo_backend, tiny_dir):
    model = load_model(str(tiny_dir), backend="echo", echo_note="hello", threads=2)
    assert model.backend == "echo" and echo_backend == [{"ref": str(tiny_dir), "echo_note": "hello", "threads": 2}]
    # options of the other backends, unset, pass by (a caller may hold every backend's options at once)
    load_model(str(tiny_dir), backend="echo", dtype="float32", weights="as-is", compiled="auto", static_widths=None)
    with pytest.raises(InvalidRequest, match=r"echo_note \(--echo-note\) applies to the echo backend, not "
                                             r"transformers .* choose --backend echo"):
        load_model(str(tiny_dir), echo_note="hello")
    with pytest.raises(InvalidRequest, match=r"dtype \(--dtype\) applies to the transformers backend, not echo"):
        load_model(str(tiny_dir), backend="echo", dtype="bfloat16")
    with pytest.raises(InvalidRequest, match="unknown backend 'nope'; choose one of auto, transformers, .*echo"):
        load_model(str(tiny_dir), backend="nope")
    with pytest.raises(InvalidRequest, match=r"min_width \(--min-width\) applies to the openvino backend"):
        load_model(str(tiny_dir), min_width=0)  # 0 is a value (too small), not "unset" as False and None are
    with pytest.raises(InvalidRequest, match="unknown load option 'colour'"):
        load_model(str(tiny_dir), backend="echo", colour="red")


def test_a_shared_option_must_mean_the_same_everywhere():
    with pytest.raises(ValueError, match="declares option 'threads' unlike"):
        registry.register(BackendSpec("odd", "", load=lambda ref, threads=1: None,
                                      options=(Option("threads", int, 1, "other default"),)))
    assert "odd" not in registry.backend_names()


def test_the_command_line_offers_it_and_generates_on_it(echo_backend, tiny_dir, capsys):
    from verispec.cli import build_parser, main

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(generate.format_help().split())
    assert "--echo-note TEXT" in help_text and "echo (the transformers model under another name" in help_text
    assert entry_options()["threads"].help.count(": ") >= 4  # one --threads: each backend says what it means there
    args = ["generate", "one two three one two three", "--target", str(tiny_dir), "--raw", "--json",
            "--max-new-tokens", "8"]
    assert main([*args, "--backend", "transformers"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--backend", "echo", "--echo-note", "from the CLI"]) == 0
    echoed = json.loads(capsys.readouterr().out)
    assert echoed["token_ids"] == plain["token_ids"] and echo_backend[-1]["echo_note"] == "from the CLI"
    assert main([*args, "--backend", "transformers", "--echo-note", "x"]) == 2
    assert "echo_note (--echo-note) applies to the echo backend" in capsys.readouterr().err


def test_the_server_and_ray_options_take_it(echo_backend, tiny_dir):
    from verispec.server.config import ServeOptions, build_server_config

    options = ServeOptions.from_mapping({"target": str(tiny_dir), "backend": "echo", "echo-note": "served",
                                         "drafter": "ngram"})
    assert options.echo_note == "served" and options.changed()["echo_note"] == "served"
    config = build_server_config(options)
    assert config.target.backend == "echo" and echo_backend[-1]["echo_note"] == "served"
    assert "ngram" in config.drafters
    with pytest.raises(InvalidRequest, match="unknown verispec serve option 'echo-notes'"):
        ServeOptions.from_mapping({"echo-notes": "x"})
    copy = replace(options, backend="transformers")
    copy.threads = 1  # a Ray replica sets its threads on the options it was given: never on the ones copied from
    assert copy.threads == 1 and options.threads is None and "threads" not in options.backend_options


def test_a_bench_method_spec_takes_its_options(echo_backend, tiny_dir, tiny_prompts, tmp_path, capsys):
    from verispec.cli import main

    code = main(["bench", "--target", str(tiny_dir), "--prompts", str(tiny_prompts), "--max-new-tokens", "6",
                 "--limit", "1", "--no-plots", "--no-quality", "--backend", "transformers",
                 "--methods", "baseline,ngram:backend=echo:echo_note=benched", "--out", str(tmp_path / "b")])
    assert code == 0
    result = last_json(capsys.readouterr().out)
    assert result["overall"]["ngram:backend=echo:echo_note=benched"]["identical"] == 1.0
    assert echo_backend[-1]["echo_note"] == "benched"


def test_spec_keywords_fill_defaults_and_check_choices():
    spec = BackendSpec("x", "", load=lambda ref, **kw: kw,
                       options=(Option("mode", str, "a", "", choices=("a", "b")), Option("n", int, None, "")))
    assert spec.options[0].flag == "mode" and spec.keywords({}) == {"mode": "a", "n": None}
    assert spec.build("ref", mode="b") == {"mode": "b", "n": None}
    with pytest.raises(InvalidRequest, match=r"the x backend's mode \(--mode\) takes a, b, not 'c'"):
        spec.keywords({"mode": "c"})
    assert replace(spec, name="y").name == "y"
