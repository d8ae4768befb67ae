"""A server on a built-in target offers its sibling draft model to requests without loading it at start: the first
request that drafts with it loads it, once; a server whose default drafter drafts with it loads it at start."""

from __future__ import annotations

import verispec.backends
from verispec.server import config as server_config
from verispec.server.config import ServeOptions, build_server_config


def test_the_sibling_draft_loads_on_first_use_only(tiny_dir, monkeypatch):
    loads = []
    real = verispec.backends.load_model

    def counting(ref, **options):
        loads.append(ref)
        return real(ref, **options)

    monkeypatch.setattr(verispec.backends, "load_model", counting)
    monkeypatch.setattr(server_config, "default_draft", lambda target: str(tiny_dir))  # its "sibling": itself
    config = build_server_config(ServeOptions.from_mapping({"target": str(tiny_dir), "backend": "transformers",
                                                            "drafter": "ngram"}))
    assert loads == [str(tiny_dir)]  # the target alone
    assert "model" in config.drafters
    first, second = config.drafters["model"](), config.drafters["model"]()
    assert first is not second and loads == [str(tiny_dir)] * 2  # the draft, once for both
    loads.clear()
    build_server_config(ServeOptions.from_mapping({"target": str(tiny_dir), "backend": "transformers",
                                                   "drafter": "model"}))
    assert loads == [str(tiny_dir)] * 2  # the default drafter needs it: loaded at start


def test_a_slot_builds_the_deferred_drafters_decoder_on_its_first_request_for_it(tiny_dir, monkeypatch):
    from verispec.server.app import Server

    monkeypatch.setattr(server_config, "default_draft", lambda target: str(tiny_dir))
    config = build_server_config(ServeOptions.from_mapping({"target": str(tiny_dir), "backend": "transformers",
                                                            "drafter": "ngram"}))
    assert config.deferred == {"model"}
    slot = Server(config)._make_slot()
    assert "ngram" in slot and "model" not in slot  # built at start / not yet
    decoder = slot["model"]
    assert slot["model"] is decoder and decoder.drafter is not None
    prompt = "The committee approved the budget"
    assert decoder.generate(prompt, max_new_tokens=8).token_ids == slot["none"].generate(prompt,
                                                                                       max_new_tokens=8).token_ids
