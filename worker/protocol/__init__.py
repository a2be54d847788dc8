"""The upstream's wire format, pure: bytes and dicts in, values out (no I/O).

=============== ======================================================================
``sse``         incremental WHATWG SSE decoder: bytes in, each event's data out
``accumulator`` validates ``chat.completion.chunk`` data and routes it to each choice
``message``     the merge rules, once: the final message, the deltas to publish
=============== ======================================================================
"""
