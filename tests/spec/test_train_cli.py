"""`weld train-draft`: bad input is one clean line before any model loads; a real run (slow)."""

import json

import pytest

from weld.cli import main
from weld.engine.spec import dspark


def test_bad_input_is_reported_before_loading_the_model(tmp_path, capsys):
    assert main(["train-draft", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "d")]) == 1
    assert "missing.txt: no such file" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    assert main(["train-draft", "--data", str(prompts), "--out", str(tmp_path / "d"), "--target-layers", "1,x"]) == 1
    assert "--target-layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's choices
        main(["train-draft", "--data", str(prompts), "--out", str(tmp_path / "d"), "--features", "later"])
    assert "invalid choice: 'later'" in capsys.readouterr().err
    assert main(["train-draft", "--data", str(prompts), "--out", str(tmp_path / "d"), "--steps", "0"]) == 1
    assert "steps must be >= 1" in capsys.readouterr().err
    for flag, value, needle in (("--samples", "0", "--samples must be >= 1"),
                                ("--draft-vocab", "-1", "--draft-vocab must be >= 0"),
                                ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
                                ("--position-decay", "0", "position_decay must be > 0")):
        assert main(["train-draft", "--data", str(prompts), "--out", str(tmp_path / "d"), flag, value]) == 1
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("features", ["stored", "online"])
def test_train_draft_end_to_end_on_a_tiny_model(tiny_llama_dir, tmp_path, capsys, monkeypatch, features):
    from weld.models.llama import Config

    directory, _ = tiny_llama_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["The quick brown fox", "Paris is the capital of", "def add(a, b):",
                                  "Once upon a time", "Numbers: 0 1 2 3"]) + "\n")
    out = tmp_path / "drafter"
    args = ["train-draft", "--model", str(directory), "--data", str(prompts), "--out", str(out), "--steps", "8",
            "--max-new-tokens", "16", "--k", "3", "--target-layers", "0,1", "--batch-size", "2", "--anchors", "4",
            "--eval-fraction", "0.2", "--save-every", "4", "--draft-vocab", "64", "--features", features]
    # the held-out report is of the drafter as written: a save whose confidence head always says
    # send (bias + 100) shows in it as every draft sent, whatever the trained head says
    real_save = dspark.save

    def lossy_save(directory, params, cfg, metadata=None):
        real_save(directory, {**params, "confidence_bias": params["confidence_bias"] + 100.0}, cfg, metadata)

    monkeypatch.setattr(dspark, "save", lossy_save)
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["final"]["step"] == 7 and len(report["held_out"]["per_position"]) == 3
    assert report["held_out"]["sent"] == 3.0
    params, cfg = dspark.load(out)
    assert cfg.block_size == 3 and cfg.target_layers == (0, 1) and cfg.draft_vocab_size == 64
    cfg.check_target(Config.from_hf(json.loads((directory / "config.json").read_text())))
    assert json.loads((out / "config.json").read_text())["training"]["prompts"] == 5
    assert json.loads((out / "config.json").read_text())["training"]["features"] == features
    assert (out / "data" / "features").exists() == (features == "stored")  # online: nothing stored
    assert (out / "data" / "sequences.jsonl").read_text().count("\n") == 5
    # A rerun finds every stage done: the same drafter, nothing generated or trained again, and
    # no engine built (the target's weights alone feed the features).
    first = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr("weld.engine.llm.LLM.__init__", lambda *a, **k: pytest.fail("an engine was built"))
    assert main(args) == 0
    assert "all 5 answers already generated" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == first
    # --init: a second drafter from the first, on the same answers; its record names where it started
    import shutil

    again = tmp_path / "again"
    shutil.copytree(out / "data", again / "data")
    init_args = [*args, "--init", str(out)]
    init_args[init_args.index("--out") + 1] = str(again)
    assert main(init_args) == 0
    capsys.readouterr()
    assert json.loads((again / "config.json").read_text())["training"]["init"] == str(out)
    assert "init" not in json.loads((out / "config.json").read_text())["training"]
