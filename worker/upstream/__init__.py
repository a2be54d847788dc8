"""The streaming call to an OpenAI-compatible ``/v1/chat/completions`` endpoint.

=============== ======================================================================
``client``      ``UpstreamClient``: the request, retries before the first byte, error
                mapping, the byte stream of the reply
``transport``   the httpx transport under it: httptools (llhttp) on asyncio protocols
``gate``        an upstream's health: while it is down, one probe at a time
``idle``        the idle timeout mid-stream, counted in complete SSE blocks, not bytes
``error_body``  an error body (JSON, or SSE as LiteLLM sends it) as its error object
=============== ======================================================================
"""

# A response of ``transport`` carries its body under this extension: ``feed`` it a callback.
BODY_EXTENSION = "chatstream.body"
