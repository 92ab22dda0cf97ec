"""Everything behind `pdserve serve`: Ray, Redis, the worker pools and the router's servers.

Callers import `ServingApp` and `BackgroundApp` from here.
Modules:
- `serving_app.py` — `ServingApp`: starts each part in order, stops them in reverse order.
- `background_app.py` — `BackgroundApp`: a ServingApp on its own event-loop thread (tests,
  benchmarks).
- `stats_listeners.py` — the workers' polled stats exported as metrics and stored for
  `pdserve stats`.
- `planning.py` — the online planner and role switching, when their flags ask for them.
- `http_api.py` — the OpenAI-compatible HTTP API started beside gRPC.
- `startup_steps.py` — slow calls off the event loop, ports bound with one-line errors, stop
  callables.
"""

from pdserve.app.background_app import BackgroundApp
from pdserve.app.serving_app import ServingApp

__all__ = ["BackgroundApp", "ServingApp"]
