"""verispec on Ray Serve without a cluster: options, the application's shape, the config file, the shared state."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from verispec.cli import main
from verispec.errors import InvalidRequest
from verispec.ray import (CONTROL_DEPLOYMENT, HEADROOM, SERVER_DEPLOYMENT, RaySwitch, VerispecControl, app_builder,
                          build_app, server_options)


def test_options_take_command_line_names_and_strings_from_serve_run():
    args = server_options({"max-batch": "4", "max_queue": 2, "speculation-off": "true", "drafter": "none",
                           "k_policy": "fixed"})
    assert (args.max_batch, args.max_queue, args.speculation_off, args.drafter, args.k_policy) == (4, 2, True, "none",
                                                                                                  "fixed")
    assert args.k == 8 and args.dtype == "float32"  # the rest at verispec serve's defaults


@pytest.mark.parametrize("options, message", [
    ({"max_batchh": 4}, "unknown verispec serve option 'max_batchh'"),
    ({"max_batch": "four"}, "'four' is not a valid int"),
    ({"drafter": "magic"}, "'magic' is not one of"),
    ({"speculation_off": "maybe"}, "give true or false"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(InvalidRequest, match=message):
        server_options(options)


def test_the_application_maps_the_servers_limits_onto_ray():
    app = build_app(replicas=2, replica_cpus=1, max_batch=4, max_queue=2, drafter="none")
    server = app._bound_deployment
    assert server.name == SERVER_DEPLOYMENT
    config = server._deployment_config
    assert config.num_replicas == 2
    # a replica is sent up to its own capacity plus room for fast answers (its own 429 past the queue)
    assert config.max_ongoing_requests == 4 + 2 + HEADROOM
    assert server.ray_actor_options["num_cpus"] == 1
    options, control, threads, metrics_host = server.init_args
    assert options == {"max_batch": 4, "max_queue": 2, "drafter": "none"} and threads == 1
    assert control._bound_deployment.name == CONTROL_DEPLOYMENT
    assert control._bound_deployment.ray_actor_options["num_cpus"] == 0
    assert control._bound_deployment.init_args == (True,)  # speculation starts on


def test_autoscaling_targets_a_full_batch_per_replica():
    config = build_app(autoscale="1:3", max_batch=6)._bound_deployment._deployment_config
    auto = config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 6)


@pytest.mark.parametrize("argv, message", [
    (["--autoscale", "3:1"], "need 1 <= MIN <= MAX"),
    (["--autoscale", "0:2"], "need 1 <= MIN <= MAX"),
    (["--autoscale", "two"], "takes MIN:MAX"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--max-batch", "4", "--eagle-tree"], "--eagle-tree verifies one sequence per pass"),
    (["--max-batch", "4", "--compile"], "batched passes stay eager. Add --max-batch 1"),
])
def test_bad_ray_flags_fail_before_anything_starts(argv, message, capsys):
    assert main(["serve", "--ray", "--print-config", *argv]) == 2
    assert message in capsys.readouterr().err


def test_replicas_and_autoscale_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--ray", "--replicas", "2", "--autoscale", "1:2"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_print_config_is_a_serve_deploy_file_that_builds_the_same_app(capsys):
    assert main(["serve", "--ray", "--print-config", "--replicas", "2", "--max-batch", "4", "--host", "0.0.0.0",
                 "--admin-token", "secret", "--api-key", "key-1", "--api-key", "key-2", "--drafter", "none"]) == 0
    out = capsys.readouterr().out
    assert "secret" not in out and "key-" not in out  # the admin token and API keys are not written into a file
    config = yaml.safe_load(out)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    (application,) = config["applications"]
    assert application["import_path"] == "verispec.ray:app_builder" and application["route_prefix"] == "/"
    assert application["args"]["replicas"] == 2 and application["args"]["max_batch"] == 4
    # what `serve deploy` will call with those args
    built = app_builder(application["args"])._bound_deployment
    assert built._deployment_config.num_replicas == 2
    assert built.init_args[0] == {"max_batch": 4, "drafter": "none"}
    assert built.init_args[3] == "127.0.0.1"  # replica metrics on loopback unless asked


def test_replicas_get_an_allow_list_of_variables_never_secrets(monkeypatch):
    from verispec.ray import build_app, forwarded_env

    environ = {"VERISPEC_CACHE": "/c", "HF_HOME": "/h", "HF_HUB_OFFLINE": "1", "VERISPEC_ADMIN_TOKEN": "t",
               "VERISPEC_API_KEY": "k", "HF_TOKEN": "hf_secret", "VERISPEC_ANYTHING": "x", "AWS_SECRET": "s"}
    assert forwarded_env(environ) == {"VERISPEC_CACHE": "/c", "HF_HOME": "/h", "HF_HUB_OFFLINE": "1"}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    built = build_app(replicas=1, drafter="none", api_key="k")._bound_deployment
    env = built.ray_actor_options
    forwarded = env["runtime_env"]["env_vars"]
    assert {"VERISPEC_CACHE": "/c", "HF_HOME": "/h"}.items() <= forwarded.items()
    assert not {"VERISPEC_ADMIN_TOKEN", "VERISPEC_API_KEY", "HF_TOKEN", "VERISPEC_ANYTHING", "AWS_SECRET"} & set(forwarded)
    assert built.init_args[0]["api_key"] == "k"  # keys reach replicas as their options, in Ray's object store


def test_control_keeps_the_switch_and_forgets_silent_replicas(monkeypatch):
    control = VerispecControl(speculation=True)
    assert control.get() is True and control.set(False) is False and control.get() is False
    clock = [100.0]
    monkeypatch.setattr("verispec.ray._clock", lambda: clock[0])
    control.register("a", "10.0.0.1:9000")
    control.register("b", "10.0.0.2:9001")
    assert control.targets() == [{"targets": ["10.0.0.1:9000"], "labels": {"replica": "a"}},
                                 {"targets": ["10.0.0.2:9001"], "labels": {"replica": "b"}}]
    clock[0] += 10.0
    control.register("b", "10.0.0.2:9001")  # a keeps silent (its replica died)
    clock[0] += 5.0
    assert control.targets() == [{"targets": ["10.0.0.2:9001"], "labels": {"replica": "b"}}]


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)
        return call()


class _Handle:
    def __init__(self, control=None, fail=False):
        def maybe(fn):
            def wrapped(*args):
                if fail:
                    raise ConnectionError("control is away")
                return fn(*args)
            return wrapped
        self.get = _Remote(maybe(control.get if control else None))
        self.set = _Remote(maybe(control.set if control else None))


def test_switch_reads_the_shared_state_and_keeps_the_last_value_when_it_is_away():
    control = VerispecControl(speculation=True)
    a, b = RaySwitch(_Handle(control), True), RaySwitch(_Handle(control), True)
    assert asyncio.run(a.set(False)) is False
    assert asyncio.run(b.get()) is False  # another replica sees it
    away = RaySwitch(_Handle(fail=True), enabled=False)
    assert asyncio.run(away.get()) is False


@pytest.mark.parametrize("flag, env, expected", [
    (None, None, "local"),           # never None: Ray would join whatever cluster its temp folder last recorded
    (None, "", "local"),
    (None, "10.0.0.5:6379", "10.0.0.5:6379"),
    ("auto", "10.0.0.5:6379", "auto"),  # the flag wins over the environment
])
def test_ray_address_is_the_flag_then_the_environment_then_a_new_local_instance(flag, env, expected, monkeypatch):
    from verispec.cli import build_parser
    from verispec.cli.ray import ray_address

    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    args = build_parser().parse_args(["serve", "--ray", *(["--ray-address", flag] if flag else [])])
    assert ray_address(args) == expected
