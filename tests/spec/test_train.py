"""Self-distillation of the drafter on a tiny random llama: the loss falls, checkpoints reload."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.engine.spec import dspark, train
from weld.engine.spec.features import target_hidden_states
from weld.models.family import output_matrix
from weld.models import llama
from weld.models.common.spec import random_weights

TARGET = llama.Config(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
CFG = dspark.DraftConfig.for_target(TARGET, block_size=3, markov_rank=4, intermediate_size=32)


def greedy_continuations(weights, prompts, new_tokens):
    """The target's own greedy continuations (what `weld train-draft` gets from the engine)."""
    tokens = np.zeros((len(prompts), prompts.shape[1] + new_tokens), np.int32)
    tokens[:, :prompts.shape[1]] = prompts
    final_states = jax.jit(lambda w, t: target_hidden_states(llama, w, TARGET, t, (0,))[1])
    for position in range(prompts.shape[1], tokens.shape[1]):
        final = final_states(weights, jnp.asarray(tokens))
        tokens[:, position] = np.argmax(final[:, position - 1] @ output_matrix(weights).T, axis=-1)
    return tokens


def train_and_measure(weights, data, steps, **kwargs):
    """Loss and metrics on a fixed batch of blocks before and after `steps` steps of training."""
    fixed = train.sample_blocks(data, np.arange(len(data)), 8, CFG.block_size, np.random.default_rng(9))
    shared = train.shared_weights(weights)
    measure = jax.jit(lambda p: train.loss_and_metrics(p, fixed, shared, cfg=CFG, train=train.TrainConfig())[1])
    params = dspark.init_params(CFG, seed=0)
    before = measure(params)
    settings = train.TrainConfig(steps=steps, lr=3e-3, warmup=5, batch_size=4, anchors=8)
    trained, history = train.train(params, CFG, weights, data, settings, progress=False, log_every=20)
    return trained, before, measure(trained), history, measure


def test_a_few_steps_lower_the_loss():
    weights = random_weights(llama.weight_specs(TARGET), seed=0, scale=3.0)
    rng = np.random.default_rng(0)
    sequences = rng.integers(0, TARGET.vocab_size, (6, 24))  # any text: the target's distribution is the teacher
    data = train.build_dataset(llama, weights, TARGET, CFG, sequences.tolist(), [5] * 6, progress=False)
    assert data.features.shape == (6, 32, 3 * TARGET.hidden_size)
    params = dspark.init_params(CFG, seed=0, target_weights=weights)  # as `weld train-draft` starts
    settings = train.TrainConfig(steps=60, lr=3e-3, warmup=5, batch_size=4, anchors=8)
    # Each step's metrics are of the params before its update: step 0 measures the fresh drafter.
    _, history = train.train(params, CFG, weights, data, settings, progress=False, log_every=1)
    first, last = history[:3], history[-5:]
    mean = lambda rows, key: np.mean([r[key] for r in rows])  # noqa: E731
    assert mean(last, "loss") < 0.85 * mean(first, "loss"), history
    assert mean(last, "tv") < mean(first, "tv")
    assert np.all(np.isfinite(params["fc"]))  # the caller's params survive training (not donated)


@pytest.mark.slow
def test_self_distillation_on_greedy_text_and_the_checkpoint_reloads(tmp_path):
    weights = random_weights(llama.weight_specs(TARGET), seed=0, scale=3.0)  # peaked, so greedy text has structure
    prompts = np.random.default_rng(0).integers(0, TARGET.vocab_size, (8, 5)).astype(np.int32)
    sequences = greedy_continuations(weights, prompts, 19)
    data = train.build_dataset(llama, weights, TARGET, CFG, sequences.tolist(), [5] * 8, progress=False)
    blocks = train.sample_blocks(data, np.arange(8), 8, CFG.block_size, np.random.default_rng(9))
    # The labels are the target's greedy tokens after each anchor, the previous tokens shifted by one.
    np.testing.assert_array_equal(blocks["prev_tokens"][..., 1:], blocks["labels"][..., :-1])
    assert np.all(blocks["anchor_positions"] >= 4) and np.all(blocks["anchor_positions"] <= 24 - 1 - 3)
    trained, before, after, _, measure = train_and_measure(weights, data, steps=60)
    assert float(after["loss"]) < 0.85 * float(before["loss"]), (before, after)
    assert float(after["ce"]) < float(before["ce"]) and float(after["top1"]) > float(before["top1"])
    report = train.evaluate(trained, CFG, weights, data, num_anchors=4)
    assert 0 <= report["accept_len"] <= CFG.block_size and 0 <= report["sent"] <= CFG.block_size
    dspark.save(tmp_path, trained, CFG)
    reloaded, reloaded_cfg = dspark.load(tmp_path)
    assert reloaded_cfg == CFG
    np.testing.assert_allclose(measure(reloaded)["loss"], after["loss"], rtol=1e-6)


def test_read_prompts_takes_paragraphs_or_lines(tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("first prompt\n\n\nsecond prompt\n")
    assert train.read_prompts(lines) == ["first prompt", "second prompt"]  # blank lines: paragraphs
    lines.write_text("one\ntwo\n  three  \n")
    assert train.read_prompts(lines) == ["one", "two", "three"]
    lines.write_text("a paragraph\nover two lines\n\nanother one\n")
    assert train.read_prompts(lines) == ["a paragraph over two lines", "another one"]
    lines.write_text("\n \n")
    with pytest.raises(Exception, match="no prompts"):
        train.read_prompts(lines)
