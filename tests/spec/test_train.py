"""Self-distillation of the drafter on a tiny random llama: the loss falls, checkpoints reload."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from weld.engine.spec import dspark, train
from weld.engine.spec.features import target_hidden_states
from weld.models.family import output_matrix
from weld.models import llama
from weld.models.common import quant
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
    data = train.build_features(llama, weights, TARGET, CFG, sequences.tolist(), [5] * 6, progress=False)
    assert data.features.shape == (6 * 24, 3 * TARGET.hidden_size)
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
    data = train.build_features(llama, weights, TARGET, CFG, sequences.tolist(), [5] * 8, progress=False)
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
    # drafters are saved with their matrices in Q8_0 blocks and their vectors in f16: the
    # reloaded one is the trained one so rounded
    def as_stored(a):
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.floating):
            return a
        return quant.q8_0_values(*quant.q8_0(a)) if a.ndim == 2 else a.astype(np.float16).astype(np.float32)

    rounded = jax.tree_util.tree_map(as_stored, trained)
    np.testing.assert_allclose(measure(reloaded)["loss"], measure(rounded)["loss"], rtol=1e-5)
    np.testing.assert_allclose(measure(reloaded)["loss"], after["loss"], rtol=2e-2)


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


def test_prompt_files_are_read_one_after_another(tmp_path):
    from weld.engine.spec import distill

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one\ntwo\n")
    second.write_text("a paragraph\nover two lines\n\nanother one\n")
    assert distill.read_prompt_files([second, first]) == ["a paragraph over two lines", "another one", "one", "two"]
    assert distill.read_prompt_files(str(first)) == ["one", "two"]
    with pytest.raises(Exception, match="no such file"):
        distill.read_prompt_files([first, tmp_path / "missing.txt"])


def tiny_data(tmp_path=None, seed=0):
    weights = random_weights(llama.weight_specs(TARGET), seed=seed, scale=3.0)
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(0, TARGET.vocab_size, n).tolist() for n in (24, 31, 17, 40, 22, 9)]
    directory = None if tmp_path is None else tmp_path / "features"
    return weights, sequences, train.build_features(llama, weights, TARGET, CFG, sequences, [5] * 6,
                                                    directory=directory, progress=False)


def test_features_and_teacher_are_the_targets_own_per_answer(tmp_path):
    """Each answer's rows hold the target's features and its top next-token distribution over
    that answer alone (answers of different lengths, batched with padding); a memory-mapped
    build equals the in-memory one."""
    weights, sequences, data = tiny_data()
    assert len(data) == 6  # the 9-token answer has a continuation of 4 >= k + 1 = 4
    head = np.asarray(output_matrix(weights), np.float64)
    for i, seq in enumerate(sequences):
        features, final = target_hidden_states(llama, weights, TARGET, jnp.asarray([seq]), CFG.target_layers)
        np.testing.assert_allclose(data.features[data.offsets[i]:data.offsets[i] + len(seq)], features[0],
                                   rtol=2e-2, atol=2e-2)  # stored as f16
        logits = np.asarray(final[0], np.float64) @ head.T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        rows = slice(data.offsets[i], data.offsets[i] + len(seq))
        np.testing.assert_array_equal(data.teacher_ids[rows, 0], probs.argmax(-1))
        np.testing.assert_allclose(data.teacher_probs[rows].astype(np.float64),
                                   np.take_along_axis(probs, data.teacher_ids[rows], -1), atol=2e-3)
    _, _, mapped = tiny_data(tmp_path)
    np.testing.assert_array_equal(mapped.teacher_ids, data.teacher_ids)
    np.testing.assert_array_equal(mapped.features, data.features)


def test_a_draft_vocabulary_scores_its_own_tokens_and_equals_the_full_loss_when_whole():
    """The draft vocabulary is the most frequent continuation tokens; the loss over it places each
    label and teacher token on its row, and equals the full-vocabulary loss when it holds every
    token; drafts under a small one come from it."""
    import dataclasses

    weights, _, data = tiny_data()
    counts = np.bincount(np.concatenate([data.answer(i)[5:] for i in range(len(data))]), minlength=TARGET.vocab_size)
    vocab = train.draft_vocabulary(data, 10, TARGET.vocab_size)
    assert np.all(np.diff(vocab) > 0) and len(vocab) == 10
    assert counts[vocab].min() >= np.delete(counts, vocab).max()  # the most frequent ones
    every = np.arange(TARGET.vocab_size, dtype=np.int32)
    whole = dataclasses.replace(CFG, draft_vocab_size=TARGET.vocab_size)
    params = dspark.init_params(CFG, seed=3, target_weights=weights)
    full = train.sample_blocks(data, np.arange(4), 6, CFG.block_size, np.random.default_rng(1))
    placed = train.sample_blocks(data, np.arange(4), 6, CFG.block_size, np.random.default_rng(1),
                                 vocab_place=train.vocab_places(every[::-1].copy(), TARGET.vocab_size))
    np.testing.assert_array_equal(placed["label_index"], TARGET.vocab_size - 1 - full["labels"])
    reversed_params = {**params, "markov_out": params["markov_out"][::-1]}
    loss = lambda p, batch, cfg, vocab: float(train.loss_and_metrics(  # noqa: E731
        p, batch, train.shared_weights(weights, vocab), cfg=cfg, train=train.TrainConfig())[0])
    assert loss(reversed_params, placed, whole, every[::-1].copy()) == pytest.approx(
        loss(params, full, CFG, None), rel=1e-5)
    small = dataclasses.replace(CFG, draft_vocab_size=10)
    trained, _ = train.train(dspark.init_params(small, seed=0, target_weights=weights), small, weights, data,
                             train.TrainConfig(steps=3, batch_size=2, anchors=4), progress=False, draft_vocab=vocab)
    served = dspark.serving_params({**trained, "draft_vocab": jnp.asarray(vocab)}, small, weights)
    batch = train.sample_blocks(data, np.asarray([0]), 4, CFG.block_size, np.random.default_rng(2))
    proposal = train._draft_blocks(served, train.shared_weights(weights), np.repeat(batch["features"], 4, axis=0),
                                   np.repeat(batch["ctx_positions"], 4, axis=0), batch["anchor_tokens"][0],
                                   batch["anchor_positions"][0], cfg=small)
    assert set(np.asarray(proposal.tokens).reshape(-1).tolist()) <= set(vocab.tolist())


def test_slot_weights_decay_and_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Slot j weighs exp(-j / 4); a run interrupted after its checkpoint and run again ends where
    an uninterrupted run ends (same data order, same optimizer state and schedule)."""
    w = train.TrainConfig().slot_weights(3)
    np.testing.assert_allclose(w / w[0], np.exp(-np.arange(3) / 4.0), rtol=1e-6)
    assert w.sum() == pytest.approx(1.0)
    weights, _, data = tiny_data()
    params = dspark.init_params(CFG, seed=0, target_weights=weights)
    settings = train.TrainConfig(steps=6, lr=3e-3, warmup=2, batch_size=2, anchors=4, save_every=3)
    whole, _ = train.train(params, CFG, weights, data, settings, progress=False)

    make_step = train.make_train_step

    def interrupted(*args):  # the 5th step is cut short, after the checkpoint at step 3
        step, calls = make_step(*args), []

        def run(*a):
            calls.append(1)
            if len(calls) == 5:
                raise KeyboardInterrupt
            return step(*a)
        return run

    checkpoint = train.Checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(train, "make_train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.train(params, CFG, weights, data, settings, progress=False, checkpoint=checkpoint, settings={"run": 1})
    monkeypatch.setattr(train, "make_train_step", make_step)
    resumed, history = train.train(params, CFG, weights, data, settings, progress=False, checkpoint=checkpoint,
                                   settings={"run": 1}, log_every=1)
    assert [h["step"] for h in history][-3:] == [3, 4, 5]
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="other settings"):
        train.train(params, CFG, weights, data, settings, progress=False, checkpoint=checkpoint, settings={"run": 2})


