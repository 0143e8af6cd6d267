"""The server's sampling defaults: a request that leaves a field out gets the model's
generation_config.json values, else llama.cpp's (`DEFAULT_SAMPLING`), never plain temperature 1."""

from __future__ import annotations

import json
import types

from weld.cli import _model_sampling_defaults
from weld.engine.sampling_params import DEFAULT_SAMPLING, model_sampling_defaults
from weld.server.protocol import CompletionRequest
from weld.server.serving import ServerConfig, sampling_params


def _state(defaults=None):
    config = ServerConfig(served_model_name="m", max_model_len=64)
    if defaults is not None:
        config.sampling_defaults = defaults
    return types.SimpleNamespace(vocab_size=100, config=config)


def _params(body, state):
    return sampling_params(CompletionRequest.model_validate({"prompt": "x", **body}), state, max_tokens=4,
                           logprobs=None, prompt_logprobs=None)


def test_left_out_fields_take_the_defaults_and_given_ones_win():
    p = _params({}, _state())
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05) == tuple(
        DEFAULT_SAMPLING[k] for k in ("temperature", "top_k", "top_p", "min_p"))
    p = _params({"temperature": 0, "top_k": 5}, _state())
    assert (p.temperature, p.top_k, p.top_p) == (0, 5, 0.95)
    model = _state(model_sampling_defaults({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}))
    p = _params({}, model)
    # the model's fields, and the neutral value of what it does not set (not llama.cpp's)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.top_k, p.min_p) == (0.6, 0.9, 1.1, 0, 0.0)


def test_generation_config_read_from_the_model_directory(tmp_path):
    assert _model_sampling_defaults(tmp_path) == DEFAULT_SAMPLING  # none there
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 20,
                                                                 "eos_token_id": 2}))
    assert _model_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert _model_sampling_defaults(tmp_path) == {"temperature": 0.0}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert _model_sampling_defaults(tmp_path) == DEFAULT_SAMPLING
    assert _model_sampling_defaults(tmp_path / "model.gguf") == DEFAULT_SAMPLING  # a file, not a directory
