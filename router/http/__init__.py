"""The OpenAI-compatible HTTP API of the router, beside gRPC and on the same request path.

- `api.py` — the FastAPI routes, SSE streaming, authentication, disconnects.
- `service.py` — body → validated requests → RequestFlow (router/request_run.py) → choices.
- `translate.py` — OpenAI fields → the gRPC GenerateRequest that router/validation.py checks.
- `schemas.py` — the request bodies (pydantic).
- `choices.py` — response and stream-chunk JSON, usage, logprobs.
- `errors.py` — exceptions → OpenAI error JSON and HTTP status.
- `chat_template.py` — chat templates rendered as transformers renders them.
- `body_limit.py` — the request body cap (413), before a body is read.
- `request_body.py` — the caps of one request, strict decoding off the event loop.
- `connections.py` — per-connection deadlines and the connection cap, accept errors' log.
- `server.py` — uvicorn on the router's event loop.
"""