def test_features_gathered_on_the_device_train_as_those_sent_from_the_host(monkeypatch):
    """Where the device holds the features (an accelerator), each step gathers its rows there:
    the same batches, so the same losses, as gathering them on the host (which sends them f16,
    as stored)."""
    weights = random_weights(llama.weight_specs(TARGET), seed=0, scale=3.0)
    sequences = np.random.default_rng(0).integers(0, TARGET.vocab_size, (6, 24))
    data = train.build_features(llama, weights, TARGET, CFG, sequences.tolist(), [5] * 6, progress=False)
    settings = train.TrainConfig(steps=6, lr=3e-3, warmup=2, batch_size=3, anchors=4)
    params = dspark.init_params(CFG, seed=0, target_weights=weights)
    gathered, gather, resident = [], train.gather_features, train.resident_features
    monkeypatch.setattr(train, "gather_features", lambda *a, **k: gathered.append(k.get("dtype")) or gather(*a, **k))
    _, on_host = train.train(params, CFG, weights, data, settings, progress=False, log_every=1)
    assert gathered == [np.float16] * settings.steps  # sent as stored (half the bytes of f32), one a step
    monkeypatch.setattr(train, "gather_features", gather)
    sent = []  # laid out as resident_features lays them: columns padded, slabs of 5 rows (the last one short)
    monkeypatch.setattr(train, "free_device_memory", lambda: 1 << 40)  # as an accelerator says
    monkeypatch.setattr(train, "resident_features",
                        lambda f, room: sent.append((f.shape, room)) or train.padded_on_device(f, train.LANES, rows_per_copy=5))
    _, on_device = train.train(params, CFG, weights, data, settings, progress=False, log_every=1)
    assert [shape for shape, _ in sent] == [data.features.shape]
    assert 0 < (1 << 40) - sent[0][1] < 1 << 30  # room: what is free less the step's own memory
    assert [r["loss"] for r in on_device] == pytest.approx([r["loss"] for r in on_host], rel=1e-5)
    features = np.ones((10, 100), np.float16)  # 10 x 128 x 2 bytes laid out
    assert resident(features, 2560 + train.RESIDENT_MARGIN).shape[1] == train.LANES
    assert resident(features, 2559 + train.RESIDENT_MARGIN) is None  # the host gathers
    rows = np.asarray([[2, -1], [0, 5]])
    np.testing.assert_array_equal(np.asarray(train.gather_features(jnp.asarray(data.features), rows)),
                                  train.gather_features(data.features, rows))
    assert not train.gather_features(data.features, rows)[0, 1].any()  # padding is zeros


