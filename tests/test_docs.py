"""The docs against the code: generated references are current, examples run.

* ``docs/schemas/*.json`` and the tables of ``docs/configuration.md`` equal what
  ``python docs/docgen.py`` generates now.
* Every ``CHATSTREAM_*`` name and example value in the docs is a valid setting.
* ``docs/redis.md`` names the real keys and documents every record field the code writes.
* Every event a real worker writes validates as its documented data model, and the
  ``docs/events.md`` sample entries do too.
* The ``python`` and ``sh`` examples of ``docs/consumers.md``, ``docs/redis.md`` and
  ``docs/producers.md`` run against a real redis-server and worker (prefix ``chatstream``
  on database 15 of the test server). ``console`` blocks are illustrations and are not run.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis

from docs import docgen
from schemas.events import DATA_MODELS, EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers.harness import chat
from tests.helpers.servers import RedisServer
from worker.client import Client
from worker.service.metrics import Metrics
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.keys import GROUP, Keys
from worker.store.redis_client import redis_from_settings
from worker.store.stats import QueueCounts
from worker.testing.mock_upstream import MockUpstream

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
OUR_DOCS = (
    "events.md",
    "redis.md",
    "configuration.md",
    "scaling.md",
    "consumers.md",
    "producers.md",
    "operations.md",
    "decisions.md",
    "gateway.md",
    "dashboard.md",
)
DOC_DB = 15
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(name: str, lang: str) -> list[str]:
    text = (DOCS / name).read_text(encoding="utf-8")
    return [m.group("body") for m in FENCE.finditer(text) if m.group("lang") == lang]


def doc_text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


# -- generated references -------------------------------------------------------------------


def test_generated_docs_are_current() -> None:
    stale = [str(path.relative_to(ROOT)) for path in docgen.stale()]
    assert not stale, f"out of date: {stale}; run `python docs/docgen.py`"


def test_docgen_check_mode(tmp_path: Path) -> None:
    assert docgen.main(["--check"]) == 0
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "configuration.md").write_text(
        "x\n<!-- BEGIN GENERATED: settings -->\nold\n<!-- END GENERATED: settings -->\n"
        "<!-- BEGIN GENERATED: upstream -->\n<!-- END GENERATED: upstream -->\n"
    )
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 0
    assert "`CHATSTREAM_REDIS_URL`" in (tmp_path / "docs" / "configuration.md").read_text()


def test_a_missing_generated_section_is_an_error() -> None:
    with pytest.raises(ValueError, match="settings"):
        docgen.fill_generated("no markers here", {"settings": "table"})


def test_every_setting_is_in_the_configuration_table() -> None:
    text = doc_text("configuration.md")
    for name, field in Settings.model_fields.items():
        assert f"| `CHATSTREAM_{name.upper()}` |" in text
        assert field.description, f"Settings.{name} needs a description"


def test_stream_event_schema_constrains_data_per_type() -> None:
    schema = json.loads((DOCS / "schemas" / "stream-event.json").read_text())
    rules = {r["if"]["properties"]["type"]["const"]: r["then"] for r in schema["allOf"]}
    assert set(rules) == {t.value for t in EventType}
    for event_type, model in DATA_MODELS.items():
        ref = rules[event_type.value]["properties"]["data"]["$ref"]
        assert ref == f"#/$defs/{model.__name__}" and model.__name__ in schema["$defs"]


# -- settings named in the docs ---------------------------------------------------------------


def setting_name(variable: str) -> str:
    """``CHATSTREAM_UPSTREAMS__X__URL`` -> ``upstreams``; ``CHATSTREAM_PREFIX`` -> ``prefix``."""
    return variable.removeprefix("CHATSTREAM_").split("__")[0].lower()


def test_every_variable_named_in_the_docs_is_a_setting() -> None:
    texts = [doc_text(name) for name in OUR_DOCS]
    texts.append((ROOT / "README.md").read_text(encoding="utf-8"))
    names = {m for text in texts for m in re.findall(r"\bCHATSTREAM_[A-Z0-9_]+", text)}
    assert names
    unknown = sorted(n for n in names if setting_name(n) not in Settings.model_fields)
    assert not unknown, unknown


async def test_configuration_examples_are_valid_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked = 0
    for block in blocks("configuration.md", "sh"):
        for key in [k for k in os.environ if k.startswith("CHATSTREAM_")]:
            monkeypatch.delenv(key)
        for token in shlex.split(block, comments=True):
            name, sep, value = token.partition("=")
            if not (sep and name.startswith("CHATSTREAM_")):
                continue
            monkeypatch.setenv(name, value)
            settings = Settings(_env_file=None)
            checked += 1
            if name == "CHATSTREAM_REDIS_URL":
                redis_from_settings(settings)  # a client is built (no connection is made)
    assert checked >= 8
    monkeypatch.setenv("CHATSTREAM_UPSTREAMS__OPENROUTER__URL", "https://openrouter.ai/api/v1")
    settings = Settings(_env_file=None)
    assert settings.upstream("openrouter").completions_url.endswith("/api/v1/chat/completions")


# -- links ----------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("name", OUR_DOCS)
def test_relative_links_resolve(name: str) -> None:
    text = doc_text(name)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        if path in ("reliability.md", "failures.md"):
            continue  # written concurrently by another change
        file = (DOCS / path) if path else DOCS / name
        assert file.exists(), f"{name}: broken link {target}"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, f"{name}: no anchor {target}"


def test_readme_links_the_docs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in OUR_DOCS:
        assert f"(docs/{name})" in readme, name


# -- redis.md ---------------------------------------------------------------------------------


def test_redis_md_names_the_real_keys() -> None:
    text = doc_text("redis.md")
    keys = Keys("<p>")
    for key in (keys.queue, keys.dead, keys.workers, keys.cancel_channel, keys.jobs):
        assert f"`{key}`" in text
    assert f"`{keys.job('<id>')}`" in text and f"`{keys.events('<id>')}`" in text
    assert f"consumer group `{GROUP}`" in text
    default = Keys()
    assert f"`{default.job('demo-1')}`" in text and f"`{default.events('demo-1')}`" in text
    assert f"`{default.events('demo-1')}`" in doc_text("events.md")


def documented_record_fields() -> set[str]:
    text = doc_text("redis.md")
    section = text.split("## The job record", 1)[1].split("\n## ", 1)[0]
    fields: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            fields.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return fields


def fields_written_by_the_code() -> set[str]:
    """Record field names in the record scripts (worker/store/lua/records/) and the Python
    writes of worker/store/records.py."""
    store = ROOT / "worker" / "store"
    scripts = sorted((store / "lua" / "records").glob("*.lua"))
    assert len(scripts) >= 9, scripts
    source = "\n".join(p.read_text() for p in [store / "records.py", *scripts])
    fields: set[str] = set()
    script_call = r"redis\.call\('(H(?:SET|DEL|INCRBY|MGET|GET))',\s*KEYS\[1\],([^)]*)\)"
    for command, call in re.findall(script_call, source):
        args = [arg.strip() for arg in call.split(",")]
        names = {"HSET": args[0::2], "HINCRBY": args[:1], "HGET": args[:1]}.get(command, args)
        fields.update(m.group(1) for a in names if (m := re.fullmatch(r"'(\w+)'", a)))
    fields.update(re.findall(r"\.h(?:set|del)\(self\.keys\.job\(job_id\), \"(\w+)\"", source))
    return fields


def test_redis_md_documents_every_record_field() -> None:
    documented = documented_record_fields()
    written = fields_written_by_the_code() | set(JobRecord.model_fields)
    assert {"status", "attempt", "seq", "queue_entry", "started_at", "releases"} <= written
    missing = sorted(written - documented)
    assert not missing, f"document these record fields in docs/redis.md: {missing}"


# -- a real worker on database 15, prefix "chatstream" --------------------------------------


@dataclass
class DocEnv:
    url: str
    redis: Redis
    worker: Worker
    client: Client
    mock: MockUpstream


@pytest.fixture
async def doc_env(
    redis_server: RedisServer | None, settings: Settings, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[DocEnv]:
    if redis_server is None:
        pytest.skip("needs a real redis-server")
    url = f"redis://127.0.0.1:{redis_server.port}/{DOC_DB}"
    redis = Redis.from_url(url, decode_responses=True)
    await redis.flushdb()
    mock, upstream_url = mock_upstream
    settings = settings.model_copy(
        update={
            "redis_url": url,
            "prefix": "chatstream",
            "upstream_url": upstream_url,
            "retry_after_output": True,  # for the reset test
        }
    )
    worker = Worker(settings, redis)
    await worker.startup()
    consume = asyncio.create_task(worker.consume())
    try:
        yield DocEnv(url, redis, worker, Client.from_settings(settings, redis), mock)
    finally:
        consume.cancel()
        await asyncio.gather(consume, return_exceptions=True)
        await worker.shutdown()
        await redis.flushdb()
        await redis.aclose()


async def entries(env: DocEnv, job_id: str) -> list[StreamEvent]:
    rows: Any = await env.redis.xrange(env.client.keys.events(job_id))
    return [StreamEvent.from_entry(eid, fields) for eid, fields in rows]


async def run_doc_python(name: str, env: DocEnv, namespace: dict[str, Any]) -> None:
    for block in blocks(name, "python"):
        source = block.replace("redis://localhost:6379/0", env.url)
        assert ":6379" not in source, "a doc example would reach a Redis the test does not own"
        code = compile(source, f"docs/{name}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            await asyncio.wait_for(result, 30)


async def test_consumers_md_python_examples_run(
    doc_env: DocEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, Any] = {}
    try:
        await run_doc_python("consumers.md", doc_env, namespace)
    finally:
        if "redis" in namespace:
            await namespace["redis"].aclose()
    record = await doc_env.client.get(namespace["job_id"])
    assert record.status == "succeeded" and record.content
    out = capsys.readouterr().out
    assert out.startswith(record.content + "\n[done]\nsucceeded ")
    assert out.endswith(record.content + "\n")  # the redis-py-only example printed it too
    assert namespace["reply"].content == record.content


def doc_consumer(namespace: dict[str, Any]) -> tuple[Any, Any]:
    """``job_events`` and ``Reply`` from docs/consumers.md."""
    for source in blocks("consumers.md", "python"):
        if "def job_events" in source or "class Reply" in source:
            definitions = source.split("\n\nreply = Reply()")[0]  # not the usage lines
            exec(compile(definitions, "docs/consumers.md", "exec"), namespace)
    return namespace["job_events"], namespace["Reply"]


async def replay(env: DocEnv, job_id: str, after: str = "0-0") -> Any:
    job_events, reply_class = doc_consumer({})
    reply = reply_class()
    async for _, type_, _, data in job_events(env.redis, job_id, after=after):
        reply.apply(type_, data)
    return reply


async def test_the_documented_merge_rebuilds_the_record(doc_env: DocEnv) -> None:
    """Reasoning, parallel tool calls and text, merged by the docs' rules == the record."""
    request = chat("everything", tokens=30, reasoning=5, tool_calls=3, rate=400)
    job_id = await doc_env.client.enqueue(request)
    record = await doc_env.client.result(job_id, timeout=30)
    assert record.status == "succeeded"
    reply = await replay(doc_env, job_id)
    assert reply.role == "assistant"
    assert reply.content == record.content
    assert reply.reasoning == record.reasoning and record.reasoning
    assert reply.tool_calls == record.tool_calls and len(record.tool_calls) == 3


