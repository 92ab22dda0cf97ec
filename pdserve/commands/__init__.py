"""One module per `pdserve` subcommand (see pdserve/cli.py), plus what they share.

- `serve.py` — `pdserve serve`: Ray, the worker pools, Redis and the router (pdserve/app/).
- `generate.py` — `pdserve generate`: one prompt to a running server, optionally streamed.
- `make_model.py` — `pdserve make-model`: a random-weight Hugging Face model directory.
- `stats.py` — `pdserve stats`: prefix-cache reuse per worker and model, from Redis.
- `bench.py` — `pdserve bench ...`: the benchmarks of pdserve/bench.
- `plan.py` — `pdserve plan`: prefill/decode split for a workload and SLOs, predicted offline.
- `selftest.py` — `pdserve selftest`: parity, compiled decode, KV transfer, decode tok/s.
- `config_args.py` — CLI flags derived from the config dataclasses, and configs built back.
- `arg_types.py` — argparse types that check a flag's range (one-line usage errors).
"""


class CommandError(Exception):
    """A mistake the user can fix (a bad flag, a busy port, a missing model): `pdserve` prints
    the message as one line and exits with `exit_code`, without a traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
