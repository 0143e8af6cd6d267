"""What `weld serve` says while it starts (what it loads, the KV budget, each compile with its
shape and seconds, its ready time), and that the warm-up leaves no trace in the request metrics."""

from __future__ import annotations

import re

import httpx

from tests.server.conftest import run_server


def test_startup_log_and_clean_metrics(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    with run_server("--model", str(directory), "--dtype", "float32", "--max-model-len", "256", "--warmup", "basic",
                    "--log-level", "info", tmp_path=tmp_path) as server:
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        log = server.logs()
    assert re.search(r"^weld: loaded \S+ \(llama hf, .*\) in [\d.]+ s", log, re.M), log
    assert re.search(r"^weld: weights on device: [\d.]+ GB \(float32.*KV cache: \d+ pages of 16 tokens, [\d.]+ GB "
                     r"float32; max_model_len 256", log, re.M), log
    compiles = re.findall(r"^weld: compiled (prefill|decode) \(([\dx+]+), .*\) in [\d.]+ s: (\d+) programs", log, re.M)
    assert [c[0] for c in compiles] == ["prefill", "decode"] and compiles[0][1] == "1x16", log
    ready = re.search(r"^weld: ready in [\d.]+ s \((\d+) programs compiled; --warmup basic\)", log, re.M)
    assert ready and int(ready.group(1)) == len(compiles), log
    assert re.search(r'^weld:compiled_programs\{model_name="[^"]+"\} 2\.0$', metrics, re.M)
    # the warm-up request is not a request: nothing counted
    for name in ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "e2e_request_latency_seconds_count"):
        values = re.findall(rf"^weld:{name}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        assert all(float(v) == 0 for v in values), (name, values)
