"""The OpenAI-compatible HTTP API of the router, beside gRPC and on the same request path.

- `api.py` — the FastAPI routes, SSE streaming, authentication, disconnects.
- `service.py` — body → validated requests → RequestFlow (router/request_run.py) → choices.
- `translate.py` — OpenAI fields → the gRPC GenerateRequest that router/validation.py checks.
- `schemas.py` — the request bodies (pydantic).
- `choices.py` — response and stream-chunk JSON, usage, logprobs.
- `errors.py` — exceptions → OpenAI error JSON and HTTP status.
- `chat_template.py` — chat templates rendered as transformers renders them.
- `tool_request.py` — `tools`, `tool_choice`, `parallel_tool_calls` checked; forced calls' grammar.
- `tool_messages.py` — a conversation's tool calls and results, checked, as templates read them.
- `tool_parsers.py` — tool calls in a model's output, one parser per chat-template family.
- `forced_calls.py` — the output of forced tool calls, read as it grows.
- `tool_output.py` — the message with `tool_calls`, and a stream's deltas.
- `body_limit.py` — the request body cap (413), before a body is read.
- `request_body.py` — the caps of one request, strict decoding off the event loop.
- `connections.py` — per-connection deadlines and the connection cap, accept errors' log.
- `server.py` — uvicorn on the router's event loop.
- `disconnects.py` — a request's work cancelled when its client disconnects.
- `responses.py` — `/v1/responses` (create, retrieve, delete): a Responses body → one chat run.
- `response_schemas.py` — the Responses request body (pydantic).
- `response_prompt.py` — input items → chat messages; a continuation's prompt tokens.
- `response_events.py` — the Response object and the stream's events.
- `response_store.py` — stored responses in Redis (TTL, size bound).
- `response_tools.py` — function tools on Responses: the flat tools and choice in chat's shape, errors in Responses field names, stable call ids.
"""
