"""Structured outputs: grammar-constrained decoding (llguidance) through the LLM API.

The tiny model is random, so unconstrained it writes garbage: an output that parses and
validates can only come from the token mask. Sampling is at temperature 1 with several seeds.
Most JSON cases disable free whitespace: a random model given the choice spends most of its
tokens on it (one test keeps it on).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from weld import LLM, SamplingParams
from weld.engine.sampling_params import StructuredOutputsParams
from weld.engine.scheduler import Scheduler
from weld.engine.block_manager import BlockManager
from weld.engine.sequence import Sequence
from weld.engine.structured import bitmask_width
from weld.utils.errors import InvalidInputError

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "name"], "properties": {
            "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 6}}},
        "active": {"type": "boolean"}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
        "count": {"enum": [1, 2, 3]}}},
    "array": {"type": "array", "minItems": 2, "maxItems": 5,
              "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    "bounds": {"type": "object", "additionalProperties": False, "required": ["score", "count", "temp"], "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": 10, "maximum": 20},
        "temp": {"type": "integer", "exclusiveMinimum": -5, "maximum": -1}}},
    "required": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "string", "maxLength": 4},
        "d": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 2}}},
}
SEEDS = (0, 1, 2)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    return LLM(model=str(directory), dtype="float32", max_model_len=256, kv_cache_memory_gb=0.01, steps_per_call=4)


def constrained(seed: int, temperature: float = 1.0, max_tokens: int = MAX_TOKENS, **spec) -> SamplingParams:
    if "json" in spec:
        spec.setdefault("disable_any_whitespace", True)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**spec))


def assert_no_leaks(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
    assert not llm.engine.requests
    assert llm.engine.stats()["num_grammar_matchers"] == 0


def test_json_schemas_validate(llm):
    """Five schemas x three seeds, all in one continuously batched run."""
    cases = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    params = [constrained(seed, json=SCHEMAS[name]) for name, seed in cases]
    outs = llm.generate(["The quick brown fox"] * len(cases), params)
    texts = set()
    for (name, seed), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, seed, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
        texts.add(c.text)
    assert len(texts) > len(SCHEMAS)  # seeds give different outputs: this is sampling, not one path
    assert_no_leaks(llm)


def test_schema_as_json_text_and_whitespace(llm):
    schema = SCHEMAS["array"]
    params = [constrained(s, json=json.dumps(schema)) for s in (5, 6)]
    params += [constrained(s, json=schema, disable_any_whitespace=False, max_tokens=240) for s in (5, 6)]
    outs = [o.outputs[0].text for o in llm.generate(["x"] * 4, params)]
    for text in outs:
        jsonschema.validate(json.loads(text), schema)
    assert not any(re.search(r"\s", text) for text in outs[:2]), outs
    assert all(re.search(r"\s", text) for text in outs[2:]), outs  # free whitespace is the default


def test_unconstrained_output_does_not_validate(llm):
    """The planted-bug check: the same requests without the constraint produce invalid JSON,
    so the validations above test the mask, not the model."""
    outs = llm.generate(["The quick brown fox"] * len(SEEDS),
                        [SamplingParams(max_tokens=60, temperature=1.0, seed=s) for s in SEEDS])
    for out in outs:
        with pytest.raises(ValueError):  # json.JSONDecodeError
            json.loads(out.outputs[0].text)


def test_without_the_mask_the_grammar_rejects_the_token(llm, monkeypatch, caplog):
    """If the engine forgot to send the mask, the matcher catches the stray token loudly: the
    request ends ("abort", logged) and the engine keeps serving the others."""
    monkeypatch.setattr(llm.engine, "_token_bitmask", lambda plan, owners: None)
    params = [constrained(0, json=SCHEMAS["nested"]), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    broken, plain = llm.generate(["The quick brown fox"] * 2, params)
    monkeypatch.undo()
    assert broken.outputs[0].finish_reason == "abort"
    assert "grammar does not allow it" in caplog.text
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 5
    assert_no_leaks(llm)


def test_regex_choice_and_grammar(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]?)?"
    choices = ["Paris", "London", "fox jumps over"]
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    params = ([constrained(s, regex=regex) for s in SEEDS] + [constrained(s, choice=choices) for s in SEEDS]
              + [constrained(s, grammar=lark) for s in SEEDS] + [constrained(s, json_object=True, max_tokens=200,
                                                                             temperature=0.0) for s in (0,)])
    outs = [o.outputs[0] for o in llm.generate(["Once upon a time"] * len(params), params)]
    for c in outs[:3]:
        assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c.text
    for c in outs[3:6]:
        assert c.text in choices and c.finish_reason == "stop", c.text
    for c in outs[6:9]:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.text), c.text
    json_object = outs[9]
    if json_object.finish_reason == "stop":  # a random model may write a long object
        assert isinstance(json.loads(json_object.text), dict)
    else:
        assert json_object.text.lstrip().startswith("{")
    assert_no_leaks(llm)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    """A constrained request (one token per call) next to an unconstrained one (fused steps):
    each one's greedy output equals its output alone."""
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    bound = constrained(0, temperature=0.0, json=SCHEMAS["array"])
    prompts = ["def add(a, b):", "The quick brown fox"]
    alone = [llm.generate(p, sp)[0].outputs[0] for p, sp in zip(prompts, (free, bound))]
    together = [o.outputs[0] for o in llm.generate(prompts, [free, bound])]
    assert together[0].token_ids == alone[0].token_ids
    assert together[1].token_ids == alone[1].token_ids
    jsonschema.validate(json.loads(together[1].text), SCHEMAS["array"])
    assert_no_leaks(llm)


