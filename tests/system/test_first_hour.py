"""A newcomer's first hour (issue 26): each finding, run as a user runs it: the
``chatstream`` command or the README's snippet as a subprocess, on the test's real
redis-server, with workers in their own processes."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tests.helpers.checks import eventually, stream_entries
from tests.helpers.fleet import Fleet
from tests.helpers.harness import chat
from tests.helpers.processes import CHATSTREAM, clean_env
from tests.helpers.servers import free_port
from tests.system.test_cli import DEADLINE, Cli, interrupt, read_until, run_chatstream
from worker.cli.demo import DEMO_REPLY
from worker.testing.mock_upstream import serve_mock

pytestmark = pytest.mark.xdist_group("first-hour")


@pytest.fixture
async def cli(fleet: Fleet, redis: Redis, prefix: str, tmp_path: Path) -> Cli:
    fleet.configure(block_ms=200, shutdown_grace_seconds=5)
    return Cli(fleet, tmp_path, prefix, redis, fleet.mock)


# -- 1. a job that waits says so where its readers look -------------------------------------


async def test_follow_says_the_job_waits_for_a_down_upstream(cli: Cli) -> None:
    """A worker whose upstream refuses connections: ``--follow`` prints one waiting line
    naming the upstream and why, the stream has a few ``waiting`` entries (not one per
    retry), and the job ends with the timeout's error naming the outage."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    [process] = await cli.fleet.start(upstream_url=dead, job_timeout=10)
    result = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "waits", "--follow",
        "--timeout", "3", timeout=DEADLINE,
    )  # fmt: skip
    assert result.returncode == 1, result
    assert result.stdout == "waits\n"
    lines = result.stderr.splitlines()
    assert lines[0].startswith("waiting: upstream 'default' down for "), lines
    assert "connection refused" in lines[0], lines
    assert lines[-1] == (
        "chatstream: error: timed out after 3s; job waits goes on (chatstream tail waits "
        f"--after {(await stream_entries(cli.redis, cli.keys, 'waits'))[0].id})"
    )
    status = await cli.run("status", "waits", timeout=DEADLINE)
    assert "status    running\n" in status.stdout, status
    assert "\nwaiting   upstream 'default' down for " in status.stdout, status.stdout
    record = await cli.client.result("waits", timeout=20)
    entries = await stream_entries(cli.redis, cli.keys, "waits")
    kinds = [event.type.value for event in entries]
    assert kinds[-1] == "error" and set(kinds[:-1]) == {"waiting"}, kinds
    assert len(kinds) - 1 <= 3  # 10 s of waiting: said after 1 s, then after 5 s at most
    data = entries[0].data
    assert data["reason"] == "upstream_down" and data["upstream"] == "default"
    assert record.error is not None and "waiting for upstream 'default'" in str(record.error)
    log = await cli.fleet.stop([process])
    assert log.count("upstream 'default' is down (") == 1  # many tries: one line


async def test_follow_says_a_job_no_worker_took_is_queued(cli: Cli) -> None:
    """No worker: the first job is next in line, the fourth has two ahead of it."""
    first = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "first", "--follow",
        "--timeout", "5", timeout=DEADLINE,
    )  # fmt: skip
    for job_id in ("second", "third"):
        await cli.client.enqueue(chat("x"), job_id=job_id)
    fourth = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "fourth", "--follow",
        "--timeout", "5", timeout=DEADLINE,
    )  # fmt: skip
    no_worker = "(no worker beat in 60 s: start one with chatstream worker)"
    lines = first.stderr.splitlines()
    assert lines[0] == f"queued: next in line, waiting for a free worker {no_worker}", lines
    assert len(lines) == 2 and lines[1].endswith("(chatstream tail first)")
    lines = fourth.stderr.splitlines()
    assert lines[0] == (
        "queued: 2 jobs ahead of it in tenant 'default''s queue for upstream 'default', "
        f"waiting for a free worker or its upstream limits {no_worker}"
    ), lines