async def test_the_documented_merge_handles_coalesced_deltas(doc_env: DocEnv) -> None:
    request = chat("fast", tokens=3000, reasoning=40, tool_calls=2)
    job_id = await doc_env.client.enqueue(request)
    record = await doc_env.client.result(job_id, timeout=30)
    events = await entries(doc_env, job_id)
    assert len(events) < 3000  # many chunks per entry
    reply = await replay(doc_env, job_id)
    assert (reply.content, reply.reasoning, reply.tool_calls) == (
        record.content,
        record.reasoning,
        record.tool_calls,
    )


def scripted(delta: dict[str, Any], finish: str | None = None, index: int = 0, **top: Any) -> str:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    return json.dumps({"id": "c", "model": "m", "choices": [choice], "usage": None, **top})


async def test_the_documented_merge_rebuilds_every_field(doc_env: DocEnv) -> None:
    """n > 1, refusals, signed reasoning blocks, split surrogate pairs and extras: the docs'
    merge rebuilds the record, and every entry validates as its documented model."""
    text, signed = "reasoning.text", {"type": "reasoning.text", "text": "", "signature": "s1"}
    script = [
        scripted({"role": "assistant", "content": "a \ud83d"}),
        scripted({"role": "assistant", "refusal": "no"}, index=1),
        scripted({"content": "\ude00"}, web_search={"hits": 1}),
        scripted({"reasoning_details": [{"type": text, "text": "one"}]}, index=1),
        scripted({"reasoning_details": [signed]}, index=1),
        scripted({"reasoning_details": [{"type": text, "text": "two"}]}, index=1),
        scripted({"tool_calls": [{"index": 0, "id": "t", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}]}, index=1),
        scripted({}, "stop"),
        scripted({}, "tool_calls", index=1),
        "[DONE]",
    ]  # fmt: skip
    job_id = await doc_env.client.enqueue(chat("every field", script=script))
    record = await doc_env.client.result(job_id, timeout=30)
    assert record.status == "succeeded" and record.content == "a 😀"
    reply = await replay(doc_env, job_id)
    assert (reply.content, reply.refusal, reply.reasoning) == ("a 😀", "", [])
    [other] = record.choices
    second = reply.choices[1]
    assert (second.refusal, second.reasoning, second.tool_calls) == (
        other["refusal"],
        other["reasoning"],
        other["tool_calls"],
    )
    assert other["reasoning"] == [{**signed, "text": "one"}, {"type": text, "text": "two"}]
    events = await entries(doc_env, job_id)
    for event in events:
        event.parsed_data()
    assert events[-1].data["web_search"] == {"hits": 1} == record.web_search
    assert events[-1].data["choices"] == [{"index": 1, "finish_reason": "tool_calls"}]


