"""Redis over TLS (``rediss://``): workers, clients and the CLI.

A dedicated redis-server listens only on a TLS port (``--port 0``) with a certificate
signed by a throw-away CA the test generates (``cryptography``). The CA reaches redis-py
through the URL query (``?ssl_ca_certs=...``): no code path needs anything else.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas.events import EventType
from tests.helpers.harness import chat
from tests.helpers.servers import RedisServer, redis_executable
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import redis_from_settings
from worker.testing.mock_upstream import MockConfig, MockUpstream, expected_reply, serve_mock

PASSWORD = "tls-Pa55word-0a1b2c"


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path  # a CA that did not sign the server certificate


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(directory: Path, name: str) -> tuple[Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def make_certs(directory: Path) -> Certs:
    ca_path, ca_cert, ca_key = _ca(directory, "chatstream-test-ca")
    other_ca, _, _ = _ca(directory, "some-other-ca")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Certs(ca_path, cert_path, key_path, other_ca)


class TLSRedisServer(RedisServer):
    """redis-server with TLS only (``--port 0``) and a password."""

    def __init__(self, executable: str, directory: Path, certs: Certs) -> None:
        super().__init__(executable, directory)
        self.certs = certs
        self.extra = (
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(certs.cert),
            "--tls-key-file",
            str(certs.key),
            "--tls-ca-cert-file",
            str(certs.ca),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
        )

    def url_with(self, ca: Path | None, password: str | None = PASSWORD) -> str:
        auth = f":{password}@" if password else ""
        query = f"?ssl_ca_certs={ca}" if ca is not None else ""
        return f"rediss://{auth}127.0.0.1:{self.port}/0{query}"

    @property
    def url(self) -> str:
        return self.url_with(self.certs.ca)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TLSRedisServer]:
    executable = redis_executable()
    if executable is None:
        pytest.skip("needs redis-server")
    with tempfile.TemporaryDirectory(prefix="chatstream-tls-") as directory:
        server = TLSRedisServer(executable, Path(directory), make_certs(Path(directory)))
        try:
            server.start()
        except Exception as exc:  # a redis-server built without TLS
            server.stop()
            pytest.skip(f"redis-server without TLS support: {exc}")
        yield server
        server.stop()


@dataclass
class TLSSetup:
    server: TLSRedisServer
    settings: Settings
    redis: Redis
    worker: Worker
    client: Client
    mock: MockUpstream


@pytest.fixture
async def tls(tls_server: TLSRedisServer, settings: Settings) -> AsyncIterator[TLSSetup]:
    app = MockUpstream(MockConfig(tokens=8))
    async with serve_mock(app=app) as url:
        config = settings.model_copy(update={"redis_url": tls_server.url, "upstream_url": url})
        redis = redis_from_settings(config)
        assert isinstance(redis, Redis)
        worker = Worker(config, redis)
        await worker.startup()
        try:
            yield TLSSetup(
                tls_server, config, redis, worker, Client.from_settings(config, redis), app
            )
        finally:
            await worker.shutdown()
            await redis.aclose()


async def test_worker_and_client_work_over_tls(tls: TLSSetup) -> None:
    assert tls.redis.connection_pool.connection_kwargs["ssl_ca_certs"] == str(tls.server.certs.ca)
    request = chat("over tls")
    job_id = await tls.client.enqueue(request)
    assert await tls.worker.run_burst() == 1
    record = await tls.client.result(job_id, timeout=5)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, tls.mock.config)
    events = [event async for event in tls.client.events(job_id)]
    assert events[-1].type is EventType.DONE


async def test_cancel_over_tls_uses_pubsub(tls: TLSSetup) -> None:
    job_id = await tls.client.enqueue(chat("slow", tokens=400, rate=20.0))
    burst = asyncio.create_task(tls.worker.run_burst())
    async with asyncio.timeout(5):
        async for event in tls.client.events(job_id, block_ms=100):
            if event.type is EventType.DELTA:
                break
    assert await tls.client.cancel(job_id) == "requested"
    async with asyncio.timeout(2):  # the pub/sub message, not the 1.7 s flag poll
        await tls.mock.disconnected.wait()
    await burst
    assert (await tls.client.get(job_id)).status == "cancelled"


async def test_tls_without_the_ca_or_with_another_ca_is_refused(tls: TLSSetup) -> None:
    for ca in (None, tls.server.certs.other_ca):
        redis = Redis.from_url(tls.server.url_with(ca))
        with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await redis.ping()
        await redis.aclose()


async def test_plain_redis_to_the_tls_port_is_refused(tls: TLSSetup) -> None:
    redis = Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{tls.server.port}/0")
    with pytest.raises(RedisConnectionError):
        await redis.ping()
    await redis.aclose()


# -- the CLI in a subprocess --------------------------------------------------------------------


async def cli(
    tls: TLSSetup, tmp_path: Path, redis_url: str, *args: str, timeout: float = 15
) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "CHATSTREAM_REDIS_URL": redis_url,
        "CHATSTREAM_PREFIX": tls.settings.prefix,
        "CHATSTREAM_UPSTREAM_URL": tls.settings.upstream_url,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from worker.cli import main; main(sys.argv[1:])",
        *args,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(timeout):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_enqueues_and_waits_over_tls(tls: TLSSetup, tmp_path: Path) -> None:
    consume = asyncio.create_task(tls.worker.consume())
    try:
        code, out, err = await cli(
            tls, tmp_path, tls.server.url, "enqueue", "--model", "m", "--message", "hi", "--wait"
        )
        assert code == 0, err
        job_id = out.splitlines()[0]
        assert "status    succeeded" in out
        code, out, err = await cli(tls, tmp_path, tls.server.url, "status", job_id, "--json")
        assert code == 0, err
        assert '"status":"succeeded"' in out
    finally:
        tls.worker.stopping.set()
        consume.cancel()
        await asyncio.gather(consume, return_exceptions=True)


async def test_cli_reports_a_tls_failure_without_the_password(
    tls: TLSSetup, tmp_path: Path
) -> None:
    url = tls.server.url_with(tls.server.certs.other_ca)
    code, out, err = await cli(tls, tmp_path, url, "status", "x")
    assert code == 1
    assert out == ""
    assert err.startswith("chatstream: error: cannot reach Redis at rediss://:***@127.0.0.1:")
    assert "CERTIFICATE_VERIFY_FAILED" in err
    assert PASSWORD not in err
