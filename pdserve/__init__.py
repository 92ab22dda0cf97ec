"""pdserve: LLM serving with prefill and decode disaggregated.

Importing this package never imports torch or Ray. Torch is imported by `pdserve.engine`,
`pdserve.models` (and the worker runtime and benchmarks that use them), Ray by
`pdserve.worker.pools`; everything else here loads in any process.

Subpackages: `app` (`ServingApp` / `BackgroundApp`: everything `pdserve serve` starts and
stops), `core` (plain shared types), `engine` and `models` (torch), `worker` (what both
worker actors share), `prefix_index` (Redis), `metrics` (the Prometheus series and their HTTP
endpoint), `commands` (the CLI), `bench`, `pb` (generated).
Modules:
- `startup_checks.py` — what `pdserve serve` checks before it starts anything (`StartupError`).
- `disaggregate_modes.py` — `--disaggregate`'s modes parsed: auto, always, never, threshold:N,
  conditional:LEN:QUEUE.
- `dtype_probe.py` — `check_dtype`: the dtype tried on the device (one matmul) at start-up.
- `ray_cluster.py` — a private Ray in its own session, or --ray-address checked for the pools.
- `startup_progress.py` — `StartupProgress`: start-up's lines with elapsed time, a bar on a TTY.
- `process_tree.py` — `kill_descendants`: what Ctrl-C during start-up leaves is killed.
- `config.py` — the serving settings as dataclasses (`ServeConfig` gathers them all); CLI
  flags map onto them.
- `engine_config.py` — the engine's settings: `EngineConfig`, `SimConfig`, `SpeculativeConfig`.
- `config_switchable.py` — the settings `--role-switching` and `--hybrid` need, checked at start.
- `config_fields.py` — `setting()`: a field's default, help, flag and bounds; `check_fields`.
- `cli.py` — the `pdserve` command; subcommands are imported only when run.
- `client.py` — `GenerationClient` / `AsyncGenerationClient` for the Generation API.
- `tokenizer.py` — `Tokenizer`, `IncrementalDetokenizer` (text deltas, stop strings).
- `telemetry.py` — OpenTelemetry setup; W3C context across gRPC, Ray calls and KV chunks.
- `grpc_handlers.py` — building blocks of grpc.aio server interceptors.
- `tls_files.py` — `CertificateFiles`: a TLS endpoint's PEM files, reloaded once renewed.
- `logging_setup.py` — text or JSON logs carrying request and trace ids.
- `heap.py` — `freeze_startup_heap`: a serving process's startup objects left out of the
  collector's full passes.
"""

__version__ = "0.1.0"