async def test_resuming_from_an_entry_id_continues_the_merge(doc_env: DocEnv) -> None:
    job_id = await doc_env.client.enqueue(chat("resume", tokens=20, rate=500))
    record = await doc_env.client.result(job_id, timeout=30)
    events = await entries(doc_env, job_id)
    job_events, reply_class = doc_consumer({})
    reply = reply_class()
    first = events[len(events) // 2]
    async for entry_id, type_, _, data in job_events(doc_env.redis, job_id):
        reply.apply(type_, data)
        if entry_id == first.id:
            break
    async for _, type_, _, data in job_events(doc_env.redis, job_id, after=first.id):
        reply.apply(type_, data)
    assert reply.content == record.content


async def test_reset_voids_earlier_deltas(doc_env: DocEnv) -> None:
    """A second attempt after output: the docs' merge keeps only the new attempt."""
    request = chat("cut", tokens=10, fault="truncate", fault_after=4, fail_times=1, key="doc")
    job_id = await doc_env.client.enqueue(request)
    record = await doc_env.client.result(job_id, timeout=30)
    assert record.status == "succeeded" and record.attempt == 2
    events = await entries(doc_env, job_id)
    types = [e.type for e in events]
    assert types.count(EventType.RESET) == 1
    reset = types.index(EventType.RESET)
    assert all(e.attempt == 2 for e in events[reset:])
    reply = await replay(doc_env, job_id)
    assert reply.content == record.content


async def test_every_event_validates_as_its_documented_model(doc_env: DocEnv) -> None:
    client = doc_env.client
    jobs = {
        "succeeded": await client.enqueue(chat("ok", tokens=5, reasoning=2, tool_calls=1)),
        "midstream": await client.enqueue(chat("mid", tokens=5, fault="midstream_error")),
        "http_400": await client.enqueue(chat("bad", fault="http_400")),
        "running": await client.enqueue(chat("slow", tokens=200, rate=20)),
    }
    queued = "cancelled-while-queued"
    await doc_env.redis.hset(  # a record the workers never pick up: no queue entry
        client.keys.job(queued), mapping={"id": queued, "status": "queued", "attempt": "0"}
    )
    assert await client.cancel(queued) == "cancelled"
    # the first entry of a job is its first delta: wait until the running job has one
    running_events = client.keys.events(jobs["running"])
    assert await doc_env.redis.xread({running_events: "0-0"}, count=1, block=10_000)
    assert await client.cancel(jobs["running"]) == "requested"
    for job_id in jobs.values():
        await client.result(job_id, timeout=30)
    seen: dict[str, set[str]] = {}
    for job_id in [*jobs.values(), queued]:
        for event in await entries(doc_env, job_id):
            event.parsed_data()  # raises if data does not match the model
            seen.setdefault(event.type.value, set()).update(event.data)
    assert seen["delta"] <= {"role", "content", "reasoning_details", "tool_calls"}
    assert seen["done"] == {"finish_reason", "usage", "served"}
    assert seen["error"] == {"error", "finish_reason", "usage", "served"}
    assert seen["cancelled"] <= {"usage", "served"}
    running = await client.get(jobs["running"])
    partial = await replay(doc_env, jobs["running"])
    assert running.status == "cancelled" and running.content == partial.content != ""
    [cancelled] = await entries(doc_env, queued)
    assert (cancelled.type, cancelled.attempt, cancelled.data) == (EventType.CANCELLED, 0, {})
    assert [e.id async for e in client.events(queued)] == [cancelled.id]


def test_events_md_sample_entries_validate() -> None:
    samples = re.findall(r"^type=(\w+) attempt=(\d+) data=(.+)$", doc_text("events.md"), re.M)
    assert len(samples) >= 8
    for event_type, attempt, data in samples:
        event = StreamEvent.from_entry(
            "1-0", {"type": event_type, "attempt": attempt, "data": data}
        )
        event.parsed_data()


async def test_redis_md_and_consumers_md_commands_run(doc_env: DocEnv) -> None:
    """The ``sh`` blocks, with ``redis-cli`` pointed at the test server, on job demo-1."""
    if shutil.which("redis-cli") is None:
        pytest.skip("needs redis-cli")
    job_id = await doc_env.client.enqueue(chat("cli", tokens=4), job_id="demo-1")
    await doc_env.client.result(job_id, timeout=30)
    for name, expected in (("consumers.md", ("delta", "done", "succeeded")), ("redis.md", ())):
        for block in blocks(name, "sh"):
            assert "JOB=demo-1" in block
            result = await run_sh(block, doc_env.url)
            assert result.returncode == 0, result.stderr
            assert "ERR" not in result.stdout, result.stdout
            for word in expected:
                assert word in result.stdout
    dead = Keys().dead
    assert not await doc_env.redis.exists(dead)  # nothing was dead-lettered here


async def run_sh(block: str, url: str) -> subprocess.CompletedProcess[str]:
    script = "set -euo pipefail\n" + block.replace("redis-cli ", f"redis-cli -u {url} ")
    return await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


async def test_producers_md_enqueues_with_plain_redis_commands(doc_env: DocEnv) -> None:
    """The redis-cli producer, run twice (a retried enqueue): one job, run once, listed,
    readable with chatstream's client like any other."""
    if shutil.which("redis-cli") is None:
        pytest.skip("needs redis-cli")
    [block] = blocks("producers.md", "sh")
    job_id = re.search(r"^JOB=(\S+)$", block, re.M).group(1)  # type: ignore[union-attr]
    first = await run_sh(block, doc_env.url)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() in {"queued", "running", "succeeded"}, first.stdout
    entry = await doc_env.redis.hget(doc_env.client.keys.job(job_id), "queue_entry")
    again = await run_sh(block, doc_env.url)
    assert again.returncode == 0, again.stderr
    record = await doc_env.client.result(job_id, timeout=30)
    assert record.status == "succeeded" and record.content, record
    assert record.attempt == 1 and record.created_at is not None
    assert await doc_env.redis.hget(doc_env.client.keys.job(job_id), "queue_entry") == entry
    events = await entries(doc_env, job_id)
    assert [e.type for e in events if e.type is not EventType.DELTA] == [EventType.DONE]
    assert 86_000 < await doc_env.redis.ttl(doc_env.client.keys.job(job_id)) <= 86_400
    assert [job.id for job in (await doc_env.client.jobs()).jobs] == [job_id]
    assert record.request == {
        "model": "some/model",
        "messages": [{"role": "user", "content": "Hello"}],
    }


# -- operations.md: the metrics, alert rules and log lines it names exist -------------------


def served_metric_names() -> set[str]:
    """Every sample name a worker's /metrics can carry (labelled ones included)."""
    metrics = Metrics()
    metrics.queue.counts = QueueCounts(0, 0, 0)
    metrics.watch_upstreams(lambda: [])  # what every worker registers at start
    metrics.watch_tenants(dict)
    suffixes = {
        "counter": ("_total",),
        "histogram": ("", "_bucket", "_count", "_sum"),  # the table names the family
        "gauge": ("",),
    }
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def metric_names_in(text: str) -> set[str]:
    return set(re.findall(r"\bchatstream_[a-z_]+\b", text))


def test_operations_md_metrics_and_alert_rules_name_served_metrics() -> None:
    served = served_metric_names()
    text = doc_text("operations.md")
    table = text.split("## Metrics and health", 1)[1].split("\n## ", 1)[0]
    assert {"chatstream_tokens_total", "chatstream_upstream_errors_total"} <= metric_names_in(table)
    assert not metric_names_in(table) - served, metric_names_in(table) - served
    [rules_text] = blocks("operations.md", "yaml")
    rules = yaml.safe_load(rules_text)["groups"][0]["rules"]
    assert len(rules) >= 6
    named: set[str] = set()
    for rule in rules:
        assert ("alert" in rule) != ("record" in rule), rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]
        named |= metric_names_in(rule["expr"])
    assert not named - served, named - served
    assert {"chatstream_jobs_total", "chatstream_upstream_errors_total"} <= named


def worker_strings() -> str:
    """Every string literal of worker/*.py (implicit concatenations joined, f-string text
    kept), quotes removed: what the code can log."""
    found: list[str] = []
    for path in (ROOT / "worker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
    return re.sub(r"[\"']", "", "\n".join(found))


def test_operations_md_log_lines_are_what_the_code_logs() -> None:
    """Each documented line's fixed text (between its <placeholders>) is in the code."""
    text = doc_text("operations.md")
    table = text.split("The lines an operator looks for", 1)[1].split("\n\n", 2)[1]
    rows = [row for row in table.splitlines() if row.startswith("| ") and "`" in row]
    assert len(rows) >= 8
    code = worker_strings()
    for row in rows:
        cell = row.split(" | ")[1]
        for line in re.findall(r"`([^`]+)`", cell):
            for part in re.split(r"<[^>]*>", line.replace("\\|", "|")):
                fragment = re.sub(r"[\"']", "", part)
                if len(fragment.strip()) >= 3:
                    assert fragment in code, (fragment, line)
