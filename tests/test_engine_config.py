"""weld.config: the engine's settings in vLLM's keyword and flag spellings, each checked before
anything is built, with a one-line error naming the setting and the value."""

from __future__ import annotations

import argparse

import pytest

from weld.config import CacheConfig, EngineConfig, SchedulerConfig, add_engine_arguments
from weld.utils.errors import InvalidInputError


def test_keywords_go_to_their_groups():
    cfg = EngineConfig.create("m.gguf", "bfloat16", max_model_len=512, max_num_seqs=8, page_size=32,
                              enable_prefix_caching=False, steps_per_call=4,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.model == "m.gguf" and cfg.dtype == "bfloat16"
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=8, max_model_len=512, steps_per_call=4)
    assert cfg.cache == CacheConfig(page_size=32, enable_prefix_caching=False)
    assert (cfg.speculative.method, cfg.speculative.k) == ("ngram", 3)
    assert cfg.replace(max_num_seqs=2, dtype="float32").scheduler.max_num_seqs == 2
    assert hash(cfg) == hash(EngineConfig.create("m.gguf", "bfloat16", max_model_len=512, max_num_seqs=8,
                                                 page_size=32, enable_prefix_caching=False, steps_per_call=4,
                                                 speculative_config={"method": "ngram",
                                                                     "num_speculative_tokens": 3}))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(max_num_seqs=0), "max_num_seqs must be an integer in [1, 4096], got 0"),
    (dict(max_num_seqs=10_000), "got 10000"),
    (dict(page_size=5000), "page_size must be an integer in [1, 1024]"),
    (dict(num_pages=1 << 30), "num_pages must be an integer in [1, 16777216]"),
    (dict(steps_per_call=0), "steps_per_call"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be an integer"),
    (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb must be > 0"),
    (dict(kv_cache_memory_gb=True), "kv_cache_memory_gb must be > 0"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    (dict(max_model_len=-3), "max_model_len must be an integer >= 1, got -3"),
    (dict(backend="cuda"), "backend must be one of ('xla', 'megakernel'), got 'cuda'"),
    (dict(dtype="int4"), "unknown dtype 'int4'"),
    (dict(block_size=16), "unknown engine setting 'block_size'"),
    (dict(speculative_config={"method": "eagle"}), "speculative method must be one of"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, needle):
    with pytest.raises(InvalidInputError) as err:
        EngineConfig.create(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_are_vllms_names_and_read_back():
    cfg = EngineConfig.from_args(parse("--model", "x", "--max-model-len", "256", "--block-size", "8",
                                       "--no-enable-prefix-caching", "--max-num-seqs", "3", "--num-pages", "40",
                                       "--kv-cache-dtype", "float16",
                                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'))
    assert (cfg.model, cfg.scheduler.max_model_len, cfg.cache.page_size, cfg.cache.num_pages) == ("x", 256, 8, 40)
    assert not cfg.cache.enable_prefix_caching and cfg.scheduler.max_num_seqs == 3
    assert cfg.cache.kv_cache_dtype == "float16" and cfg.cache.kv_cache_memory_gb is None
    assert (cfg.speculative.method, cfg.speculative.k) == ("ngram", 2)
    assert EngineConfig.from_args(parse()) == EngineConfig()  # the flags' defaults are the config's


@pytest.mark.parametrize("argv,needle", [
    (["--speculative-config", "{not json"], "--speculative-config is not valid JSON"),
    (["--speculative-config", "[1]"], "must be a JSON object"),
    (["--speculative-config", '{"method": "ngram"}', "--spec", "ngram"], "both set speculative decoding"),
    (["--block-size", "0"], "page_size must be an integer in [1, 1024], got 0"),
])
def test_bad_flags_are_one_line_errors(argv, needle):
    with pytest.raises(InvalidInputError, match=None) as err:
        EngineConfig.from_args(parse(*argv))
    assert needle in str(err.value)
