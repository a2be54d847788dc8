"""The deployment files against the code: docker-compose.yml, Dockerfile, Procfile.

Docker cannot run here, so these checks read the files: every command parses with the
real CLI parser, every ``CHATSTREAM_*`` variable is a setting and its value validates,
hosts and ports agree between services, and the image installs the package and runs
``chatstream worker``.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from worker.cli import build_parser
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


def test_compose_has_the_services_and_the_demo_profile() -> None:
    found = services()
    assert {"redis", "worker", "mock-upstream", "demo-worker", "demo"} <= set(found)
    assert "profiles" not in found["redis"] and "profiles" not in found["worker"]
    for name in ("mock-upstream", "demo-worker", "demo"):
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
    assert set(commands) == {"worker", "mock-upstream", "demo-worker", "demo"}
    assert commands["worker"].command.__name__ == "worker_command"
    assert commands["demo-worker"].command.__name__ == "worker_command"
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
    envs = {name: environment(found[name]) for name in ("worker", "demo-worker", "demo")}
    redis_url = urlsplit(envs["worker"]["CHATSTREAM_REDIS_URL"] or "")
    assert (redis_url.scheme, redis_url.hostname, redis_url.port) == ("redis", "redis", 6379)
    assert {env["CHATSTREAM_REDIS_URL"] for env in envs.values()} == {redis_url.geturl()}
    demo_prefix = envs["demo"]["CHATSTREAM_PREFIX"]
    assert envs["demo-worker"]["CHATSTREAM_PREFIX"] == demo_prefix
    assert envs["worker"]["CHATSTREAM_PREFIX"] != demo_prefix  # real workers never see it


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


def test_procfile_runs_the_worker() -> None:
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip():
            name, _, command = line.partition(":")
            entries[name.strip()] = command.strip()
    assert entries == {"worker": "chatstream worker"}
    for command in entries.values():
        assert parse_command(command).command.__name__ == "worker_command"
