"""`[temporal]` TLS, mTLS and API key: how the worker and the gateway prove who they are
to a Temporal that asks (Temporal Cloud, a cluster with mTLS).  The dev server speaks no
TLS, so a TLS-terminating proxy stands in front of the real one, with certificates made
here; the connection is the SDK's, end to end."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from temporalio.client import Client

from gateway.app import GatewaySettings, create_app
from luftpause.config import ConfigError, Temporal, parse_config
from worker.main import connect

Key = ec.EllipticCurvePrivateKey
ENDPOINTS = [{"name": "e0", "url": "http://127.0.0.1:9", "kind": "sglang", "models": ["m"]}]


def _write(path: Path, cert: x509.Certificate, key: Key) -> tuple[Path, Path]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path.with_suffix(".pem"), path.with_suffix(".key")


def _cert(
    name: str, key: Key, issuer: tuple[x509.Certificate, Key] | None, *, ca: bool = False
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    signer = issuer[1] if issuer else key
    return b.sign(signer, hashes.SHA256())


class Pki:
    """A CA, a server certificate and a client certificate it signed, in files."""

    def __init__(self, tmp: Path) -> None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert("test ca", ca_key, None, ca=True)
        self.ca, _ = _write(tmp / "ca", ca, ca_key)
        keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(2)]
        self.server_cert, self.server_key = _write(
            tmp / "server", _cert("localhost", keys[0], (ca, ca_key)), keys[0]
        )
        self.client_cert, self.client_key = _write(
            tmp / "client", _cert("luftpause worker", keys[1], (ca, ca_key)), keys[1]
        )


@contextlib.asynccontextmanager
async def tls_proxy(target: str, pki: Pki, *, client_certs: bool) -> AsyncIterator[str]:
    """TLS (HTTP/2 by ALPN, as gRPC needs) on a loopback port, bytes passed on to
    `target`; `client_certs`: a client must show a certificate the CA signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    ctx.set_alpn_protocols(["h2"])
    if client_certs:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki.ca)
    host, port = target.rsplit(":", 1)
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []  # both ends of every connection

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            w.close()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        writers.append(w)
        ur, uw = await asyncio.open_connection(host, int(port))
        writers.append(uw)
        both = [asyncio.ensure_future(pipe(r, uw)), asyncio.ensure_future(pipe(ur, w))]
        tasks.update(both)
        await asyncio.gather(*both)

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Closed at once: a TLS close waits for the peer's (up to 30 s), which outlived
        # the test's loop, and the socket was then collected in a later test, unclosed.
        for w in writers:
            w.transport.abort()
        await server.wait_closed()


async def healthy(client: Client) -> bool:
    return bool(await client.service_client.check_health())


