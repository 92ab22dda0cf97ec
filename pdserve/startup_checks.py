"""The checks `pdserve serve` makes before it starts anything: the model directory and its
limits, the chat template, the speculative decoding settings, free ports, a reachable Ray.
Each failure is a `StartupError` with a one-line message naming the flag."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import jinja2

from pdserve.config import ServeConfig
from pdserve.core.model_limits import max_model_len
from pdserve.engine_config import EngineConfig
from pdserve.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate
from router.validation import ModelLimits

RAY_CONNECT_TIMEOUT_S = 5.0


class StartupError(RuntimeError):
    """A setting that cannot work, found before anything was started; a one-line message."""


def load_model_limits(model_dir: Path, engine: EngineConfig) -> tuple[Tokenizer, ModelLimits]:
    """The tokenizer and the limits the router validates against, from the model directory;
    `max_model_len` is the one the engine computes (pdserve.core.model_limits)."""
    config_path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise StartupError(not_a_model_dir("--model", model_dir))
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        tokenizer = Tokenizer.from_dir(model_dir)
        return tokenizer, ModelLimits(
            name=model_dir.name,
            vocab_size=int(config["vocab_size"]),
            max_model_len=max_model_len(config, engine),
            eos_token_ids=list(tokenizer.eos_token_ids),
            num_layers=int(config.get("num_hidden_layers", 0)),
        )
    except (OSError, ValueError, KeyError) as e:
        detail = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise StartupError(f"--model {model_dir}: {detail}") from e


def not_a_model_dir(flag: str, path: Path) -> str:
    """Why `path`, not a directory, cannot be the model `flag` names: a file is not a missing
    directory, and saying so saves looking for a typo."""
    if path.exists():
        return f"{flag}: {path} is a file; {flag} takes a Hugging Face model directory"
    return f"{flag}: directory {path} does not exist"


def check_speculation(config: ServeConfig, vocab_size: int) -> None:
    """Raises StartupError when the decode pool's --speculative setting cannot work: simulated
    decode workers (they never speculate), or a draft model directory that is missing, not a
    model, or has another vocabulary than the served model's `vocab_size`."""
    engine = config.engine_for("decode")
    spec = engine.speculative
    if not spec.enabled:
        return
    if engine.kind == "sim":
        raise StartupError(
            f"--speculative {spec.method}: simulated decode workers do not speculate"
        )
    if spec.method != "draft":
        return
    draft_dir = Path(spec.draft_model)
    if not draft_dir.is_dir():
        raise StartupError(not_a_model_dir("--draft-model", draft_dir))
    try:
        draft_config = json.loads((draft_dir / "config.json").read_text(encoding="utf-8"))
        draft_vocab = int(draft_config["vocab_size"])
    except (OSError, ValueError, KeyError) as e:
        detail = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise StartupError(f"--draft-model {draft_dir}: {detail}") from e
    if draft_vocab != vocab_size:
        raise StartupError(
            f"--draft-model {draft_dir}: vocab_size {draft_vocab} differs from the served "
            f"model's {vocab_size} (a draft must share the target's tokenizer)"
        )


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model's chat template (None without one); StartupError when it does not compile."""
    try:
        return ChatTemplate.from_dir(model_dir)
    except (OSError, ValueError, jinja2.TemplateError) as e:
        raise StartupError(f"--model {model_dir}: chat_template: {e}") from e


def port_in_use(port: int, flag: str) -> str:
    """The one line for a port another process holds, naming the flag that sets it."""
    return f"port {port} ({flag}) is in use; pick another with {flag} or 0 for any free port"


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raises StartupError when another process listens on host:port. gRPC would otherwise
    share the port with it (SO_REUSEPORT) or fail only after Ray and the workers started."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(port_in_use(port, flag)) from e
            raise StartupError(
                f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror}"
            ) from e


def check_ports_free(config: ServeConfig) -> None:
    """Every fixed port the server will bind, checked before anything slow starts. The workers'
    ports (--worker-metrics-port, --kv-port) are bound on this machine only with a local Ray."""
    router = config.router
    ports = [
        (router.host, router.port, "--port"),
        (router.http_host, router.http_port, "--http-port"),
        (config.metrics_host, config.metrics_port, "--metrics-port"),
        (router.host, router.health_port, "--health-port"),
    ]
    if not config.ray_address:
        kv_host = config.kv.bind_host or "0.0.0.0"
        ports += [
            ("0.0.0.0", config.worker.metrics_port, "--worker-metrics-port"),
            (kv_host, config.kv.port, "--kv-port"),
        ]
    for host, port, flag in ports:
        if port is not None:
            check_port_free(host, port, flag)


def check_ray_reachable(address: str | None) -> None:
    """Raises StartupError when a Ray address given as host:port does not accept connections
    within RAY_CONNECT_TIMEOUT_S (ray.init would wait for it forever)."""
    if not address or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise StartupError(
            f"--ray-address {address}: expected host:port, 'auto' or ray://host:port"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else e.strerror or str(e)
        raise StartupError(f"--ray-address {address}: cannot connect: {reason}") from e
