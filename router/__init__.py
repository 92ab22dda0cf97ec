"""The router: the client-facing APIs (gRPC, OpenAI HTTP) and each request's way through the
workers.

Runs without torch and never imports the engine or the worker packages (import-linter
contracts in pyproject.toml); it knows workers only through `router/types.py` and
`pdserve.core` messages. `pdserve/app/` wires it to the Ray actors.

- `server.py` — `RouterServer`: the grpc.aio server, health (liveness, readiness), reflection.
- `tls.py` — TLS server credentials for the client API (client certificates optional).
- `auth.py` — API-key authentication, a server interceptor (health stays open).
- `request_decoding.py` — undecodable request bytes become `INVALID_ARGUMENT`, an interceptor.
- `generation_service.py` — the Generation servicer: protobuf in, `RequestFlow`, protobuf out.
- `request_run.py` — one validated request through `RequestFlow`, as both APIs run it.
- `http/` — the OpenAI-compatible HTTP API (FastAPI + uvicorn), its modules listed there.
- `validation.py` — request checks; errors name the field (`INVALID_ARGUMENT`).
- `tokenizing.py` — tokenization on a small thread pool, off the event loop.
- `bounded_pool.py` — threads for CPU work off the event loop; a full queue is refused at once.
- `approximate_prefixes.py` — `--policy approximate`: each worker's cache predicted from the router's own routes, no KV events.
- `disaggregate_rule.py` — the field's rules for local or remote prefill: `threshold:N` (llm-d),
  `conditional:LEN:QUEUE` (Dynamo).
- `errors.py` — exceptions to gRPC status codes, in one place.
- `request_flow.py` — one request's lifecycle: reserve, prefill, stream, retry, abort.
- `loop_lag.py` — how long the router's own event loop stalled; worker silence counted net of it.
- `worker_watch.py` — a worker's calls failed (`WorkerFailed`) when it fails or stalls.
- `attempts.py` — one attempt's work (a continuation after the tokens sent), what replaces a
  failed one, a refused grammar.
- `waiting.py` — requests waiting for room between attempts, counted by admission control.
- `output_text.py` — the client's text, decoded over every attempt's tokens, stop strings.
- `types.py` — `Route`, `Progress` and `WorkerHandle`, what the router's modules share.
- `ray_worker.py` — a worker actor's Ray handle adapted to `WorkerHandle`; abandoned streams
  read to their end in the background.
- `worker_pool.py` — handles, background stats polling, health, in-flight counts.
- `routing.py` — gathers each decision's inputs: loads, the prefix lookup, recent routes.
- `recent_prefixes.py` — prompt blocks routed in the last seconds, before the index shows them.
- `policy.py` — `RoutingPolicy`: options, admission control, the choice.
- `estimates.py` — TTFT, TPOT and stall of each option, and the objective.
- `option_matrix.py` — the cost policy's pick over every option at once, as numpy arrays.
- `worker_vectors.py` — workers' load snapshots as numpy vectors, for the option matrix.
- `cost_vectors.py` — the cost model's lines over numpy vectors, for the option matrix.
- `load_rows.py` — each role's worker loads, kept as arrays as they change, for the decisions.
- `cost_model.py` — prefill, decode-step and transfer costs, learned online.
- `peer_pull.py` — `--peer-pull`: whether a local prefill pulls its prefix from a peer
  instead (priced with the cost model), and the pull, falling back when its holder fails.
- `handoff_costs.py` — a remote prefill's round trips (reserve, call, first answer), as measured.
- `observability.py` — the request's spans and latency metrics.
- `traffic_window.py` — the requests served lately, for the online planner.
- `online_plan.py` — `OnlinePlanner` (`--plan-interval`): the planner's split for that traffic.
- `role_hysteresis.py` — `RoleHysteresis`: whether a plan is worth workers changing role (dwell,
  margin), and which workers; shared with the simulated cluster.
- `role_switch.py` — `RoleSwitcher` (`--role-switching`): drains a worker of its role, then it
  serves the other one on the same engine.
"""