def test_n_greater_than_one_and_abort(llm):
    out = llm.generate("Paris", SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                                               structured_outputs={"json": SCHEMAS["bounds"],
                                                                   "disable_any_whitespace": True}))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["bounds"])
    engine = llm.engine
    engine.add_request("abort-me", llm.tokenizer.encode("Paris"), constrained(1, json=SCHEMAS["nested"]))
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_grammar_matchers"] == 1
    engine.abort("abort-me")
    assert_no_leaks(llm)


@pytest.mark.parametrize("spec,match", [
    (dict(regex="a(b"), "regex is invalid"),
    (dict(json={"type": "frobnicate"}), "json is invalid"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(grammar="start: missing_rule"), "grammar is invalid"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(), "exactly one"),
    (dict(choice="ab"), "list"),
])
def test_invalid_specs_are_input_errors(spec, match):
    with pytest.raises(InvalidInputError, match=match):
        SamplingParams(structured_outputs=spec)


def test_scheduler_gives_constrained_rows_one_step():
    """Pure Python: in a fused decode a constrained sequence gets max_steps 1, the others keep theirs."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, steps_per_call=8)
    free = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=32))
    bound = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=32, structured_outputs={"regex": "[ab]+"}))
    for seq in (free, bound):
        sched.add(seq)
    plan = sched.schedule()
    assert plan.kind == "prefill"
    for e in plan.entries:
        e.seq.num_computed_tokens = e.start + e.num_tokens
        e.seq.output_token_ids.append(5)
    plan = sched.schedule()
    assert plan.kind == "decode"
    steps = {e.seq.request_id: e.max_steps for e in plan.entries}
    assert steps == {"a": 8, "b": 1}


def test_bitmask_pads_the_model_vocab(llm):
    """A model vocabulary wider than the tokenizer's: the extra ids are never allowed, and the
    device unpacking agrees with the bit layout."""
    from weld.engine.sampler import unpack_bitmask

    tokenizer = llm.tokenizer
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(choice=["Paris", "London"]))
    wide = tokenizer.vocab_size + 70
    row = np.full((bitmask_width(wide),), -1, np.int32)
    matcher.fill_bitmask(row)
    allowed = np.asarray(unpack_bitmask(row[None], wide))[0]
    assert not allowed[tokenizer.vocab_size:].any()
    ids = np.flatnonzero(allowed)
    assert len(ids) > 0
    assert all(("Paris".startswith(t) or "London".startswith(t)) and t
               for t in (tokenizer.decode([i]) for i in ids))
    reference = np.unpackbits(row.view(np.uint8), bitorder="little")[:wide].astype(bool)
    np.testing.assert_array_equal(allowed, reference)


def test_masked_tokens_are_never_sampled():
    """Sampling at high temperature over many positions and seeds never picks a masked token
    (the Gumbel noise is finite everywhere; masked logits are -1e30)."""
    import jax
    import jax.numpy as jnp

    from weld.engine.sampler import SamplingArrays, apply_allowed, sample, unpack_bitmask

    b, v = 64, 49152
    row = np.zeros((bitmask_width(v),), np.int32)
    row[100] = 0b101  # tokens 3200 and 3202
    allowed = unpack_bitmask(jnp.asarray(np.tile(row, (b, 1))), v)
    logits = apply_allowed(jnp.asarray(np.random.default_rng(0).standard_normal((b, v)), jnp.float32) * 5, allowed)
    draw = jax.jit(sample)
    for position in range(0, 1000, 100):
        params = SamplingArrays(jnp.full(b, 2.0), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b),
                                jnp.zeros(b, jnp.uint32), jnp.arange(b, dtype=jnp.uint32),
                                jnp.full(b, position, jnp.int32))
        assert set(np.asarray(draw(logits, params)).tolist()) <= {3200, 3202}


@pytest.mark.slow
def test_smollm2_chat_json_schema():
    """The default model answers a JSON-schema chat request with valid JSON (real tokenizer, 49k vocab)."""
    llm = LLM(max_model_len=512, kv_cache_memory_gb=0.05)
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
              "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                             "population": {"type": "integer", "minimum": 0}}}
    messages = [{"role": "user", "content": "Describe Paris as JSON with city, country and population."}]
    for seed in (0, 1):
        out = llm.chat(messages, SamplingParams(max_tokens=80, temperature=0.7, seed=seed,
                                                structured_outputs={"json": schema}))[0].outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert_no_leaks(llm)


@pytest.mark.parametrize("width", [4, 1])
def test_constrained_rows_speculate_with_a_mask_per_drafted_slot(tiny_llama_dir, llm, monkeypatch, width):
    """Under speculative decoding a constrained row verifies host n-gram drafts, each slot under
    the grammar's mask after the drafts before it: drafts are sent and accepted, greedy outputs
    equal plain constrained decoding, and sampled ones still match the grammar. Width 1: the
    adaptive policy verifies fewer drafts than num_speculative_tokens (the masks must follow the
    call's width, not the engine's k: they did not, and constrained rows broke their grammar)."""
    spec = LLM(model=str(tiny_llama_dir[0]), dtype="float32", max_model_len=256, kv_cache_memory_gb=0.01,
               steps_per_call=4, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                     "adaptive": width != 4})
    if width != 4:
        monkeypatch.setattr(spec.engine.width_policy, "choose", lambda num_rows: width)
    regex = r"(ab|cd|ef){12}"  # repeats its own phrases: lookup finds drafts the grammar takes
    greedy = [constrained(0, temperature=0, regex=regex), constrained(0, temperature=0, json=SCHEMAS["array"]),
              constrained(0, temperature=0, choice=["fox jumps over", "Paris"])]
    prompts = ["The quick brown fox", "ab cd ab cd", "Paris"]
    plain = llm.generate(prompts, greedy)
    drafted = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    stats = spec.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    sampled = spec.generate(["The quick brown fox"] * 3, [constrained(s, regex=regex) for s in SEEDS])
    for out in sampled:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    assert_no_leaks(spec)


def test_scheduler_gives_constrained_rows_one_round_when_speculating():
    """Pure Python: a verification gives a constrained sequence one round of k + 1 slots."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, steps_per_call=8,
                      num_spec_tokens=3, spec_rounds=4)
    free = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=32))
    bound = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=32, structured_outputs={"regex": "[ab]+"}))
    for seq in (free, bound):
        sched.add(seq)
    plan = sched.schedule()
    for e in plan.entries:
        e.seq.num_computed_tokens = e.start + e.num_tokens
        e.seq.output_token_ids.append(5)
    plan = sched.schedule()
    assert plan.kind == "verify"
    assert {e.seq.request_id: e.max_steps for e in plan.entries} == {"a": 16, "b": 4}