@pytest.mark.parametrize("vocab_size", [0, 10])
def test_online_training_runs_the_target_in_each_step_and_trains_as_stored_features_do(vocab_size):
    """`train_draft(features="online")`: a data set of the answers alone (`token_dataset`), the
    target run inside each step (`online_teacher`): the same batches as the stored features
    give, so the same losses step after step (with and without a draft vocabulary, whose rows
    the teacher's tokens are placed on); without the target's family it is refused."""
    import dataclasses

    weights, sequences, stored = tiny_data()
    online = train.token_dataset(sequences, [5] * 6, CFG.block_size)
    assert online.features is None and np.array_equal(online.tokens, stored.tokens)
    cfg = dataclasses.replace(CFG, draft_vocab_size=vocab_size)
    vocab = train.draft_vocabulary(stored, vocab_size, TARGET.vocab_size) if vocab_size else None
    settings = train.TrainConfig(steps=6, lr=3e-3, warmup=2, batch_size=3, anchors=4)
    params = dspark.init_params(cfg, seed=0, target_weights=weights)
    _, from_stored = train.train(params, cfg, weights, stored, settings, progress=False, log_every=1, draft_vocab=vocab)
    _, from_online = train.train(params, cfg, weights, online, settings, progress=False, log_every=1, draft_vocab=vocab,
                                 target=(llama, TARGET))
    for key in ("loss", "tv", "ce", "top1"):
        assert [r[key] for r in from_online] == pytest.approx([r[key] for r in from_stored], rel=1e-4, abs=1e-6), key
    with pytest.raises(ValueError, match="pass target"):
        train.train(params, cfg, weights, online, settings, progress=False, draft_vocab=vocab)
    with pytest.raises(ValueError, match="pass target"):
        train.train(params, cfg, weights, stored, settings, progress=False, draft_vocab=vocab, target=(llama, TARGET))


def test_target_features_are_computed_at_full_matmul_precision():
    """The teacher's program asks for HIGHEST precision on its matrix products (a TPU's default
    multiplies f32 in one bf16 pass), so the features are the model's on any machine."""
    weights = random_weights(llama.weight_specs(TARGET), seed=0, scale=3.0)
    lowered = jax.jit(lambda w, t: train._teacher(llama, w, TARGET, t, layers=(0, 1), top=4)).lower(
        weights, jnp.zeros((2, 64), jnp.int32))
    dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
    assert len(dots) >= 2 * TARGET.num_layers
    assert all("HIGHEST" in line for line in dots), [line for line in dots if "HIGHEST" not in line]


