"""`weld serve` on a tiny random llama, through the official `openai` client and raw HTTP.

Expected texts and logprobs come from the `LLM` API on the same model (greedy or seeded), never
from constants, so these tests fail when the server and the engine disagree.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.conftest import run_server, wait_for
from weld import LLM, SamplingParams
from weld.server.protocol import MAX_MESSAGES, MAX_TOOLS
from weld.server.serving import MAX_REQUEST_SEQS

MAX_MODEL_LEN = 256
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.01, steps_per_call=4)
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time there was", "Paris is the capital"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    directory, _ = tiny_llama_dir
    with run_server("--model", str(directory), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb",
                    "0.01", "--steps-per-call", "4", "--served-model-name", "tiny",
                    tmp_path=tmp_path_factory.mktemp("srv")) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    return LLM(model=str(directory), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(llm, prompt, max_tokens=12, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0].outputs[0]


def test_health_version_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].object == "model"


def test_routes_not_built_say_so(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="tiny", input="hello")
    assert "does not serve /v1/embeddings" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="hello")
    assert "does not serve /v1/responses" in err.value.body["message"]
    other = httpx.post(server.url + "/v1/nothing", json={})
    assert other.status_code == 404 and other.json()["error"]["message"] == "Not Found"


def test_completion_equals_llm(client, llm):
    resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    ref = greedy(llm, PROMPTS[0])
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.created > 0
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))


def test_completion_batch_of_prompts_and_token_ids(client, llm):
    ids = llm.tokenizer.encode(PROMPTS[2])
    resp = client.completions.create(model="tiny", prompt=[PROMPTS[1], PROMPTS[3]], max_tokens=6, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [greedy(llm, p, 6).text for p in (PROMPTS[1], PROMPTS[3])]
    resp = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert resp.choices[0].text == greedy(llm, {"prompt_token_ids": ids}, 6).text
    resp = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
    assert resp.choices[1].text == greedy(llm, {"prompt_token_ids": ids[:3]}, 6).text


def test_streaming_completion_with_usage(client, llm):
    ref = greedy(llm, PROMPTS[1], 16, ignore_eos=True)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=1,
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    # each token as it is sampled, though the server runs 4 decode steps per device call (a
    # chunk holds two only where the first ended inside a character)
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum(per_chunk) == 16 and per_chunk.count(1) >= 12, per_chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_equals_llm_streaming_and_not(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    ref = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_chat_developer_role_text_parts_and_continue_final_message(client, llm):
    parts = [{"type": "text", "text": "Name"}, {"type": "text", "text": "a fox."}]
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "developer", "content": "Be brief."},
                                                                  {"role": "user", "content": parts}],
                                          max_tokens=6, temperature=0)
    ref = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name\na fox."}],
                   SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert resp.choices[0].message.content == ref.text
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The quick"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ref = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0), continue_final_message=True)[0].outputs[0]
    assert resp.choices[0].message.content == ref.text


def test_n2_and_seeds_reproduce(client):
    def run(seed):
        return client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=10, temperature=1.0, n=2,
                                         seed=seed, extra_body={"ignore_eos": True})
    a, b, c = run(7), run(7), run(8)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert a.usage.completion_tokens == 20
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=5, seed=3, stream=True)
    texts = {0: "", 1: ""}
    for chunk in chat:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                           max_tokens=5, seed=3)
    assert [texts[0], texts[1]] == [ch.message.content for ch in again.choices]


def test_stop_strings_streaming_and_not(client, llm):
    ref = greedy(llm, PROMPTS[0], 24, ignore_eos=True).text
    stop = ref[6:9]
    expected = ref[:ref.find(stop)]
    resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected  # nothing of the stop string leaked


def test_echo_prompt_logprobs_match_llm(client, llm):
    """The lm-eval loglikelihood contract: token-id prompt, echo, logprobs, max_tokens 0 (and 1)."""
    ids = llm.tokenizer.encode("Paris is the capital of France. The quick brown fox")
    ref = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    expected = [None] + [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    for max_tokens in (0, 1):
        resp = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1,
                                         temperature=0)
        lp = resp.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected[1:], abs=1e-4)
        for pos in range(1, len(ids)):  # the chosen token and the top-1 are in top_logprobs
            assert lp.tokens[pos] in lp.top_logprobs[pos]
            assert max(lp.top_logprobs[pos].values()) >= lp.token_logprobs[pos] - 1e-6
        assert resp.choices[0].text.startswith(llm.tokenizer.decode(ids, skip_special_tokens=False))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert resp.usage.completion_tokens == max_tokens


def test_completion_and_chat_logprobs(client, llm):
    ref = greedy(llm, PROMPTS[3], 6, logprobs=3)
    resp = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([p[t].logprob for p, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)
    # the chosen token and the top 3 (fewer keys when two tokens decode to the same text)
    assert all(1 <= len(top) <= 4 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content)  # greedy: chosen is the top


def test_32_concurrent_streams_match_offline(server, llm):
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(32)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]

    async def one(aclient, i):
        stream = await aclient.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0.9,
                                                  top_p=1.0, seed=100 + i, stream=True,
                                                  extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    assert asyncio.run(main()) == expected


def test_disconnect_mid_stream_frees_pages(server):
    aborted_before = _abort_count(server)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert server.metric("weld:kv_cache_usage_perc") > 0  # the request holds pages now
    # leaving the `with` closed the connection mid-stream
    assert wait_for(lambda: server.metric("weld:kv_cache_usage_perc") == 0.0, timeout=30)
    assert wait_for(lambda: _abort_count(server) == aborted_before + 1, timeout=30)
    assert server.metric("weld:num_requests_running") == 0


def _abort_count(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("weld:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_tokenize_detokenize(server, llm):
    text = "The quick brown fox"
    tok = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == llm.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == text
    messages = [{"role": "user", "content": "Hi"}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tok["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_metrics_names(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("weld:num_requests_running", "weld:num_requests_waiting", "weld:kv_cache_usage_perc",
                 "weld:prefix_cache_queries_total", "weld:prefix_cache_hits_total", "weld:prompt_tokens_total",
                 "weld:generation_tokens_total", "weld:time_to_first_token_seconds_bucket",
                 "weld:inter_token_latency_seconds_bucket", "weld:e2e_request_latency_seconds_bucket",
                 "weld:request_queue_time_seconds_bucket", "weld:request_success_total"):
        assert name in text, name
    assert server.metric("weld:generation_tokens_total") > 0
    assert server.metric("weld:time_to_first_token_seconds_count") > 0


def _nested_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("body,status,param", [
    ("{not json", 400, None),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x " * 300}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 400}, 400, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs.regex"),
    ({}, 400, "prompt"),
    # one request with n = 2^31 grew a server to 21.5 GB: n is bounded (--max-n) before anything is made
    ({"prompt": "x", "n": 2147483648}, 400, "n"),
    ({"prompt": "x", "n": 129, "best_of": 129}, 400, "n"),
    # sizes a request controls, each bounded and named
    ({"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ({"prompt": "x", "stop": ["y" * 1025]}, 400, "stop"),
    ({"prompt": "x", "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, 400, "logit_bias"),
    ({"prompt": "x", "structured_outputs": {"regex": "a" * 70000}}, 400, "structured_outputs.regex"),
    ({"prompt": "x", "structured_outputs": {"json": _nested_schema(40)}}, 400, "structured_outputs.json"),
    ('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", 400, None),  # nested past Python's recursion limit
    ({"prompt": [[1]] * (MAX_REQUEST_SEQS + 1), "max_tokens": 1}, 400, "prompt"),  # sequences per request
])
def test_completion_errors(server, body, status, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    resp = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and the server keeps serving


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": []}},
     "structured_outputs.choice"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2147483648}, "n"),
    ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]}, "tools"),
])
def test_chat_errors(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", **{k: v for k, v in body.items() if k in ("messages",)},
                                       extra_body={k: v for k, v in body.items() if k != "messages"})
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_request_body_over_the_limit_is_413(server):
    """A body larger than the server's limit (32 MiB) is refused as it arrives, and the server
    keeps serving."""
    big = b'{"prompt": "' + b"x" * (33 << 20) + b'"}'
    resp = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                      timeout=120)
    assert resp.status_code == 413, resp.text[:200]
    assert "limit of 33554432 bytes" in resp.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_cached_tokens_in_usage(client, server):
    """`usage.prompt_tokens_details.cached_tokens`: a prompt sent again reads its full pages from
    the prefix cache (non-streamed and streamed with include_usage alike)."""
    messages = [{"role": "user", "content": "A prompt long enough to fill several pages of the cache: "
                                            + " ".join(f"w{i}" for i in range(40))}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens and cached % 4 == 0, again.usage
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    last = [c for c in stream][-1]
    assert last.usage.prompt_tokens_details.cached_tokens == cached
    texts = [client.completions.create(model="tiny", prompt=messages[0]["content"], max_tokens=1, temperature=0)
             for _ in range(2)]
    assert texts[0].usage.prompt_tokens_details.cached_tokens == 0 < texts[1].usage.prompt_tokens_details.cached_tokens


def test_cors_is_closed_by_default(server):
    resp = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://any.example",
                                                                 "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in resp.headers
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                      headers={"Origin": "http://any.example"}, timeout=60)
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_openapi_describes_every_request_body(server):
    """/openapi.json: each POST route's body with its fields (a schema-driven client or fuzzer
    reaches them), the chat messages as objects with a role."""
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, fields in (("/v1/completions", {"prompt", "max_tokens", "n", "logprobs", "echo", "stream"}),
                         ("/v1/chat/completions", {"messages", "tools", "tool_choice", "response_format", "n"}),
                         ("/tokenize", {"prompt", "messages"}), ("/detokenize", {"tokens"})):
        body = doc["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert body["required"] and fields <= set(schemas[ref]["properties"]), path
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is False
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert "role" in schemas["ChatMessage"]["required"]
    assert all(ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
               for ref in _refs(doc))  # no dangling $defs


def _refs(value):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from ([item] if key == "$ref" else _refs(item))
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)