async def test_follow_says_a_queued_job_waits_for_a_permit(cli: Cli) -> None:
    """A fleet limit of one stream at once, held by a long job: the next job's follower
    is told what it waits for."""
    await cli.fleet.start(upstream_max_concurrent=1)
    slow = await cli.client.enqueue(chat("slow", tokens=2000, rate=20), job_id="slow")
    await eventually(lambda: _running(cli, slow))
    result = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "next", "--follow",
        "--timeout", "5", timeout=DEADLINE,
    )  # fmt: skip
    lines = result.stderr.splitlines()
    assert lines[0] == (
        "queued: 0 jobs ahead of it in tenant 'default''s queue for upstream 'default', "
        "waiting for a free stream of upstream 'default' (1 of 1 at once in use) "
        "(1 live workers)"
    ), lines
    await cli.client.cancel(slow)


async def _running(cli: Cli, job_id: str) -> bool:
    return (await cli.client.get(job_id)).status == "running"


# -- 5. Ctrl-C during --follow ----------------------------------------------------------------


async def test_ctrl_c_during_follow_says_the_job_goes_on(cli: Cli) -> None:
    await cli.fleet.start()
    process = await cli.start(
        "enqueue", "--model", "m", "--message", "x", "--job-id", "interrupted", "--follow",
        "--mock", '{"tokens": 2000, "rate": 20}',
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    await read_until(process.stdout, b"tok1")
    out, err = await interrupt(process)
    assert process.returncode == 130
    assert out.endswith(b"\n")  # the partial line of tokens is ended
    entries = await stream_entries(cli.redis, cli.keys, "interrupted")
    [line] = err.decode().splitlines()
    prefix = (
        "chatstream: interrupted; job interrupted goes on (chatstream tail interrupted --after "
    )
    assert line.startswith(prefix), line
    last = line.removeprefix(prefix).rstrip(")")
    assert last in {event.id for event in entries}
    assert (await cli.client.get("interrupted")).status == "running"  # not cancelled
    tail = await cli.start("tail", "interrupted", "--after", last)  # the hint, as printed
    assert tail.stdout is not None
    await read_until(tail.stdout, b"tok")
    out, err = await interrupt(tail)
    assert tail.returncode == 130 and out.endswith(b"\n")
    [line] = err.decode().splitlines()
    assert line.startswith(prefix) and line != f"{prefix}{last})", line  # it moved on
    await cli.client.cancel("interrupted")


# -- 2. the README's Python snippet runs as written ------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_python() -> str:
    text = README.read_text(encoding="utf-8")
    blocks = [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)]
    assert len(blocks) == 1, "the README has one Python snippet; test the others too"
    return blocks[0]


async def test_the_readme_python_snippet_runs_and_closes_its_connection(cli: Cli) -> None:
    """As a script, under ``python -X dev`` with ResourceWarning an error: it prints the
    reply and the final status, and writes nothing to stderr (no unclosed connection)."""
    await cli.fleet.start()
    source = readme_python()
    assert "redis://localhost:6379/0" in source
    script = cli.cwd / "readme_snippet.py"
    script.write_text(source.replace("redis://localhost:6379/0", cli.env["CHATSTREAM_REDIS_URL"]))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "dev", "-W", "error::ResourceWarning", str(script),
        env=cli.env, cwd=cli.cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert err == b"", err.decode()
    [job] = (await cli.client.jobs()).jobs
    record = await cli.client.get(job.id)
    assert out.decode() == f"{record.content}\nsucceeded {record.usage}\n"
    assert record.content  # the mock's reply to "Hello"


# -- 3. the demo on a shared Redis keeps to itself --------------------------------------------


