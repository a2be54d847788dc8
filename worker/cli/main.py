"""The ``chatstream`` command.

Exit codes: 0 done; 1 an error the user can fix, said in one line on stderr (never a
traceback); 2 a usage error (argparse); 3 the job did not succeed (``enqueue --wait``,
``--follow``, ``demo``); 130 interrupted (``--follow`` and ``tail`` say how to resume);
141 stdout was closed (``... | head -1``), like other Unix tools, silently.

Subcommands are registered in :data:`SUBCOMMANDS`: one ``_add_*`` function each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from schemas.events import EventType
from schemas.jobs import JobRecord, JobStatus
from worker import logs, package_version, speedups
from worker.aio import cancel_and_wait
from worker.cli.output import print_event, print_jobs, print_record
from worker.client import Client, within
from worker.errors import ChatstreamError
from worker.settings import (
    SUPERVISOR_PID_VARIABLE,
    Settings,
    load_settings,
    unknown_variables,
)
from worker.urls import redacted_url

Command = Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]
log = logging.getLogger("chatstream.cli")
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
MOCK_RATE = 20.0  # `mock-upstream`'s default tokens per second: a reply streams visibly


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(run_command(args))


# The commands that run the worker's machinery (signal handlers on the event loop, process
# groups): POSIX only. The producers and readers (enqueue, tail, status, jobs, cancel, stats,
# dead) and the Python client work on Windows too (README, "Platforms"; decision 82).
POSIX_ONLY = ("worker", "gateway", "demo")


def not_supported_here(args: argparse.Namespace, platform: str | None = None) -> str | None:
    """Why this command cannot run on this platform (None: it can)."""
    if (platform or sys.platform) == "win32" and args.command_name in POSIX_ONLY:
        return (
            f"`chatstream {args.command_name}` is not supported on Windows (it needs POSIX "
            "signals and process groups); run it on Linux or macOS, or in WSL or a container. "
            "The producer commands and the Python client work here."
        )
    return None


def run_command(args: argparse.Namespace) -> int:
    redis_url = ""
    if reason := not_supported_here(args):
        return fail(reason)
    try:
        settings = load_settings()
        redis_url = settings.redis_url
        logs.configure(settings)
        warn_unknown_variables()
        command: Command = args.command
        return speedups.run(command(settings, args), settings)
    except (ChatstreamError, RedisError, TimeoutError) as exc:
        return fail(error_message(exc, redis_url))
    except BrokenPipeError:
        return stdout_closed()
    except KeyboardInterrupt:
        return 130


def warn_unknown_variables() -> None:
    """Once per start (not again in a supervisor's workers): the ``CHATSTREAM_*`` variables
    that name no setting, which would otherwise be ignored silently."""
    if SUPERVISOR_PID_VARIABLE in os.environ:
        return
    for variable in unknown_variables(os.environ):
        log.warning("%s names no setting; it is ignored", variable)


def error_message(exc: ChatstreamError | RedisError | TimeoutError, redis_url: str) -> str:
    if isinstance(exc, ChatstreamError):
        return exc.message
    if isinstance(exc, RedisConnectionError):
        return f"cannot reach Redis at {redacted_url(redis_url)}: {exc}"
    if isinstance(exc, RedisError):
        return f"Redis error: {exc}"
    return "timed out"  # commands say what timed out; this is a last resort


def fail(message: str) -> int:
    print(f"chatstream: error: {message}", file=sys.stderr)
    return 1


def stdout_closed() -> int:
    """The reader of our output went away (``| head -1``): exit quietly, as ``cat`` does.

    stdout is pointed at /dev/null so the interpreter's final flush cannot fail again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


# -- commands ---------------------------------------------------------------------------


@asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[Client]:
    """A client whose Redis answered a PING (within seconds, or RedisUnavailableError)."""
    client = await Client.connect(settings)
    try:
        yield client
    finally:
        await client.aclose()


async def worker_command(settings: Settings, args: argparse.Namespace) -> int:
    from worker.service.worker import serve

    if args.processes:
        from worker.service.supervisor import supervise

        return await supervise(settings, args.processes, concurrency=args.concurrency)
    if args.concurrency:
        settings = settings.model_copy(update={"concurrency": args.concurrency})
    from worker.service.supervisor import watch_parent

    watch = watch_parent()  # under a supervisor: stop gracefully should it die
    async with connected(settings) as client:
        await serve(settings, client.redis)
    if watch is not None:
        watch.cancel()
    return 0


async def enqueue_command(settings: Settings, args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    request: dict[str, Any] = {"model": args.model, "messages": messages}
    if args.mock:
        request["mock"] = args.mock
    async with connected(settings) as client:
        job_id = await client.enqueue(
            request,
            job_id=args.job_id,
            upstream=args.upstream,
            tenant=args.tenant,
            priority=args.priority,
        )
        if not (args.follow or args.wait) or not args.json:
            print(job_id, flush=True)
        if not (args.follow or args.wait):
            return 0
        return await follow_or_wait(client, Followed(job_id), args)


@dataclass(slots=True)
class Followed:
    """A job being followed, and the last entry printed: where ``tail --after`` resumes."""

    job_id: str
    last_id: str = "0-0"
    line_open: bool = False  # text was printed without its newline yet

    def resume_hint(self) -> str:
        after = f" --after {self.last_id}" if self.last_id != "0-0" else ""
        return f"job {self.job_id} goes on (chatstream tail {self.job_id}{after})"

    def end_line(self) -> None:
        if self.line_open:
            print(flush=True)
            self.line_open = False


async def follow_or_wait(client: Client, followed: Followed, args: argparse.Namespace) -> int:
    """``--follow`` / ``--wait``: the record at the end (exit 0 or 3), or a hint to resume."""
    try:
        record = await within(follow_then_wait(client, followed, args), args.timeout)
    except TimeoutError:
        followed.end_line()
        return fail(f"timed out after {args.timeout:g}s; {followed.resume_hint()}")
    except asyncio.CancelledError:  # Ctrl-C: the job is not cancelled
        interrupted(followed)
        raise
    print_record(record, as_json=args.json)
    return 0 if record.status == "succeeded" else 3


def interrupted(followed: Followed) -> None:
    followed.end_line()
    print(f"chatstream: interrupted; {followed.resume_hint()}", file=sys.stderr, flush=True)


async def follow_then_wait(
    client: Client, followed: Followed, args: argparse.Namespace
) -> JobRecord:
    if args.follow:
        await follow(client, followed, as_json=args.json)
    return await client.result(followed.job_id)


async def follow(client: Client, followed: Followed, *, as_json: bool, after: str = "0-0") -> None:
    """Print the job's events; a job still queued after ``QUEUED_HINT_AFTER`` seconds with
    nothing in its stream gets one line saying so (stderr)."""
    hint = asyncio.create_task(queued_hint(client, followed))
    try:
        async for event in client.events(followed.job_id, after=after):
            followed.last_id = event.id
            hint.cancel()
            print_event(event, as_json=as_json)
            followed.line_open = not as_json and event.type is EventType.DELTA
    finally:
        await cancel_and_wait([hint])


QUEUED_HINT_AFTER = 3.0


async def queued_hint(client: Client, followed: Followed) -> None:
    await asyncio.sleep(QUEUED_HINT_AFTER)
    line = await client.queued_notice(followed.job_id)
    if line is not None and followed.last_id == "0-0":
        print(line, file=sys.stderr, flush=True)


async def tail_command(settings: Settings, args: argparse.Namespace) -> int:
    check_entry_id(args.after)
    followed = Followed(args.job, args.after)
    async with connected(settings) as client:
        try:
            await within(follow(client, followed, as_json=args.json, after=args.after), None)
        except asyncio.CancelledError:
            interrupted(followed)
            raise
    followed.end_line()
    return 0


def check_entry_id(text: str) -> None:
    """An entry id as Redis writes them: ``1718000000000-0`` (or ``1718000000000``)."""
    if not re.fullmatch(r"\d{1,20}(-\d{1,20})?", text):
        raise ChatstreamError(
            f"--after {text!r} is not an entry id; entry ids look like 1718000000000-0 "
            "(milliseconds-sequence, as tail --json prints them; 0-0: from the start)"
        )


async def status_command(settings: Settings, args: argparse.Namespace) -> int:
    async with connected(settings) as client:
        record = await client.get(args.job)
        progress = None if args.json else await client.progress(args.job)
        print_record(record, as_json=args.json, progress=progress)
    return 0


async def jobs_command(settings: Settings, args: argparse.Namespace) -> int:
    async with connected(settings) as client:
        page = await client.jobs(
            status=args.status,
            upstream=args.upstream,
            tenant=args.tenant,
            limit=args.limit,
            before=args.before,
        )
    print_jobs(page, as_json=args.json)
    if page.next_before is not None:
        print(f"(more: chatstream jobs --before {page.next_before!r})", file=sys.stderr)
    return 0


async def cancel_command(settings: Settings, args: argparse.Namespace) -> int:
    async with connected(settings) as client:
        print(await client.cancel(args.job))
    return 0


async def dead_command(settings: Settings, args: argparse.Namespace) -> int:
    async with connected(settings) as client:
        if args.requeue:
            print(await client.requeue(args.requeue))
            return 0
        letters = await client.dead_letters(args.limit)
        if not args.json:
            print(f"{'entry':<20} {'job':<34} code", flush=True)
        for letter in letters:
            if args.json:
                line = {"id": letter.entry_id, "job": letter.job_id, "reason": letter.reason}
                print(json.dumps(line, ensure_ascii=False), flush=True)
            else:
                code = letter.reason.get("code", "")
                print(f"{letter.entry_id:<20} {letter.job_id:<34} {code}", flush=True)
    return 0


async def stats_command(settings: Settings, args: argparse.Namespace) -> int:
    from worker.store.stats import collect, render

    async with connected(settings) as client:
        stats = await collect(client.redis, client.keys, live_window=settings.lease_seconds)
    print(json.dumps(stats.to_json()) if args.json else render(stats), flush=True)
    return 0


async def mock_command(settings: Settings, args: argparse.Namespace) -> int:
    from worker.testing.mock_upstream import MockRequestError, check_fault, serve_mock

    try:
        check_fault(args.fault)
    except MockRequestError as exc:
        return fail(str(exc))
    options = {
        "tokens": args.tokens,
        "rate": args.rate,
        "tool_calls": args.tool_calls,
        "reasoning": args.reasoning,
        "fault": args.fault,
        "fault_after": args.fault_after,
        "keepalive_every": args.keepalive_every,
        "max_concurrent": args.max_concurrent,
        "requests_per_minute": args.requests_per_minute,
    }
    async with serve_mock(host=args.host, port=args.port, **options) as url:
        print(f"mock upstream listening on {url}", flush=True)
        await asyncio.Event().wait()
    return 0


def listening(settings: Settings, args: argparse.Namespace, server: str) -> Settings:
    """The settings with ``--host`` / ``--port`` as ``<server>_host`` / ``<server>_port``."""
    updates = {f"{server}_host": args.host, f"{server}_port": args.port}
    return settings.model_copy(update={k: v for k, v in updates.items() if v is not None})


async def gateway_command(settings: Settings, args: argparse.Namespace) -> int:
    from worker.gateway import run_gateway

    return await run_gateway(listening(settings, args, "gateway"))


async def dashboard_command(settings: Settings, args: argparse.Namespace) -> int:
    from worker.dashboard import run_dashboard

    return await run_dashboard(listening(settings, args, "dashboard"))


async def demo_command(settings: Settings, args: argparse.Namespace) -> int:
    from worker.cli.demo import run_demo

    if "log_level" not in settings.model_fields_set:  # the reply is the demo's output
        logging.getLogger("chatstream").setLevel(logging.WARNING)
    return await run_demo(
        settings, args.message, tokens=args.tokens, rate=args.rate, gateway=args.gateway
    )


# -- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatstream",
        description="Chat-completion jobs in, live token streams out (Redis Streams).",
    )
    parser.add_argument("--version", action="version", version=f"chatstream {package_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND", dest="command_name")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _add_dashboard(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="serve the operator's dashboard (live, from Redis)")
    p.add_argument("--host", help="listen address (default: CHATSTREAM_DASHBOARD_HOST)")
    p.add_argument("--port", type=int, help="listen port (default: CHATSTREAM_DASHBOARD_PORT)")
    p.set_defaults(command=dashboard_command)


def _add_gateway(sub: Any) -> None:
    p = sub.add_parser("gateway", help="serve the HTTP gateway (OpenAI-compatible, SSE)")
    p.add_argument("--host", help="listen address (default: CHATSTREAM_GATEWAY_HOST)")
    p.add_argument("--port", type=int, help="listen port (default: CHATSTREAM_GATEWAY_PORT)")
    p.set_defaults(command=gateway_command)


def _add_dead(sub: Any) -> None:
    p = sub.add_parser("dead", help="list dead-lettered jobs, or requeue one")
    p.add_argument("--requeue", metavar="JOB", help="run this failed job again (fresh budget)")
    p.add_argument("--limit", type=positive_int, default=1000, help="list at most this many")
    p.add_argument("--json", action="store_true", help="JSON lines")
    p.set_defaults(command=dead_command)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _add_worker(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a worker process")
    p.add_argument(
        "--concurrency", type=positive_int, default=0, help="jobs in flight (default: settings)"
    )
    p.add_argument(
        "--processes",
        type=positive_int,
        default=0,
        help="run N worker processes under a supervisor that restarts crashed ones",
    )
    p.set_defaults(command=worker_command)


def _add_enqueue(sub: Any) -> None:
    p = sub.add_parser("enqueue", help="enqueue a chat job and print its id")
    p.add_argument("--model", required=True)
    p.add_argument("--message", required=True, help="the user message")
    p.add_argument("--system", help="an optional system message")
    p.add_argument("--upstream", default="default", help="a configured upstream name")
    p.add_argument("--job-id", help="client-chosen id (makes enqueue idempotent)")
    p.add_argument("--tenant", default="default", help="who the job is for (fair shares)")
    p.add_argument(
        "--priority",
        choices=["high", "normal", "low"],
        default="normal",
        help="within the tenant: high before normal before low",
    )
    p.add_argument("--mock", type=json.loads, help=argparse.SUPPRESS)
    p.add_argument("--follow", action="store_true", help="print tokens live")
    p.add_argument("--wait", action="store_true", help="wait for the final record")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait at most")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.set_defaults(command=enqueue_command)


def _add_job_commands(sub: Any) -> None:
    p = sub.add_parser(
        "tail",
        help="print a job's events live",
        description="Print a job's events live. Text: the reply as it streams, its line "
        "ended with the job (pipe --json to line-based tools: one line per entry).",
    )
    p.add_argument("job")
    p.add_argument(
        "--after", default="0-0", help="resume after this entry id (e.g. 1718000000000-0)"
    )
    p.add_argument("--json", action="store_true", help="JSON lines, one per entry")
    p.set_defaults(command=tail_command)
    p = sub.add_parser("status", help="print a job's record")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(command=status_command)
    p = sub.add_parser("cancel", help="cancel a queued or running job")
    p.add_argument("job")
    p.set_defaults(command=cancel_command)


def _add_jobs(sub: Any) -> None:
    p = sub.add_parser("jobs", help="list jobs, newest first (from the jobs index)")
    p.add_argument("--status", choices=[status.value for status in JobStatus])
    p.add_argument("--upstream", help="only jobs for this upstream")
    p.add_argument("--tenant", help="only jobs of this tenant")
    p.add_argument("--limit", type=positive_int, default=20, help="list at most this many")
    p.add_argument(
        "--before", type=float, help="only jobs enqueued before this time (Unix seconds)"
    )
    p.add_argument("--json", action="store_true", help="JSON lines")
    p.set_defaults(command=jobs_command)


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="queue length, pending, live workers, dead letters")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(command=stats_command)


def _add_mock_and_demo(sub: Any) -> None:
    p = sub.add_parser("mock-upstream", help="serve a fake OpenAI-compatible streaming API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument(
        "--rate",
        type=float,
        default=MOCK_RATE,
        help=f"tokens per second (default {MOCK_RATE:g}, a reader's pace; 0: as fast as it can)",
    )
    p.add_argument("--tool-calls", type=int, default=0, help="parallel tool calls per reply")
    p.add_argument("--reasoning", type=int, default=0, help="reasoning fragments per reply")
    p.add_argument("--fault", help="inject a fault: http_NNN, sse_NNN, midstream_error, ...")
    p.add_argument("--fault-after", type=int, default=3, help="tokens before a mid-stream fault")
    p.add_argument("--keepalive-every", type=int, default=0, help="': keep-alive' every N chunks")
    p.add_argument(
        "--max-concurrent", type=int, default=0, help="429 beyond this many requests at once"
    )
    p.add_argument(
        "--requests-per-minute", type=int, default=0, help="429 beyond this many in any 60 s"
    )
    p.set_defaults(command=mock_command)
    p = sub.add_parser("demo", help="stream one reply end to end (embedded Redis and upstream)")
    p.add_argument("--message", default="Explain what a durable token stream is.")
    p.add_argument("--tokens", type=int, default=58)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument(
        "--gateway",
        action="store_true",
        help="stream it through the HTTP gateway, then serve the page at / until interrupted",
    )
    p.set_defaults(command=demo_command)


SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_worker,
    _add_enqueue,
    _add_job_commands,
    _add_jobs,
    _add_stats,
    _add_dead,
    _add_mock_and_demo,
    _add_gateway,
    _add_dashboard,
]
