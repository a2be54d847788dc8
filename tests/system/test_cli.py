"""The ``chatstream`` command as a user runs it: subprocesses against the test redis-server.

The mock upstream is served by the test's event loop, so every CLI call runs as an
asyncio subprocess (a blocking ``subprocess.run`` would stall the mock it talks to).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from redis.asyncio import Redis

from tests.helpers.checks import check_stream, stream_entries
from tests.helpers.fakes import silent_server
from tests.helpers.fleet import Fleet
from tests.helpers.harness import MOCK, chat
from tests.helpers.processes import CHATSTREAM, clean_env, stop_worker
from tests.helpers.servers import free_port
from worker import speedups
from worker.cli.demo import DEMO_REPLY
from worker.client import Client
from worker.store.keys import Keys
from worker.testing.mock_upstream import MockUpstream, expected_reply, expected_usage

CORES = os.cpu_count() or 2


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


async def run_chatstream(
    args: tuple[str, ...], env: dict[str, str], cwd: Path, cores: asyncio.Semaphore, timeout: float
) -> Result:
    """Run a command to its end within ``timeout`` seconds of its start. At most one command
    per ``cores`` slot runs at once: a deadline is the user's wait for one command, not for
    ten started together on a busy two-core machine."""
    async with cores:
        process = await asyncio.create_subprocess_exec(
            CHATSTREAM, *args, env=env, cwd=cwd,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with asyncio.timeout(timeout):
                out, err = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.communicate()
            raise
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


@dataclass
class Cli:
    fleet: Fleet  # its environment is the commands' too
    cwd: Path
    prefix: str
    redis: Redis
    mock: MockUpstream
    cores: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CORES))

    @property
    def env(self) -> dict[str, str]:
        return self.fleet.env

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    @property
    def client(self) -> Client:
        return Client(self.redis, prefix=self.prefix)

    async def start(
        self, *args: str, env: dict[str, str] | None = None
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            CHATSTREAM,
            *args,
            env={**self.env, "PYTHONFAULTHANDLER": "1", **(env or {})},
            cwd=self.cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 20
    ) -> Result:
        environment = {**self.env, **(env or {})}
        return await run_chatstream(args, environment, self.cwd, self.cores, timeout)


@pytest.fixture
async def cli(fleet: Fleet, redis: Redis, prefix: str, tmp_path: Path) -> Cli:
    """Commands with the environment of the test's workers (``fleet``)."""
    fleet.configure(block_ms=200, shutdown_grace_seconds=5)
    return Cli(fleet, tmp_path, prefix, redis, fleet.mock)


@pytest.fixture
async def worker(cli: Cli) -> AsyncIterator[subprocess.Popen[bytes]]:
    """A ``chatstream worker`` subprocess; stopped with SIGTERM, it must exit 0 at once."""
    [process] = await cli.fleet.start()
    yield process
    if process.poll() is None:
        await cli.fleet.stop([process], timeout=5)
    output = cli.fleet.output()
    assert "Traceback" not in output, output
    assert process.returncode == 0, output


async def read_until(stream: asyncio.StreamReader, marker: bytes, timeout: float = 10) -> bytes:
    data = b""
    async with asyncio.timeout(timeout):
        while marker not in data:
            chunk = await stream.read(4096)
            assert chunk, f"EOF before {marker!r}: {data!r}"
            data += chunk
    return data