async def test_the_worker_reaches_temporal_over_tls_and_mtls(
    temporal_address: str, tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    stop = asyncio.Event()
    async with tls_proxy(temporal_address, pki, client_certs=False) as address:
        t = Temporal(address=address, tls_ca_file=str(pki.ca), tls_server_name="localhost")
        client = await connect(t, stop)
        assert client is not None and await healthy(client)
        # Plain gRPC to a TLS port, or TLS checked against the system's CAs: refused.
        for wrong in (Temporal(address=address), Temporal(address=address, tls=True)):
            with pytest.raises(RuntimeError):
                await Client.connect(wrong.address, **wrong.connect_options({}))
    async with tls_proxy(temporal_address, pki, client_certs=True) as address:
        t = Temporal(
            address=address,
            tls_ca_file=str(pki.ca),
            tls_cert_file=str(pki.client_cert),
            tls_key_file=str(pki.client_key),
            tls_server_name="localhost",
        )
        client = await connect(t, stop)
        assert client is not None and await healthy(client)
        anonymous = t.model_copy(update={"tls_cert_file": None, "tls_key_file": None})
        with pytest.raises(RuntimeError):
            client = await Client.connect(anonymous.address, **anonymous.connect_options({}))
            await healthy(client)  # a TLS 1.3 server may refuse only at the first call


async def test_tls_false_sends_an_api_key_over_plain_grpc(temporal_address: str) -> None:
    # The options left `tls` out for a plain connection, and the SDK turns TLS on by
    # itself beside an API key: `tls = false` with a key spoke TLS to this plain dev
    # server, which refused it (helper-211).  The dev server takes any key.
    t = Temporal(address=temporal_address, api_key_env="TEMPORAL_API_KEY", tls=False)
    client = await Client.connect(t.address, **t.connect_options({"TEMPORAL_API_KEY": "k"}))
    assert await healthy(client)


def test_the_options_say_what_is_missing(tmp_path: Path) -> None:
    assert Temporal().connect_options({}) == {"namespace": "default", "tls": False}
    keyed = Temporal(api_key_env="TEMPORAL_API_KEY", namespace="ns.acct")
    options = keyed.connect_options({"TEMPORAL_API_KEY": " k-123 "})
    assert options["api_key"] == "k-123" and options["tls"] is not None  # a key implies TLS
    with pytest.raises(ConfigError, match="TEMPORAL_API_KEY is not set"):
        keyed.connect_options({})
    # tls = false with a key: the key over plain gRPC, as the SDK allows (a cluster
    # whose TLS a mesh ends; helper-207: the key turned TLS on whatever tls said).
    plain = Temporal(api_key_env="TEMPORAL_API_KEY", tls=False)
    assert plain.connect_options({"TEMPORAL_API_KEY": "k"}) == {
        "namespace": "default",
        "api_key": "k",
        "tls": False,
    }
    with pytest.raises(ConfigError, match="tls = false, but tls_ca_file configure TLS"):
        parse_config({"endpoints": ENDPOINTS, "temporal": {"tls": False, "tls_ca_file": "c"}})
    with pytest.raises(ConfigError, match=r"temporal\.namespace"):
        parse_config({"endpoints": ENDPOINTS, "temporal": {"namespace": ""}})
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=r"temporal: tls_ca_file = .*nope\.pem.*No such file"):
        Temporal(tls_ca_file=str(missing)).connect_options({})
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
        parse_config({"endpoints": ENDPOINTS, "temporal": {"tls_cert_file": "c.pem"}})
    # The gateway checks at start, rather than at its first MCP call.
    config = parse_config({"endpoints": ENDPOINTS, "temporal": {"tls_ca_file": str(missing)}})
    with pytest.raises(ConfigError, match="tls_ca_file"):
        create_app(GatewaySettings(config=config))


async def test_a_namespace_temporal_refuses_to_show_is_said_with_what_to_check() -> None:
    # helper-207: any refusal but NOT_FOUND (no permission for the namespace, a key it
    # does not take) ended the worker in a traceback.  The dev server grants everything,
    # so the refusal comes from a stand-in for the client's service.
    from temporalio.service import RPCError, RPCStatusCode

    import worker.main as worker_main

    class Refusing:
        async def describe_namespace(self, request: object) -> None:
            raise RPCError("Request unauthorized.", RPCStatusCode.PERMISSION_DENIED, b"")

    class Client:
        workflow_service = Refusing()

    t = Temporal(namespace="ns.acct")
    with pytest.raises(RuntimeError) as err:
        await worker_main._namespace_exists(Client(), t)  # type: ignore[arg-type]
    assert str(err.value) == (
        "Temporal at 127.0.0.1:7233 refused to describe namespace 'ns.acct': "
        "PERMISSION_DENIED: Request unauthorized. (check [temporal] namespace and the "
        "credentials: api_key_env, tls_cert_file / tls_key_file)"
    )

    class Away:  # no answer is no refusal: nothing about credentials (helper-211)
        async def describe_namespace(self, request: object) -> None:
            raise RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b"")

    Client.workflow_service = Away()  # type: ignore[assignment]
    with pytest.raises(RuntimeError) as err:
        await worker_main._namespace_exists(Client(), t)  # type: ignore[arg-type]
    assert str(err.value) == (
        "Temporal at 127.0.0.1:7233 did not answer for namespace 'ns.acct': "
        "UNAVAILABLE: connection reset (is it up and reachable?)"
    )


async def test_a_worker_that_finds_no_temporal_says_so_now_and_then_and_what_to_set(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # helper-127: a warning every 0.5 s for a minute (120 lines), then the SDK's own
    # line, which named no setting.
    import worker.main as worker_main
    from luftpause.temporal_dev import free_port

    monkeypatch.setattr(worker_main, "TEMPORAL_CONNECT_PATIENCE_S", 1.0)
    monkeypatch.setattr(worker_main, "TEMPORAL_CONNECT_RETRY_S", 0.05)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError) as err:
        await connect(Temporal(address=address), asyncio.Event())
    assert str(err.value).startswith(f"Temporal at {address} did not answer in 1 s (")
    assert "[temporal] address or LUFTPAUSE_TEMPORAL_ADDRESS" in str(err.value)
    waits = [r for r in caplog.records if "is not answering yet" in r.getMessage()]
    assert len(waits) == 1  # of the tries in that second: one line each 10 s