def test_a_saved_drafter_is_a_starting_point_of_the_same_shape_and_vocabulary(tmp_path):
    """`--init DIR`: training starts from a saved drafter; one of another shape or draft
    vocabulary is refused with a message naming what differs."""
    from weld.utils.errors import InvalidInputError

    cfg = dspark.DraftConfig.for_target(TARGET, block_size=3, markov_rank=4, intermediate_size=32, draft_vocab_size=16)
    vocab = np.arange(0, 32, 2, dtype=np.int32)
    params = dspark.init_params(cfg, seed=3)
    dspark.save(tmp_path, {**params, dspark.VOCAB_TENSOR: jnp.asarray(vocab)}, cfg)
    start = train.starting_params(tmp_path, cfg, vocab)
    assert dspark.VOCAB_TENSOR not in start
    np.testing.assert_array_equal(start["fc"], quant.q8_0_values(*quant.q8_0(np.asarray(params["fc"]))))  # as stored
    with pytest.raises(InvalidInputError, match="block_size"):
        train.starting_params(tmp_path, dataclasses.replace(cfg, block_size=4), vocab)
    with pytest.raises(InvalidInputError, match="draft vocabulary"):
        train.starting_params(tmp_path, cfg, vocab + 1)


def test_a_torn_drafter_file_is_a_clear_error(tmp_path):
    """A drafter whose weights file is cut off is refused naming the file (`--init`, `--draft`)."""
    from weld.utils.errors import InvalidInputError

    cfg = dspark.DraftConfig.for_target(TARGET, block_size=3, markov_rank=4, intermediate_size=32)
    dspark.save(tmp_path, dspark.init_params(cfg, seed=3), cfg)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        dspark.load(tmp_path)
    with pytest.raises(InvalidInputError, match="--init"):
        train.read_init(tmp_path)


