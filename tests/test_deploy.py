"""The deployment files against the code: docker-compose.yml, Dockerfile, Procfile.

Docker cannot run here, so these checks read the files: every command parses with the
real CLI parser, every ``CHATSTREAM_*`` variable is a setting and its value validates,
hosts and ports agree between services, the gateways serve the prefix their workers run,
and the image installs the package and runs ``chatstream worker``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from worker.cli.main import build_parser
from worker.errors import ConfigError
from worker.gateway.auth import ApiKeys
from worker.gateway.server import SHUTDOWN_GRACE_SECONDS as GATEWAY_GRACE_SECONDS
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "CHATSTREAM_"
INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?::?-(?P<default>[^}]*))?\}")


# -- helpers ------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def interpolate(value: str) -> str:
    """Compose's ``${NAME:-default}`` with nothing set in the shell: the default."""
    return INTERPOLATION.sub(lambda m: m.group("default") or "", value)


def environment(service: dict[str, Any]) -> dict[str, str | None]:
    """The service's environment; ``None`` = passed through from the shell when set."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = [item.split("=", 1) for item in env]
        return {p[0]: (p[1] if len(p) > 1 else None) for p in pairs}
    return {k: (None if v is None else interpolate(str(v))) for k, v in env.items()}


def argv(command: Any) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def parse_command(command: Any) -> argparse.Namespace:
    """A ``chatstream ...`` command line through the real parser."""
    args = argv(command)
    assert args[0] == "chatstream", args
    try:
        return build_parser().parse_args(args[1:])
    except SystemExit as exc:  # argparse exits on an unknown command or option
        raise AssertionError(f"the CLI rejects {args}") from exc


def duration_seconds(text: str) -> float:
    """Compose durations: ``35s``, ``1m30s``, ``500ms``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def healthcheck_url(service: dict[str, Any]) -> str:
    """The URL a ``python -c "...urlopen('URL'...)"`` healthcheck fetches."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    ast.parse(test[3])  # valid Python
    match = re.search(r"urlopen\('([^']+)'", test[3])
    assert match is not None, test[3]
    return match.group(1)


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# -- docker-compose.yml --------------------------------------------------------------------


SERVICES = {"redis", "worker", "gateway"}
DEMO_SERVICES = {"mock-upstream", "demo-worker", "demo", "demo-gateway"}


def test_compose_has_the_services_and_the_demo_profile() -> None:
    found = services()
    assert set(found) == SERVICES | DEMO_SERVICES
    for name in SERVICES:
        assert "profiles" not in found[name], name
    for name in DEMO_SERVICES:
        assert found[name]["profiles"] == ["demo"], name


def test_redis_is_redis_7_with_aof_and_a_ping_healthcheck() -> None:
    redis = services()["redis"]
    assert redis["image"].split(":")[0] == "redis" and redis["image"].split(":")[1] == "7"
    command = argv(redis["command"])
    assert command[0] == "redis-server"
    assert option(command, "--appendonly") == "yes"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_the_worker_can_be_scaled() -> None:
    """``--scale worker=N`` needs no fixed container name and no host port."""
    worker = services()["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


def test_every_command_parses_with_the_cli() -> None:
    commands = {name: parse_command(s["command"]) for name, s in services().items() if "build" in s}
    assert set(commands) == (SERVICES | DEMO_SERVICES) - {"redis"}
    assert commands["worker"].command.__name__ == "worker_command"
    assert commands["demo-worker"].command.__name__ == "worker_command"
    assert commands["gateway"].command.__name__ == "gateway_command"
    assert commands["demo-gateway"].command.__name__ == "gateway_command"
    assert commands["mock-upstream"].command.__name__ == "mock_command"
    demo = commands["demo"]
    assert demo.command.__name__ == "enqueue_command" and demo.follow


def test_images_are_built_from_this_repository() -> None:
    for name, service in services().items():
        if name != "redis":
            assert service["build"] == ".", name
    assert (ROOT / "Dockerfile").is_file()


def test_every_chatstream_variable_is_a_setting_and_validates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, service in services().items():
        env = environment(service)
        for key in env:
            if key.startswith(ENV_PREFIX):
                field = key[len(ENV_PREFIX) :].lower()
                assert field in Settings.model_fields, f"{name}: {key} is not a setting"
        if any(key.startswith(ENV_PREFIX) for key in env):
            resolved_settings(monkeypatch, env)  # raises if a value is invalid


def resolved_settings(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str | None], shell: dict[str, str] | None = None
) -> Settings:
    """The settings a container gets: the service's environment, pass-through names taken
    from ``shell`` (compose's own environment) when set there."""
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        given = (shell or {}).get(key) if value is None else value
        if given is not None:
            monkeypatch.setenv(key, given)
    return Settings(_env_file=None)


def test_the_services_share_redis_and_the_demo_has_its_own_prefix() -> None:
    found = services()
    envs = {name: environment(found[name]) for name in set(found) - {"redis", "mock-upstream"}}
    redis_url = urlsplit(envs["worker"]["CHATSTREAM_REDIS_URL"] or "")
    assert (redis_url.scheme, redis_url.hostname, redis_url.port) == ("redis", "redis", 6379)
    assert {env["CHATSTREAM_REDIS_URL"] for env in envs.values()} == {redis_url.geturl()}
    demo_prefix = envs["demo"]["CHATSTREAM_PREFIX"]
    prefix = envs["worker"]["CHATSTREAM_PREFIX"]
    assert prefix != demo_prefix  # real workers never see the demo's jobs
    # each gateway enqueues and reads the jobs of the workers beside it
    assert envs["gateway"]["CHATSTREAM_PREFIX"] == prefix
    for name in DEMO_SERVICES - {"mock-upstream"}:
        assert envs[name]["CHATSTREAM_PREFIX"] == demo_prefix, name


def test_the_demo_worker_streams_from_the_mock() -> None:
    found = services()
    upstream = urlsplit(environment(found["demo-worker"])["CHATSTREAM_UPSTREAM_URL"] or "")
    mock_args = argv(found["mock-upstream"]["command"])
    assert upstream.hostname == "mock-upstream"
    assert upstream.port == int(option(mock_args, "--port"))
    assert upstream.path == "/v1"
    assert option(mock_args, "--host") == "0.0.0.0"


def test_the_worker_takes_its_upstreams_from_the_shell_or_chatstream_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It never sets an upstream itself: CHATSTREAM_UPSTREAMS with a ``default`` from the
    shell is accepted (a set CHATSTREAM_UPSTREAM_URL made the settings refuse both), and
    CHATSTREAM_UPSTREAMS__* reach it through the optional chatstream.env."""
    worker = services()["worker"]
    env = environment(worker)
    for name in ("CHATSTREAM_UPSTREAM_URL", "CHATSTREAM_UPSTREAM_API_KEY", "CHATSTREAM_UPSTREAMS"):
        assert env[name] is None, name  # pass-through: unset unless the shell sets it
    shell = {"CHATSTREAM_UPSTREAMS": '{"default": {"url": "https://api.example.com/v1"}}'}
    settings = resolved_settings(monkeypatch, env, shell)
    assert settings.upstream("default").url == "https://api.example.com/v1"
    assert worker["env_file"] == [{"path": "./chatstream.env", "required": False}]
    nested = {"CHATSTREAM_UPSTREAMS__OPENROUTER__URL": "https://openrouter.ai/api/v1"}
    settings = resolved_settings(monkeypatch, {**nested, **env})  # env_file, then environment
    assert settings.upstream_names() == ["default", "openrouter"]
    for ignore_file in (".gitignore", ".dockerignore"):  # it holds keys
        assert "chatstream.env" in (ROOT / ignore_file).read_text().split(), ignore_file


def test_the_gateway_takes_its_keys_from_the_shell_or_chatstream_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No key is written in the file for the real gateway: without one it refuses to start
    (saying so); with keys from the shell (or chatstream.env) it starts."""
    gateway = services()["gateway"]
    env = environment(gateway)
    assert env["CHATSTREAM_GATEWAY_API_KEYS"] is None  # pass-through
    assert gateway["env_file"] == services()["worker"]["env_file"]
    with pytest.raises(ConfigError, match="CHATSTREAM_GATEWAY_API_KEYS"):
        ApiKeys.from_setting(resolved_settings(monkeypatch, env).gateway_api_keys)
    digest = hashlib.sha256(b"sk-team-b").hexdigest()
    shell = {"CHATSTREAM_GATEWAY_API_KEYS": f"sk-team-a,sha256:{digest}"}
    keys = ApiKeys.from_setting(resolved_settings(monkeypatch, env, shell).gateway_api_keys)
    assert keys.check("sk-team-a") and keys.check("sk-team-b")


def test_the_demo_gateway_opens_with_the_key_and_url_the_header_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    header = (ROOT / "docker-compose.yml").read_text().split("services:")[0]
    match = re.search(r"http://127\.0\.0\.1:(\d+)/#key=([^&\s]+)&model=", header)
    assert match is not None, "the header shows the demo page's URL"
    demo = services()["demo-gateway"]
    settings = resolved_settings(monkeypatch, environment(demo))
    assert ApiKeys.from_setting(settings.gateway_api_keys).check(match.group(2))
    assert published(demo) == ("127.0.0.1", int(match.group(1)), gateway_port(demo))


def gateway_port(service: dict[str, Any]) -> int:
    """The port a gateway service listens on (on all of the container's interfaces)."""
    args = argv(service["command"])
    assert option(args, "--host") == "0.0.0.0"  # else nothing outside the container reaches it
    return int(option(args, "--port"))


def published(service: dict[str, Any]) -> tuple[str, int, int]:
    """(host address, host port, container port) of the service's one published port."""
    [mapping] = service["ports"]
    address, host_port, container_port = str(mapping).split(":")
    return address, int(host_port), int(container_port)


def test_the_gateways_listen_publish_and_are_checked_on_one_port() -> None:
    """Each listens on its port, publishes it on the host's loopback only (plain HTTP:
    a TLS proxy goes in front), and is healthy when /healthz answers (Redis reachable)."""
    found = services()
    hosts = set()
    for name in ("gateway", "demo-gateway"):
        port = gateway_port(found[name])
        address, host_port, container_port = published(found[name])
        assert (address, container_port) == ("127.0.0.1", port), name
        url = urlsplit(healthcheck_url(found[name]))
        assert (url.hostname, url.port, url.path) == ("127.0.0.1", port, "/healthz"), name
        assert found[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        hosts.add(host_port)
    assert len(hosts) == 2  # both can run at once
    default = Settings.model_fields["gateway_port"].default  # what the docs' URLs use
    assert published(found["gateway"])[1] == default == 8300


def test_ports_match_the_cli_and_settings_defaults() -> None:
    found = services()
    mock_args = argv(found["mock-upstream"]["command"])
    mock_port = int(option(mock_args, "--port"))
    parser_default = build_parser().parse_args(["mock-upstream"]).port
    settings_default = urlsplit(Settings.model_fields["upstream_url"].default).port
    assert mock_port == parser_default == settings_default == 8400
    assert [str(p) for p in found["mock-upstream"]["expose"]] == [str(mock_port)]
    assert urlsplit(healthcheck_url(found["mock-upstream"])).port == mock_port
    assert healthcheck_url(found["mock-upstream"]).endswith("/v1/models")


def test_the_worker_healthcheck_uses_its_metrics_port() -> None:
    for name in ("worker", "demo-worker"):
        worker = services()[name]
        port = environment(worker)["CHATSTREAM_METRICS_PORT"]
        assert port is not None
        assert [str(p) for p in worker["expose"]] == [port]
        url = urlsplit(healthcheck_url(worker))
        assert (url.hostname, url.port, url.path) == ("127.0.0.1", int(port), "/healthz")


def test_the_stop_timeout_covers_the_shutdown_grace_period() -> None:
    worker = services()["worker"]
    grace = environment(worker).get("CHATSTREAM_SHUTDOWN_GRACE_SECONDS")
    grace_seconds = (
        float(grace) if grace else Settings.model_fields["shutdown_grace_seconds"].default
    )
    assert duration_seconds(worker["stop_grace_period"]) >= grace_seconds + 5
    for name in ("gateway", "demo-gateway"):  # its open streams end within its grace
        stop = duration_seconds(services()[name]["stop_grace_period"])
        assert stop >= GATEWAY_GRACE_SECONDS + 5, name


def test_the_demo_client_waits_for_a_ready_worker_and_mock() -> None:
    depends = services()["demo"]["depends_on"]
    assert depends["redis"]["condition"] == "service_healthy"
    assert depends["mock-upstream"]["condition"] == "service_healthy"
    assert depends["demo-worker"]["condition"] == "service_healthy"


# -- Dockerfile ---------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    result = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            result.append((instruction.upper(), rest.strip()))
    return result


def test_dockerfile_base_image_and_command() -> None:
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    cmd = [args for instruction, args in steps if instruction == "CMD"]
    assert len(cmd) == 1
    command = ast.literal_eval(cmd[0])  # exec form: a JSON array
    assert command == ["chatstream", "worker"]
    assert parse_command(command).command.__name__ == "worker_command"
    assert not [args for instruction, args in steps if instruction == "ENTRYPOINT"]


def test_dockerfile_installs_the_package_and_drops_root() -> None:
    steps = dockerfile()
    runs = [args for instruction, args in steps if instruction == "RUN"]
    package = r"(?:\.|'\.\[fast\]')"  # the package, with its speedups or without
    assert any(re.search(rf"\bpip install (?:--\S+ )*{package}(?:\s|$)", run) for run in runs)
    users = [(i, args) for i, (instruction, args) in enumerate(steps) if instruction == "USER"]
    assert users, "the image must not run as root"
    last_user_index, user = users[-1]
    assert user not in ("root", "0")
    install_index = max(
        i for i, (instruction, args) in enumerate(steps) if instruction == "RUN" and "pip" in args
    )
    assert last_user_index > install_index
    assert any("useradd" in run and user in run for run in runs)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["chatstream"] == "worker.cli:main"


def test_dockerfile_copies_everything_the_package_build_needs() -> None:
    copied: set[str] = set()
    for instruction, args in dockerfile():
        if instruction == "COPY":
            *sources, _ = args.split()
            copied.update(source.rstrip("/") for source in sources)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"]["readme"]}
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        needed.add(pattern.rstrip("*").rstrip("."))
    assert needed <= copied, needed - copied
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not needed & set(ignored)
    for secret_or_bulk in (".env", ".venv", ".git"):
        assert secret_or_bulk in ignored


# -- Procfile -----------------------------------------------------------------------------


def test_procfile_runs_the_worker_and_the_gateway_as_web() -> None:
    """``web`` is the process a Procfile platform routes HTTP to, on the ``$PORT`` it
    sets (Heroku, Dokku; honcho and foreman set one per process too)."""
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip():
            name, _, command = line.partition(":")
            entries[name.strip()] = command.strip()
    assert set(entries) == {"worker", "web"}
    assert parse_command(entries["worker"]).command.__name__ == "worker_command"
    assert "$PORT" in entries["web"]
    web = parse_command(entries["web"].replace("$PORT", "5123"))  # as the platform's shell
    assert web.command.__name__ == "gateway_command"
    assert (web.host, web.port) == ("0.0.0.0", 5123)
