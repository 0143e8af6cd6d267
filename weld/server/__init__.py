"""The OpenAI-compatible HTTP server: `weld serve`.

`app.build_app(engine, ServerConfig(...))` makes a FastAPI app around an `AsyncLLM` (injected, so
tests and other front ends can pass their own); `app.serve(...)` loads a model and runs uvicorn.
Request shapes live in `protocol`, the two generation endpoints in `completions` and `chat`,
Prometheus metrics in `metrics`, OpenAI-shaped errors in `errors`. This layer never imports jax.
"""
