"""`batchkv serve`: an OpenAI-compatible HTTP server over the engine (needs `pip install batchkv[serve]`).

    batchkv serve --model /path/to/Qwen3-0.6B --port 8000

Files: `protocol` (request bodies, errors), `limits` (what one request may ask),
`guard` (Host, API key, Content-Type, request ids), `loading` (model, tokenizer, stop ids), `jobs`
(bodies to engine requests), `templates` (chat templates, sandboxed and timed), `worker` (the engine
thread), `stream` (a request's events and deadline), `detok` (incremental text, stop strings),
`outputs` (choices and answers), `metrics` (Prometheus), `app` (routes), `server` (uvicorn around a
built engine, startup and shutdown). Its options are parsed, and its engine built, by
`batchkv.cli.serve`; nothing here imports the front end.
"""
