"""The HTTP gateway (``chatstream gateway``): OpenAI-compatible in, resumable streams out.

======================= ================================================================
``app``                 the endpoints and ``create_app()`` (Starlette)
``core``                the gateway's state and logic: auth, job creation, replies
``openai_format``       job events and records as OpenAI chunks and completions (pure)
``responses_request``   a Responses API request as a chat-completions job (pure)
``responses_format``    job events as Responses API events and objects (pure)
``responses_api``       the Responses endpoints' I/O: create, stream, retrieve, cancel
``hub``                 one Redis reader per process fanning job streams out to clients
``streaming``           the SSE response: writes frames, watches the client, drops stalls
``cursors``             the one parser of the entry ids clients send (pure)
``connections``         uvicorn's protocol with a request-head timeout; aborting a connection
``auth``                API keys (constant-time), key ids, events tokens, tenants
``limits``              open streams per key and process, jobs per minute per key (Redis)
``page``                the page at ``/`` (``static/``)
``server``              serving it with uvicorn
``tracing``             OpenTelemetry: a SERVER span per request, child of its traceparent
======================= ================================================================

See docs/gateway.md.
"""

from worker.gateway.app import create_app
from worker.gateway.server import run_gateway, serve_gateway

__all__ = ["create_app", "run_gateway", "serve_gateway"]
