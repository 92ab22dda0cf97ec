"""The OpenAI-compatible HTTP API beside gRPC: the same flow, limits and API keys; the Responses
API's stored responses in the prefix index's Redis."""

from __future__ import annotations

from collections.abc import Callable

from pdserve import metrics
from pdserve.app.startup_steps import bind_port_async, stop_http
from pdserve.config import RouterConfig
from pdserve.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate
from router.observability import RequestObserver
from router.request_flow import RequestFlow
from router.routing import Routing
from router.tokenizing import BackgroundTokenizer
from router.validation import ModelLimits


async def start_http_api(
    router: RouterConfig,
    flow: RequestFlow,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    chat_template: ChatTemplate | None,
    redis_url: str,
    routing: Routing,
    auth,
    is_ready: Callable[[], bool],
    unready_reason: Callable[[], str],
    stack: list,
) -> int:
    """Starts the HTTP server (`auth`: the gRPC server's API keys; `stack`: ServingApp's stop
    callables, which this extends) and returns its bound port."""
    from router.http.api import create_app
    from router.http.response_store import ResponseStore
    from router.http.server import HttpServer
    from router.http.service import OpenAIService

    service = OpenAIService(
        flow,
        BackgroundTokenizer(tokenizer),
        limits,
        RequestObserver(),
        chat_template,
        router.stream_one_token_per_event,
    )
    response_store = ResponseStore(redis_url, router.response_ttl_s, router.response_max_bytes)
    stack.append(("response store", response_store.aclose))
    for queue in (service.tokenizer.pool, service.cpu):  # admission control counts them
        routing.count(queue)
    metrics.track_router_pending(routing.pending_stages())
    http = HttpServer(
        create_app(service, auth, is_ready, unready_reason, response_store),
        router.http_host,
        router.http_port,
        tls_cert=router.tls_cert,
        tls_key=router.tls_key,
        tls_client_ca=router.tls_client_ca,
    )
    await bind_port_async(router.http_port, "--http-port", http.start)
    stack.append(("http server", lambda: stop_http(http, service, router.shutdown_grace_s)))
    return http.port