async def interrupt(process: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """Ctrl-C, then the command's whole output once it exits (within ``DEADLINE``). One
    that does not exit is sent SIGABRT, which Python's faulthandler (``PYTHONFAULTHANDLER``,
    set by ``Cli.start``) answers with every thread's stack on stderr: the failure then
    says where the command stood, not only that it stood."""
    assert process.stdout is not None and process.stderr is not None
    out, err = bytearray(), bytearray()

    async def drain(stream: asyncio.StreamReader, into: bytearray) -> None:
        while chunk := await stream.read(65536):
            into += chunk

    readers = [drain(process.stdout, out), drain(process.stderr, err)]
    reading = asyncio.ensure_future(asyncio.gather(*readers))
    process.send_signal(signal.SIGINT)
    try:
        async with asyncio.timeout(DEADLINE):
            await asyncio.shield(reading)
            await process.wait()
    except TimeoutError:
        process.send_signal(signal.SIGABRT)
        await asyncio.wait_for(reading, DEADLINE)
        await process.wait()
        pytest.fail(f"no exit {DEADLINE}s after Ctrl-C; its stderr:\n{err.decode()[-6000:]}")
    return bytes(out), bytes(err)


# -- enqueue, tail, status, cancel --------------------------------------------------------


async def test_enqueue_follow_prints_tokens_live_then_the_record(
    cli: Cli, worker: subprocess.Popen[bytes]
) -> None:
    mock_options = {"tokens": 50, "rate": 50}
    request = chat("Hello", **mock_options)
    process = await cli.start(
        "enqueue", "--model", "mock-model", "--message", "Hello", "--follow",
        "--mock", json.dumps(mock_options),
    )  # fmt: skip
    assert process.stdout is not None
    head = await read_until(process.stdout, b"tok0")
    job_id = head.decode().splitlines()[0]
    assert (await cli.client.get(job_id)).status == "running"  # tokens come while it runs
    async with asyncio.timeout(20):
        rest, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    out = (head + rest).decode()
    reply = expected_reply(request, MOCK)
    assert out.startswith(f"{job_id}\n{reply}\n[done]\n")
    assert f"job       {job_id}\n" in out
    assert "status    succeeded\n" in out
    assert "attempt   1\n" in out
    assert "finish    stop\n" in out
    assert f"usage     {json.dumps(expected_usage(request, MOCK))}\n" in out
    assert "Traceback" not in err.decode()


async def test_enqueue_wait_json_prints_the_final_record(
    cli: Cli, worker: subprocess.Popen[bytes]
) -> None:
    result = await cli.run(
        "enqueue", "--model", "mock-model", "--message", "Hi", "--job-id", "cli-1",
        "--wait", "--json", "--timeout", "15", "--mock", '{"tokens": 9, "tool_calls": 1}',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout  # only the record: no job id line
    record = json.loads(lines[0])
    request = chat("Hi", tokens=9, tool_calls=1)
    assert record["id"] == "cli-1"
    assert record["status"] == "succeeded"
    assert record["content"] == expected_reply(request, MOCK)
    assert record["finish_reason"] == "tool_calls"
    assert len(record["tool_calls"]) == 1
    assert record["usage"] == expected_usage(request, MOCK)
    assert record["attempt"] == 1
    assert record["worker"]
    assert "request" not in record
    assert record == json.loads(
        (await cli.client.get("cli-1")).model_dump_json(exclude={"request"})
    )


async def test_tail_and_status_of_a_finished_job(cli: Cli, worker: subprocess.Popen[bytes]) -> None:
    job_id = await cli.client.enqueue(chat("tail me", tokens=50, rate=1000))
    record = await cli.client.result(job_id, timeout=15)
    events = await stream_entries(cli.redis, cli.keys, job_id)
    check_stream(events, record)

    tail, resumed, text, status, plain = await asyncio.gather(
        cli.run("tail", job_id, "--json"),
        cli.run("tail", job_id, "--json", "--after", events[0].id),
        cli.run("tail", job_id),
        cli.run("status", job_id, "--json"),
        cli.run("status", job_id),
    )
    assert tail.returncode == 0, tail.stderr
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert lines == [
        {"id": e.id, "type": e.type.value, "attempt": e.attempt, "data": e.data} for e in events
    ]
    assert [json.loads(line) for line in resumed.stdout.splitlines()] == lines[1:]
    assert text.stdout == f"{record.content}\n[done]\n"
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == json.loads(record.model_dump_json(exclude={"request"}))
    assert plain.stdout.startswith(f"job       {job_id}\nstatus    succeeded\nattempt   1\n")


JSON_TYPES: dict[str, Any] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool,
    "object": dict, "array": list, "null": type(None),
}  # fmt: skip


def conforms(value: Any, schema: dict[str, Any], defs: dict[str, Any]) -> bool:
    """``value`` against the subset of JSON Schema that pydantic generates for records."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    if "anyOf" in schema:
        return any(conforms(value, option, defs) for option in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return kind is None or isinstance(value, JSON_TYPES[kind])


async def test_status_json_prints_only_documented_fields(
    cli: Cli, worker: subprocess.Popen[bytes]
) -> None:
    """Every field ``status --json`` prints, in every state a job reaches, is in
    docs/schemas/job-record.json with the type printed (``seq`` an integer, ...)."""
    schema = json.loads((Path(__file__).parents[2] / "docs/schemas/job-record.json").read_text())
    done = await cli.client.enqueue(chat("ok"))
    failed = await cli.client.enqueue(chat("bad", fault="http_400"))
    slow = await cli.client.enqueue(chat("slow", tokens=2000, rate=20))  # cancelled below
    exhausted = "json-exhausted"  # started 3 times already: fails, is dead-lettered, requeued
    record = {"id": exhausted, "status": "queued", "attempt": "3", "request": json.dumps(chat())}
    assert await cli.client.records.create(exhausted, record) == "created"
    await cli.client.records.mark_queued(exhausted, await cli.client.queue.add(exhausted))
    for job_id in (done, failed, exhausted):
        await cli.client.result(job_id, timeout=15)
    assert await cli.client.requeue(exhausted) == "requeued"
    await cli.client.result(exhausted, timeout=15)
    assert await cli.redis.xread({cli.keys.events(slow): "0-0"}, count=1, block=10_000)
    queued = await cli.client.enqueue(chat("later"), job_id="json-queued", upstream="default")
    results = await asyncio.gather(
        *(cli.run("status", job_id, "--json") for job_id in (done, failed, exhausted, slow, queued))
    )
    assert await cli.client.cancel(slow) == "requested"  # still running: stop it now
    await cli.client.result(slow, timeout=10)
    printed = [json.loads(result.stdout) for result in results]
    assert {p["status"] for p in printed} >= {"succeeded", "failed", "running"}
    assert any(p["budget_base"] == 3 and p["requeued_at"] for p in printed)
    assert any(p["seq"] > 0 for p in printed)
    for fields in printed:
        unknown = set(fields) - set(schema["properties"])
        assert not unknown, unknown
        for name, value in fields.items():
            assert conforms(value, schema["properties"][name], schema["$defs"]), (name, value)


async def test_tail_follows_a_running_job(cli: Cli, worker: subprocess.Popen[bytes]) -> None:
    job_id = await cli.client.enqueue(chat("slow", tokens=160, rate=40))  # 4 s: outlives a start
    process = await cli.start("tail", job_id)
    assert process.stdout is not None
    await read_until(process.stdout, b"tok1")
    assert (await cli.client.get(job_id)).status == "running"
    async with asyncio.timeout(15):
        await process.communicate()
    assert process.returncode == 0
    assert (await cli.client.get(job_id)).status == "succeeded"


async def test_status_of_a_running_job_shows_its_progress(
    cli: Cli, worker: subprocess.Popen[bytes]
) -> None:
    job_id = await cli.client.enqueue(chat("slow", tokens=2000, rate=20))  # cancelled below
    key = cli.keys.events(job_id)
    assert await cli.redis.xread({key: "0-0"}, count=1, block=10_000)
    result = await cli.run("status", job_id)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [f"job       {job_id}", "status    running", "attempt   1"]
    assert re.fullmatch(
        r"progress  (\d+) deltas, (\d+) characters so far; running \d+\.\ds, "
        r"last delta \d+\.\ds ago",
        lines[3],
    ), lines[3]
    assert lines[4].startswith("worker    ") and lines[5] == "upstream  default"
    assert len(lines) == 6  # no empty content line
    assert await cli.client.cancel(job_id) == "requested"  # still running: ends it now


async def test_jobs_lists_newest_first(cli: Cli, worker: subprocess.Popen[bytes]) -> None:
    ok = await cli.client.enqueue(chat("fine"), job_id="listed-ok")
    bad = await cli.client.enqueue(chat("bad", fault="http_401"), job_id="listed-bad")
    for job_id in (ok, bad):
        await cli.client.result(job_id, timeout=15)
    text, failed, first = await asyncio.gather(
        cli.run("jobs"),
        cli.run("jobs", "--status", "failed", "--json"),
        cli.run("jobs", "--limit", "1"),
    )
    assert text.returncode == 0, text.stderr
    header, *rows = text.stdout.splitlines()
    assert header.split()[:4] == ["created", "(UTC)", "job", "status"]
    assert [row.split()[2:5] for row in rows] == [
        ["listed-bad", "failed", "default"],
        ["listed-ok", "succeeded", "default"],
    ]
    assert "upstream_terminal: upstream 'default' returned HTTP 401" in rows[0]
    [line] = [json.loads(x) for x in failed.stdout.splitlines()]
    assert (line["id"], line["status"], line["error"]["status"]) == ("listed-bad", "failed", 401)
    assert first.stdout.splitlines()[1].split()[2] == "listed-bad"
    assert first.stderr.startswith("(more: chatstream jobs --before ")


async def test_enqueue_names_the_tenant_and_the_priority(cli: Cli) -> None:
    args = ("enqueue", "--model", "m", "--message", "mine", "--tenant", "acme")
    enqueue = await cli.run(*args, "--priority", "high")
    assert enqueue.returncode == 0, enqueue.stderr
    record = await cli.client.get(enqueue.stdout.strip())
    assert (record.tenant, record.priority) == ("acme", "high")
    bad = await cli.run(*args[:-2], "--tenant", "no spaces")
    assert bad.returncode == 1 and "tenant" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


async def test_cancel_of_a_queued_job(cli: Cli) -> None:
    enqueue = await cli.run("enqueue", "--model", "m", "--message", "later")
    assert enqueue.returncode == 0, enqueue.stderr
    job_id = enqueue.stdout.strip()
    assert (await cli.client.get(job_id)).status == "queued"
    cancel = await cli.run("cancel", job_id)
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout == "cancelled\n"
    status, tail, again = await asyncio.gather(
        cli.run("status", job_id, "--json"),
        cli.run("tail", job_id, "--json"),
        cli.run("cancel", job_id),
    )
    assert json.loads(status.stdout)["status"] == "cancelled"
    assert [json.loads(line)["type"] for line in tail.stdout.splitlines()] == ["cancelled"]
    assert again.stdout == "cancelled\n"
    assert cli.mock.requests["/v1/chat/completions"] == 0


# -- user errors: one line on stderr, non-zero exit, no traceback, within 10 s -------------

DEADLINE = 10  # seconds: every failure a user can cause is reported within this long


def assert_one_line_error(result: Result, fragment: str, args: Any = None) -> None:
    assert result.returncode == 1, (args, result)
    assert "Traceback" not in result.stderr, (args, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, (args, result.stderr)
    assert lines[0].startswith("chatstream: error: "), (args, lines[0])
    assert fragment in lines[0], (args, lines[0])


async def test_enqueue_wait_times_out_with_one_line(cli: Cli) -> None:
    result = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "never-run", "--wait",
        "--timeout", "0.3", timeout=DEADLINE,
    )  # fmt: skip
    assert_one_line_error(result, "timed out after 0.3s; job never-run goes on")
    assert result.stdout == "never-run\n"


async def test_enqueue_follow_honours_the_timeout(
    cli: Cli, worker: subprocess.Popen[bytes]
) -> None:
    """A 100 s reply followed with --timeout 1: the tokens so far, then one line, exit 1."""
    result = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "slow-follow", "--follow",
        "--timeout", "1", "--mock", '{"tokens": 2000, "rate": 20}', timeout=DEADLINE,
    )  # fmt: skip
    assert_one_line_error(result, "timed out after 1s; job slow-follow goes on")
    assert result.stdout.startswith("slow-follow\ntok0 tok1")
    assert result.stdout.endswith("\n") and "[done]" not in result.stdout
    assert await cli.client.cancel("slow-follow") == "requested"  # it was still running


USER_ERRORS: list[tuple[list[str], dict[str, str], str]] = [
    (["status", "x"], {"CHATSTREAM_REDIS_URL": "http://127.0.0.1:1/0"},
     "invalid settings: CHATSTREAM_REDIS_URL"),
    (["worker"], {"CHATSTREAM_CONCURRENCY": "abc"}, "invalid settings: CHATSTREAM_CONCURRENCY"),
    (["status", "x"], {"CHATSTREAM_RETENTION_SECONDS": "0"},
     "invalid settings: CHATSTREAM_RETENTION_SECONDS"),
    (["stats"], {"CHATSTREAM_UPSTREAMS": "not json"},
     "invalid settings: CHATSTREAM_UPSTREAMS: not valid JSON (Expecting value"),
    (["worker"], {"CHATSTREAM_UPSTREAMS__LOCAL__URL": "ftp://x"},
     "invalid settings: CHATSTREAM_UPSTREAMS__LOCAL__URL: String should match pattern"),
    (["status", "nope"], {}, "no job 'nope'"),
    (["tail", "nope"], {}, "no job 'nope'"),
    (["cancel", "nope"], {}, "no job 'nope'"),
    (["enqueue", "--model", "m", "--message", "x", "--upstream", "other"], {},
     "unknown upstream 'other'"),
    (["enqueue", "--model", "m", "--message", "x", "--job-id", "a b"], {}, "invalid job"),
]  # fmt: skip


async def test_user_errors_are_one_line(cli: Cli) -> None:
    results = await asyncio.gather(
        *(cli.run(*args, env=env, timeout=DEADLINE) for args, env, _ in USER_ERRORS)
    )
    for (args, _, fragment), result in zip(USER_ERRORS, results, strict=True):
        assert_one_line_error(result, fragment, args)
    assert await cli.redis.xlen(cli.keys.queue) == 0


async def test_redis_down_is_one_line_at_once(cli: Cli) -> None:
    """A closed port: one line naming the URL (without its password), no retries first."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cases = [
        (["status", "x"], url, f"cannot reach Redis at {url}"),
        (["worker"], url, f"cannot reach Redis at {url}"),
        (["enqueue", "--model", "m", "--message", "x"], url, f"cannot reach Redis at {url}"),
        (["demo"], url, f"cannot reach Redis at {url}"),
        (
            ["status", "x"],
            f"redis://user:s3cret@127.0.0.1:{port}/0",
            f"cannot reach Redis at redis://user:***@127.0.0.1:{port}/0",
        ),
    ]
    results = await asyncio.gather(
        *(cli.run(*args, env={"CHATSTREAM_REDIS_URL": u}, timeout=DEADLINE) for args, u, _ in cases)
    )
    for (args, _, fragment), result in zip(cases, results, strict=True):
        assert_one_line_error(result, fragment, args)
        assert "s3cret" not in result.stderr