async def test_demo_on_a_shared_redis_uses_a_prefix_of_its_own(cli: Cli) -> None:
    """A production worker on the same Redis and prefix: the demo's own worker and mock
    upstream run its job (the production upstream gets no request), it says which prefix
    it used, and leaves no key behind."""
    await cli.fleet.start()
    before = sum(cli.mock.requests.values())
    env = {k: v for k, v in cli.env.items() if k != "CHATSTREAM_UPSTREAM_URL"}
    result = await run_chatstream(("demo", "--rate", "0"), env, cli.cwd, cli.cores, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"\n{DEMO_REPLY}\n[done]\n" in result.stdout
    [line] = [line for line in result.stderr.splitlines() if "prefix of its own" in line]
    own = re.search(r"prefix of its own, '([^']+)'", line)
    assert own is not None and own.group(1).startswith(f"{cli.prefix}-demo-"), line
    assert f"workers on {cli.prefix!r} never see its job" in line
    assert sum(cli.mock.requests.values()) == before  # production's upstream was not called
    assert [key async for key in cli.redis.scan_iter(match=f"{own.group(1)}:*")] == []
    assert (await cli.client.jobs()).jobs == []  # nothing under the production prefix


# -- 4. producers name the upstreams the workers serve ----------------------------------------


async def test_enqueue_names_an_upstream_only_the_workers_configure(cli: Cli) -> None:
    """The workers have ``CHATSTREAM_UPSTREAMS__SLOW__URL``, the enqueuing shell does not:
    ``--upstream slow`` runs; a name nobody serves is still one line."""
    await cli.fleet.start(upstreams__slow__url=cli.fleet.upstream_url)
    result = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--upstream", "slow", "--wait",
        "--timeout", "30", "--mock", '{"tokens": 3}',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "status    succeeded" in result.stdout
    job_id = result.stdout.splitlines()[0]
    assert (await cli.client.get(job_id)).upstream == "slow"
    refused = await cli.run(
        "enqueue", "--model", "m", "--message", "x", "--upstream", "fast", timeout=DEADLINE
    )
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == (
        "chatstream: error: unknown upstream 'fast'; configured here: ['default']; served by "
        f"the workers on prefix {cli.prefix!r}: ['default', 'slow']\n"
    )


# -- 6. small ones -------------------------------------------------------------------------


async def test_a_misspelled_setting_is_warned_about_once(cli: Cli) -> None:
    env = {
        "CHATSTREAM_CONCURENCY": "5",
        "CHATSTREAM_UPSTREAMS__SLOW__URL": "http://x/v1",
        "CHATSTREAM_UPSTREAMS__SLOW__MAX_CONCURENT": "2",
    }
    result = await cli.run("stats", env=env, timeout=DEADLINE)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "names no setting" in line]
    assert len(warnings) == 2, result.stderr
    assert warnings[0].endswith(
        "CHATSTREAM_CONCURENCY (did you mean CHATSTREAM_CONCURRENCY?) names no setting; "
        "it is ignored"
    )
    assert warnings[1].endswith(
        "CHATSTREAM_UPSTREAMS__SLOW__MAX_CONCURENT (did you mean "
        "CHATSTREAM_UPSTREAMS__SLOW__MAX_CONCURRENT?) names no setting; it is ignored"
    )
    clean = await cli.run("stats", env={"CHATSTREAM_UPSTREAMS__SLOW__URL": "http://x/v1"})
    assert "names no setting" not in clean.stderr


async def test_small_mistakes_are_accepted_or_said_in_one_line(cli: Cli) -> None:
    lower = await cli.run("stats", env={"CHATSTREAM_LOG_LEVEL": "info"}, timeout=DEADLINE)
    assert lower.returncode == 0, lower.stderr
    await cli.client.enqueue(chat("x"), job_id="some-job")
    garbage = await cli.run("tail", "some-job", "--after", "garbage", timeout=DEADLINE)
    assert garbage.returncode == 1 and garbage.stdout == ""
    assert garbage.stderr == (
        "chatstream: error: --after 'garbage' is not an entry id; entry ids look like "
        "1718000000000-0 (milliseconds-sequence, as tail --json prints them; 0-0: from the "
        "start)\n"
    )
    bad_db = cli.env["CHATSTREAM_REDIS_URL"].rsplit("/", 1)[0] + "/x"
    url = await cli.run("stats", env={"CHATSTREAM_REDIS_URL": bad_db}, timeout=DEADLINE)
    assert url.returncode == 1
    assert url.stderr == (
        "chatstream: error: invalid settings: CHATSTREAM_REDIS_URL: Value error, the database "
        "'x' is not a number (redis://host:port/0; 0 to 15 on a default server)\n"
    )
    dead = await cli.run("dead", timeout=DEADLINE)
    assert dead.returncode == 0
    assert dead.stdout == f"{'entry':<20} {'job':<34} code\n"  # a header, as jobs prints


# -- issue 35: a newcomer's frictions, again -------------------------------------------------


