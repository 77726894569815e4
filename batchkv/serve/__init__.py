"""`batchkv serve`: an OpenAI-compatible HTTP server over the engine (needs `pip install batchkv[serve]`).

    batchkv serve --model /path/to/Qwen3-0.6B --port 8000

Files: `protocol` (request bodies, errors), `loading` (model, tokenizer, stop ids), `jobs` (bodies to
engine requests), `worker` (the engine thread), `detok` (incremental text, stop strings), `outputs`
(choices and answers), `metrics` (Prometheus), `app` (routes), `server` (startup and shutdown).
Nothing outside this package imports it.
"""