async def test_a_port_that_is_not_redis_is_one_line(cli: Cli) -> None:
    """Something silent on the port, and an HTTP server (the mock upstream) on it."""
    http_port = urlsplit(cli.env["CHATSTREAM_UPSTREAM_URL"]).port
    async with silent_server() as silent_port:
        silent, http = await asyncio.gather(
            cli.run("stats", env={"CHATSTREAM_REDIS_URL": f"redis://127.0.0.1:{silent_port}/0"},
                    timeout=DEADLINE),
            cli.run("stats", env={"CHATSTREAM_REDIS_URL": f"redis://127.0.0.1:{http_port}/0"},
                    timeout=DEADLINE),
        )  # fmt: skip
    assert_one_line_error(silent, f"no answer from Redis at redis://127.0.0.1:{silent_port}/0")
    assert "within 5s (is it a Redis server?)" in silent.stderr
    assert_one_line_error(http, f"Redis at redis://127.0.0.1:{http_port}/0")  # (no answer)


async def test_a_busy_port_is_one_line(cli: Cli) -> None:
    """The mock's port, and the metrics port of a worker and of the demo, taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = {"CHATSTREAM_METRICS_PORT": str(port), "CHATSTREAM_METRICS_HOST": "127.0.0.1"}
        demo_env = {**clean_env(), **busy}  # the demo's own Redis stand-in and mock
        mock, worker, demo = await asyncio.gather(
            cli.run("mock-upstream", "--port", str(port), timeout=DEADLINE),
            cli.run("worker", env=busy, timeout=DEADLINE),
            run_with_env(cli, demo_env, "demo"),
        )
    address = f"127.0.0.1:{port}: address already in use"
    assert_one_line_error(mock, f"the mock upstream cannot listen on {address}")
    metrics = f"the metrics server (CHATSTREAM_METRICS_PORT) cannot listen on {address}"
    assert_one_line_error(worker, metrics)
    # the demo says which stand-ins it uses first, then the one error line
    assert demo.returncode == 1 and "Traceback" not in demo.stderr, demo
    assert demo.stderr.splitlines()[-1] == f"chatstream: error: {metrics}"


async def run_with_env(cli: Cli, env: dict[str, str], *args: str) -> Result:
    """Like ``cli.run``, with exactly ``env`` (no CHATSTREAM_* of the fixture's)."""
    async with cli.cores:
        process = await asyncio.create_subprocess_exec(
            CHATSTREAM, *args, env=env, cwd=cli.cwd,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(DEADLINE):
            out, err = await process.communicate()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


async def test_records_from_other_producers(cli: Cli) -> None:
    """No ``id``: the key names the job. No or an unknown ``status``: one clear line."""
    fields: Any = {"status": "queued", "attempt": "0", "request": "{}"}
    await cli.redis.hset(cli.keys.job("no-id"), mapping=fields)
    await cli.redis.hset(cli.keys.job("no-status"), mapping={"id": "no-status"})
    await cli.redis.hset(cli.keys.job("odd-status"), mapping={**fields, "status": "pending"})
    no_id, no_status, odd = await asyncio.gather(
        cli.run("status", "no-id", "--json", timeout=DEADLINE),
        cli.run("status", "no-status", timeout=DEADLINE),
        cli.run("tail", "odd-status", timeout=DEADLINE),
    )
    assert no_id.returncode == 0, no_id.stderr
    assert json.loads(no_id.stdout)["id"] == "no-id"
    assert_one_line_error(no_status, "job 'no-status': malformed record (status: Field required)")
    assert_one_line_error(odd, "job 'odd-status': malformed record (status: Input should be")


async def test_output_closed_early_exits_quietly(cli: Cli, worker: subprocess.Popen[bytes]) -> None:
    """``| head -1``: exit 141 (SIGPIPE's status) with nothing on stderr, while the job
    still runs; the job is not disturbed. Each job lasts about a second after the first
    line, so ``head`` has surely gone when the rest is written (a 5-token job could end
    before a busy machine scheduled ``head``'s exit: exit 0, no pipe was closed yet)."""
    job_id = await cli.client.enqueue(chat("piped", tokens=60, rate=20), job_id="piped")
    chatstream = shlex.quote(CHATSTREAM)
    mock = json.dumps({"tokens": 20, "rate": 20})
    pipes = [
        f"{chatstream} tail {job_id} --json | head -1",
        f"{chatstream} enqueue --model m --message x --wait --mock '{mock}' | head -1",
    ]
    for pipeline in pipes:
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", f"set -o pipefail; {pipeline}", env=cli.env, cwd=cli.cwd,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(DEADLINE):
            out, err = await process.communicate()
        assert process.returncode == 141, (pipeline, err.decode())
        assert err == b"", (pipeline, err.decode())
        assert len(out.decode().splitlines()) == 1, pipeline
    assert (await cli.client.result(job_id, timeout=15)).status == "succeeded"


async def test_version(cli: Cli) -> None:
    result = await cli.run("--version", timeout=DEADLINE)
    assert (result.returncode, result.stdout) == (0, f"chatstream {version('chatstream')}\n")


USAGE_ERRORS: list[tuple[list[str], str]] = [
    ([], "the following arguments are required: COMMAND"),
    (["enqueue", "--model", "m"], "the following arguments are required: --message"),
    (["status"], "the following arguments are required: job"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["worker", "--concurrency", "many"], "argument --concurrency: invalid"),
    (["worker", "--concurrency", "-3"], "argument --concurrency: invalid"),
    (["enqueue", "--model", "m", "--message", "x", "--mock", "{"], "argument --mock"),
]


async def test_usage_errors_name_the_problem(cli: Cli) -> None:
    """argparse's usage text, then one line naming the problem; exit 2, no traceback."""
    results = await asyncio.gather(*(cli.run(*args) for args, _ in USAGE_ERRORS))
    for (args, fragment), result in zip(USAGE_ERRORS, results, strict=True):
        assert result.returncode == 2, (args, result)
        assert "Traceback" not in result.stderr, (args, result.stderr)
        assert result.stderr.startswith("usage: chatstream"), (args, result.stderr)
        last = result.stderr.splitlines()[-1]
        assert last.startswith("chatstream"), (args, last)
        assert fragment in last, (args, last)
    assert await cli.redis.xlen(cli.keys.queue) == 0


# -- worker lifecycle, demo ---------------------------------------------------------------


async def test_worker_exits_0_on_sigterm_after_finishing_its_job(cli: Cli) -> None:
    [process] = await cli.fleet.start(1, "--concurrency", "4")
    job_id = await cli.client.enqueue(chat("finish me", tokens=40, rate=40))
    async for event in cli.client.events(job_id, block_ms=100):
        assert event.type.value == "delta"
        break
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await stop_worker(process, timeout=8) == 0
    assert loop.time() - began < 8
    record = await cli.client.get(job_id)
    assert record.status == "succeeded"  # the grace period let the running job finish
    assert record.content == expected_reply(chat(tokens=40), MOCK)
    assert await cli.redis.zcard(cli.keys.workers) == 0  # it left the worker set
    log_text = cli.fleet.logs[-1].read_text()
    assert "Traceback" not in log_text
    assert "shutting down gracefully" in log_text
    redis_at = urlsplit(cli.env["CHATSTREAM_REDIS_URL"]).netloc
    upstream = cli.env["CHATSTREAM_UPSTREAM_URL"]
    event_loop = "uvloop" if speedups.uvloop_installed() else "asyncio"
    parser = "hiredis" if speedups.hiredis_installed() else "python"
    transport = "httptools" if speedups.httptools_installed() else "httpx"
    assert (
        f" started: redis {redis_at}/0 tls=off prefix={cli.prefix} upstreams: default={upstream}"
        f" concurrency=4 lease=30s event_loop={event_loop} redis_parser={parser}"
        f" http_transport={transport}\n"
    ) in log_text


async def test_demo_runs_without_any_configuration(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM,
        "demo",
        env=clean_env(),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out_bytes, err_bytes = await process.communicate()
    out, err = out_bytes.decode(), err_bytes.decode()
    assert process.returncode == 0, err
    assert f"\n{DEMO_REPLY}\n[done]\n" in out
    assert "status    succeeded" in out
    assert "in-process Redis stand-in" in err
    assert "mock upstream" in err
    assert "Traceback" not in err
    assert "WARNING" not in out + err  # the worker runs cleanly on the stand-in (heartbeats)


async def test_mock_upstream_command_serves_its_configured_stream() -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM, "mock-upstream", "--port", str(port), "--tokens", "3", "--tool-calls", "2",
        "--keepalive-every", "1", env=clean_env(), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 10)).decode()
        assert f"http://127.0.0.1:{port}/v1" in line
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        async with httpx.AsyncClient() as http:
            reply = await http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        text = reply.text
        assert ": keep-alive" in text
        assert text.count('"tool_calls"') >= 2 and '"finish_reason":"tool_calls"' in text
        assert '"content":" tok2"' in text and text.rstrip().endswith("data: [DONE]")
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 10)


def test_mock_upstream_command_rejects_an_unknown_fault() -> None:
    done = subprocess.run(
        [CHATSTREAM, "mock-upstream", "--fault", "nope"], env=clean_env(), capture_output=True,
        text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == "chatstream: error: unknown mock fault 'nope'"