async def test_forcing_a_missing_uvloop_is_the_one_line_error_and_nothing_else(cli: Cli) -> None:
    """``CHATSTREAM_EVENT_LOOP=uvloop`` where uvloop cannot be imported: exit 1 and the
    configuration error alone (a RuntimeWarning about an unawaited coroutine followed)."""
    blocked = "import sys; sys.modules['uvloop'] = None; from worker.cli import main; main()"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", blocked, "worker",
        env={**cli.env, "CHATSTREAM_EVENT_LOOP": "uvloop"}, cwd=cli.cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(DEADLINE):
        out, err = await process.communicate()
    assert (process.returncode, out) == (1, b"")
    assert err.decode() == (
        "chatstream: error: CHATSTREAM_EVENT_LOOP=uvloop, but uvloop is not installed "
        "(pip install 'chatstream[fast]')\n"
    )


SYNC_SCRIPT = """
from worker.client import SyncClient

with SyncClient.from_url({url!r}, prefix={prefix!r}) as client:
    job_id = client.enqueue({{"model": "m", "messages": [{{"role": "user", "content": "Hi"}}]}})
    text = "".join(e.data.get("content", "") for e in client.events(job_id) if e.type == "delta")
    record = client.result(job_id, timeout=60)
    print(text)
    print(record.status)
"""


async def test_sync_client_from_url_runs_as_the_readmes_client_does(cli: Cli) -> None:
    """``SyncClient.from_url`` as ``Client.from_url``: a script under ``python -X dev``
    (ResourceWarning an error) streams a reply from a worker process and closes cleanly."""
    await cli.fleet.start()
    script = cli.cwd / "sync_snippet.py"
    script.write_text(SYNC_SCRIPT.format(url=cli.env["CHATSTREAM_REDIS_URL"], prefix=cli.prefix))
    env = {k: v for k, v in cli.env.items() if k != "CHATSTREAM_PREFIX"}  # from the call
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "dev", "-W", "error::ResourceWarning", str(script),
        env=env, cwd=cli.cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert (process.returncode, err.decode()) == (0, "")
    [job] = (await cli.client.jobs()).jobs
    record = await cli.client.get(job.id)
    assert record.content and out.decode() == f"{record.content}\nsucceeded\n"


async def test_the_mock_upstream_command_streams_at_a_readers_pace(cli: Cli) -> None:
    """``chatstream mock-upstream`` with no options paces its tokens (20 a second), so a
    reply streams visibly through a worker process: 12 tokens take over half a second and
    reach the job's stream in many entries (unpaced, they came in one or two)."""
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM, "mock-upstream", "--port", "0", env=clean_env(), cwd=cli.cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), DEADLINE)
        await cli.fleet.start(upstream_url=line.decode().rsplit(" ", 1)[-1].strip())
        job_id = await cli.client.enqueue(chat("hi", tokens=12))
        record = await cli.client.result(job_id, timeout=30)
    finally:
        process.kill()
        await process.wait()
    assert record.status == "succeeded" and record.content == " ".join(f"tok{i}" for i in range(12))
    assert record.started_at is not None and record.finished_at is not None
    assert record.finished_at - record.started_at >= 0.5
    deltas = [e for e in await stream_entries(cli.redis, cli.keys, job_id) if e.type == "delta"]
    assert len(deltas) >= 6, deltas


async def test_an_upstream_outage_is_one_line_down_and_one_line_back(cli: Cli) -> None:
    """Three jobs wait through a few seconds of refused connections (a hundred probes at
    the fleet's 10-50 ms backoff): the worker writes the outage's two state changes, each
    naming the upstream once, and counts the jobs that waited (there was a WARNING and an
    INFO line per probe, '0 jobs waiting' while one waited, and the name twice)."""
    port = free_port()
    [process] = await cli.fleet.start(upstream_url=f"http://127.0.0.1:{port}/v1")
    ids = [await cli.client.enqueue(chat("x", tokens=3)) for _ in range(3)]
    await asyncio.sleep(3)
    async with serve_mock(host="127.0.0.1", port=port, tokens=3):
        records = [await cli.client.result(job_id, timeout=30) for job_id in ids]
    assert [record.status for record in records] == ["succeeded"] * 3
    log = await cli.fleet.stop([process])
    down, back = [line for line in log.splitlines() if " chatstream.upstream: " in line]
    assert f"upstream 'default' is down (connection refused by 127.0.0.1:{port}" in down
    assert down.count("'default'") == 1 and "WARNING" in down
    assert "upstream 'default' is back after " in back and " (3 jobs waited for it)" in back