@pytest.mark.parametrize("shape,k,chunk", [((3, 5, 1000), 32, 128), ((4, 49152 // 64), 32, 8), ((2, 300), 1, 16),
                                            ((2, 64), 8, 16)])
def test_top_k_by_chunks_is_lax_top_k(shape, k, chunk):
    """The teacher's top-k from the k chunks of largest maxima equals `lax.top_k`, values and
    indices, with a last chunk cut short (1,000 = 7 x 128 + 104), one draft slot (k = 1), and
    as many chunks as k or fewer (lax.top_k itself)."""
    x = jnp.asarray(np.random.default_rng(sum(shape)).standard_normal(shape), jnp.float32)
    want = jax.lax.top_k(x, k)
    got = train.top_k_by_chunks(x, k, chunk)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_features_lie_on_the_device_padded_to_whole_lanes_and_gather_as_stored():
    """`padded_on_device`: the array in the top-left corner, zeros to the right and below, rows
    and columns rounded up (slabs of 4 rows, the last one short); gathered with `columns`, the
    rows equal the host's gather of the unpadded array."""
    features = np.random.default_rng(0).standard_normal((10, 12)).astype(np.float16)
    placed = np.asarray(train.padded_on_device(features, 8, rows_per_copy=4))
    assert placed.shape == (12, 16)
    np.testing.assert_array_equal(placed[:10, :12], features)
    assert not placed[10:].any() and not placed[:, 12:].any()
    rows = np.asarray([[9, 0, -1], [3, 3, 7]])
    np.testing.assert_array_equal(np.asarray(train.gather_features(jnp.asarray(placed), rows, columns=12)),
                                  train.gather_features(features, rows))


@pytest.mark.parametrize("chat", [True, False])
def test_answers_from_one_fixed_program_are_the_engines(tiny_llama_dir, tmp_path, monkeypatch, chat):
    """`distill.generate_fixed` (what train-draft uses on an accelerator): the same greedy answers,
    prompt ids and the stop token included, as the engine writes, chat or raw, with a last batch
    of padding rows (5 prompts, 2 rows a call); a rerun keeps them and makes none; a prompt too
    long for the model's positions is refused before anything runs. The tiny model never says
    its EOS, so a token it does say stops it too (the tokenizer's EOS ids, for both paths)."""
    from weld import LLM
    from weld.engine.spec import distill
    from weld.utils.errors import InvalidInputError

    directory, _ = tiny_llama_dir
    prompts = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "Once upon a time", "Numbers: 0 1 2"]
    family, weights, cfg, _, tokenizer = train.load_target(str(directory), "float32")
    free = distill.generate_fixed(family, weights, cfg, tokenizer, prompts, tmp_path / "free", max_new_tokens=24,
                                  chat=chat, rows=2, progress=False)
    said = [t for a in free for t in a.tokens[a.prompt_length + 3:]]
    stop = max(set(said), key=said.count)  # the model's most frequent token after its first three
    import weld.engine.llm as llm_module

    load_tokenizer = llm_module.load_tokenizer

    def stopping_at(loaded):
        tokenizer = load_tokenizer(loaded)
        tokenizer.eos_token_ids = (2, stop)
        return tokenizer

    monkeypatch.setattr(llm_module, "load_tokenizer", stopping_at)
    family, weights, cfg, _, tokenizer = train.load_target(str(directory), "float32")
    assert tokenizer.eos_token_ids == (2, stop)
    llm = LLM(str(directory), max_num_seqs=4, max_model_len=256, progress=False)
    want = distill.generate(llm, prompts, tmp_path / "engine", max_new_tokens=24, chat=chat, progress=False)
    got = distill.generate_fixed(family, weights, cfg, tokenizer, prompts, tmp_path / "fixed", max_new_tokens=24,
                                 chat=chat, rows=2, progress=False)
    assert got == want
    stopped = [a for a in got if len(a.tokens) - a.prompt_length < 24]
    assert stopped and all(a.tokens[-1] == stop for a in stopped)
    logged = []
    again = distill.generate_fixed(family, weights, cfg, tokenizer, prompts, tmp_path / "fixed", max_new_tokens=24,
                                   chat=chat, rows=2, progress=False, log=logged.append)
    assert again == want
    assert logged == [f"{tmp_path / 'fixed' / distill.SEQUENCES_FILE}: 5 answers already generated, 0 to go"]
    with pytest.raises(InvalidInputError, match="exceeds the model's 256 positions"):
        distill.generate_fixed(family, weights, cfg, tokenizer, ["word " * 300], tmp_path / "long", max_new_tokens=8,
                               chat=chat, rows=2, progress=False)
    with pytest.raises(InvalidInputError, match="use fewer rows"):  # the cache is bounded before it is made
        distill.generate_fixed(family, weights, cfg, tokenizer, prompts, tmp_path / "wide", max_new_tokens=8,
                               chat=chat, rows=10**8, progress=False)
    assert distill.read_sequences(tmp_path / "wide" / distill.SEQUENCES_FILE) == []  # nothing written


def test_train_draft_takes_its_answers_from_the_fixed_program_where_asked(tiny_llama_dir, tmp_path, monkeypatch):
    """train_draft(fixed_answers=True) (the default on an accelerator) builds no engine: the
    target's weights make the answers and then the features; sampled answers need the engine."""
    from weld.engine.spec import distill
    from weld.utils.errors import InvalidInputError

    directory, _ = tiny_llama_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nParis is the capital of\ndef add(a, b):\nOnce upon a time\n")
    monkeypatch.setattr("weld.engine.llm.LLM.__init__", lambda *a, **k: pytest.fail("an engine was built"))
    settings = train.TrainConfig(steps=2, batch_size=2, anchors=4, save_every=2)
    overrides = dict(block_size=3, target_layers=(0, 1), draft_vocab_size=0)
    summary = train.train_draft(str(directory), str(prompts), str(tmp_path / "d"), train_cfg=settings,
                                draft_overrides=overrides, max_new_tokens=12, eval_fraction=0.25, progress=False,
                                log=lambda *a: None, fixed_answers=True, engine_args={"max_num_seqs": 3})
    assert summary["answers"] == 4 and summary["final"]["step"] == 1
    assert len(distill.read_sequences(tmp_path / "d" / "data" / distill.SEQUENCES_FILE)) == 4
    with pytest.raises(InvalidInputError, match="greedy only"):
        train.train_draft(str(directory), str(prompts), str(tmp_path / "e"), train_cfg=settings, samples=2,
                          draft_overrides=overrides, max_new_tokens=12, progress=False, log=lambda *a: None,
                          fixed_answers=True)
