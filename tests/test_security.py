"""Security basics: the internal sockets (worker channel, embedded event plane, TCP KV transfer) serve only
peers presenting the cluster token, the gateway compares API keys in constant time and can lock `/metrics`
behind the key (and its own Prometheus then scrapes with it), and settings never show a secret.

Each socket is attacked the way a stranger on the network would: a raw TCP connection without the token,
with a wrong one of the same length, with a prefix of it, with garbage and with a huge frame announcement. It
must close without answering a single byte, and go on serving the fleet's own clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import httpx
import msgspec
import pydantic
import pytest
from conftest import lazy_import, read_until_closed

from dynserve.config import Settings
from dynserve.errors import KVTransferError, WorkerUnavailableError
from dynserve.framing import MAX_HELLO_BYTES, accept_hello, encode_frame, meant_for, read_hello
from dynserve.protocol import GenerateRequest, Hello, LoadRequest, SamplingParams, WorkerInfo
from dynserve.workers.channel import WorkerConnection

torch = lazy_import("torch")

TOKEN = "fleet-token-0123456789abcdef"
WRONG = "fleet-token-0123456789abcdeX"  # the same length, one character off
KEY = "sk-security-test-key-42"
WRONG_KEY = "sk-security-test-key-43"
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _namespace() -> str:
    return f"security-{uuid.uuid4().hex[:8]}"


def _answer_to(host: str, port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Every byte the server sends back to `data` before it closes the connection (a reset counts as a
    close); a server that keeps the connection open past `timeout_s` fails the test."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # it closed before all was sent
            sock.sendall(data)
        received = read_until_closed(sock, timeout_s)
    assert received is not None, f"{host}:{port} kept the connection open past {timeout_s} s"
    return received


def _intrusions(request: bytes) -> dict[str, bytes]:
    """What a stranger might send before `request` (a valid frame of the socket's own protocol)."""
    return {
        "no hello": request,
        "a hello without a token": encode_frame(Hello(None)) + request,
        "a wrong token of the same length": encode_frame(Hello(WRONG)) + request,
        "a prefix of the token": encode_frame(Hello(TOKEN[:-1])) + request,
        "an HTTP request": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        "msgpack garbage": b"\x00\x00\x00\x04\xc1\xc1\xc1\xc1" + request,
        "a 16 MiB frame announced": (2**24).to_bytes(4, "big"),
    }


# ---- the hello, as a function -------------------------------------------------------------------------------

async def _accepts(data: bytes, token: str | None, *, eof: bool = True, timeout_s: float = 1.0,
                   worker_id: str | None = None) -> bool:
    """Whether a server with `token` admits a connection that sends `data`; one that is worker `worker_id`
    as a worker does (`read_hello`, then `meant_for`)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    if worker_id is None:
        return await accept_hello(reader, token, timeout_s=timeout_s)
    hello = await read_hello(reader, token, timeout_s=timeout_s)
    return hello is not None and meant_for(hello, worker_id)


def test_a_hello_admits_only_the_cluster_token() -> None:
    request = encode_frame(LoadRequest())
    assert asyncio.run(_accepts(encode_frame(Hello(TOKEN)) + request, TOKEN))
    for what, data in _intrusions(request).items():
        assert not asyncio.run(_accepts(data, TOKEN)), what
    assert not asyncio.run(_accepts(b"", TOKEN))  # connected and left
    # a server without a token (no cluster token anywhere) admits any hello, but still wants one first
    assert asyncio.run(_accepts(encode_frame(Hello(None)), None))
    assert asyncio.run(_accepts(encode_frame(Hello(WRONG)), None))
    assert not asyncio.run(_accepts(request, None))


def test_a_worker_admits_only_a_hello_meant_for_it_or_for_no_one() -> None:
    """A hello naming another worker (the client means the worker that had this address before) is refused,
    with or without a cluster token; one that names no worker (a client from before the field) is not."""
    for token in (None, TOKEN):
        assert asyncio.run(_accepts(encode_frame(Hello(token, worker_id="w-a")), token, worker_id="w-a"))
        assert asyncio.run(_accepts(encode_frame(Hello(token)), token, worker_id="w-a"))
        assert not asyncio.run(_accepts(encode_frame(Hello(token, worker_id="w-b")), token, worker_id="w-a"))
    assert not asyncio.run(_accepts(encode_frame(Hello(WRONG, worker_id="w-a")), TOKEN, worker_id="w-a"))
    # a server that is not one worker (the event plane) takes a hello whatever worker it names
    assert asyncio.run(_accepts(encode_frame(Hello(TOKEN, worker_id="w-b")), TOKEN))


def test_a_silent_or_oversized_hello_is_refused_without_waiting_for_it() -> None:
    start = time.monotonic()
    assert not asyncio.run(_accepts(b"", TOKEN, eof=False, timeout_s=0.2))  # says nothing: refused on time
    assert 0.15 < time.monotonic() - start < 1.0
    oversized = (MAX_HELLO_BYTES + 1).to_bytes(4, "big")  # its body never comes: refused on the header alone
    start = time.monotonic()
    assert not asyncio.run(_accepts(oversized, TOKEN, eof=False, timeout_s=5.0))
    assert time.monotonic() - start < 0.5


# ---- settings and logs ----------------------------------------------------------------------------------------

def test_settings_never_show_the_token_or_the_key(caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(api_key=KEY, cluster_token=TOKEN)
    assert (settings.secret("api_key"), settings.secret("cluster_token")) == (KEY, TOKEN)
    with caplog.at_level(logging.INFO):
        logging.getLogger("dynserve.test").info("settings: %s / %r", settings, settings)
    shown = [repr(settings), str(settings), f"{settings}", settings.model_dump_json(), caplog.text,
             str(settings.model_dump()), repr(Hello(TOKEN)), str(Hello(TOKEN))]
    for text in shown:
        assert TOKEN not in text and KEY not in text, text
    copied = settings.model_copy(update={"port": 1})  # copies keep the secrets, still hidden
    assert copied.secret("cluster_token") == TOKEN and TOKEN not in repr(copied)
    assert Settings().secret("cluster_token") is None and Settings().secret("api_key") is None


def test_a_bad_token_setting_is_refused_without_echoing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_CLUSTER_TOKEN", "short-secret")
    with pytest.raises(pydantic.ValidationError) as caught:
        Settings()
    assert "cluster_token" in str(caught.value) and "short-secret" not in str(caught.value)
    monkeypatch.setenv("DYN_CLUSTER_TOKEN", TOKEN)
    assert Settings().secret("cluster_token") == TOKEN  # the env twin, as in a pod with the Secret


def test_a_local_fleet_gets_a_random_token_and_a_joined_cluster_keeps_its_own() -> None:
    from dynserve.cli.serve import with_fleet_token

    first, second = with_fleet_token(Settings()), with_fleet_token(Settings())
    tokens = [first.secret("cluster_token"), second.secret("cluster_token")]
    assert all(t is not None and len(t) >= 32 for t in tokens) and tokens[0] != tokens[1]
    assert with_fleet_token(Settings(cluster_token=TOKEN)).secret("cluster_token") == TOKEN
    assert with_fleet_token(Settings(ray_address="10.0.0.1:6379")).cluster_token is None


class _NoWorkers:
    """A stand-in for the gateway's backend (the key check reads none of it): a model id, observers ignored."""

    model_id = "m"

    def add_observer(self, observer: Any) -> None:
        pass


def test_api_keys_of_the_same_length_are_refused(tokenizer: Any) -> None:
    from dynserve.gateway.state import GatewayState
    from dynserve.gateway.errors import ApiError

    state = GatewayState(Settings(api_key=KEY), cast(Any, _NoWorkers()), tokenizer)
    state.check_api_key(f"Bearer {KEY}")
    state.check_api_key(f"bearer {KEY}")
    for header in (f"Bearer {WRONG_KEY}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "", None):
        with pytest.raises(ApiError) as caught:
            state.check_api_key(header)
        assert (caught.value.status, caught.value.code) == (401, "invalid_api_key"), header
    GatewayState(Settings(), cast(Any, _NoWorkers()), tokenizer).check_api_key(None)  # no key: open


# ---- the worker channel -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded_worker(make_mocker: Any) -> WorkerInfo:
    """A mocker worker whose fleet has a cluster token (its own event-plane namespace, created with it)."""
    _handle, info = make_mocker(f"sec-{uuid.uuid4().hex[:6]}", namespace=_namespace(), cluster_token=TOKEN,
                                mocker_speedup=20)
    return cast(WorkerInfo, info)


async def _generate(info: WorkerInfo, token: str | None) -> list[int]:
    connection = WorkerConnection(info)
    await connection.connect(cluster_token=token)
    try:
        load = await connection.load()
        assert load.worker_id == info.worker_id
        request = GenerateRequest(request_id=uuid.uuid4().hex, token_ids=[1, 2, 3, 4, 5], params=GREEDY)
        return [t async for delta in connection.generate(request) for t in delta.token_ids]
    finally:
        await connection.close()


def test_the_worker_channel_answers_strangers_nothing_and_serves_the_fleet(guarded_worker: WorkerInfo) -> None:
    info = guarded_worker
    for what, data in _intrusions(encode_frame(LoadRequest())).items():
        start = time.monotonic()
        assert _answer_to(info.host, info.port, data) == b"", what
        assert time.monotonic() - start < 2.0, what  # closed at once, not at the hello timeout
    with socket.create_connection((info.host, info.port)):  # a silent stranger waits; the fleet does not
        assert len(asyncio.run(_generate(info, TOKEN))) == GREEDY.max_tokens
    assert len(asyncio.run(_generate(info, TOKEN))) == GREEDY.max_tokens


@pytest.mark.parametrize("token", [WRONG, None])
def test_a_client_with_the_wrong_token_is_dropped(guarded_worker: WorkerInfo, token: str | None) -> None:
    with pytest.raises(WorkerUnavailableError):
        asyncio.run(_generate(guarded_worker, token))


# ---- the embedded event plane ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded_plane(ray_instance: Any) -> Iterator[Any]:
    from dynserve.events.ray_plane import RayEventPlane

    plane = RayEventPlane(namespace=_namespace(), cluster_token=TOKEN)
    yield plane
    ray_instance.kill(plane._handle)


def test_the_event_plane_answers_strangers_nothing_and_serves_the_fleet(guarded_plane: Any,
                                                                        ray_instance: Any) -> None:
    from dynserve.events.ray_plane import RayEventPlane, _Call

    info = WorkerInfo(worker_id="w-sec", role="both", host="127.0.0.1", port=1, model_id="m", max_model_len=64,
                      block_size=16, num_blocks=4)

    async def register_and_list() -> list[str]:
        await guarded_plane.register(info, 30.0)
        try:
            return [w.worker_id for w in await guarded_plane.workers()]
        finally:
            await guarded_plane.close()

    assert asyncio.run(register_and_list()) == ["w-sec"]
    host, port = ray_instance.get(guarded_plane._handle.address.remote())
    call = encode_frame(_Call(0, "workers", msgspec.Raw(msgspec.msgpack.encode(()))))
    for what, data in _intrusions(call).items():
        start = time.monotonic()
        assert _answer_to(host, port, data) == b"", what
        assert time.monotonic() - start < 2.0, what
    for token in (WRONG, None):  # the same actor, reached by clients without the fleet's token
        stranger = RayEventPlane(handle=guarded_plane._handle, cluster_token=token)
        with pytest.raises(ConnectionError, match="refused"):
            asyncio.run(stranger.workers())
    assert asyncio.run(register_and_list()) == ["w-sec"]


# ---- the TCP KV transfer backend ------------------------------------------------------------------------------

SHAPE = (8, 2, 2, 4, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]


def _read_first_block(source_token: str | None, reader_token: str | None) -> bool:
    """True when a reader holding the page server's own (published) token and `reader_token` gets block 0
    byte for byte; False when the server refuses it."""
    from dynserve.kv_transfer.tcp_backend import TcpConnector

    cache = torch.randint(-1000, 1000, SHAPE, dtype=torch.int16).to(torch.float16)
    with (TcpConnector("src", Settings(cluster_token=source_token, transfer_timeout_s=5)) as source,
          TcpConnector("dst", Settings(cluster_token=reader_token, transfer_timeout_s=5)) as reader):
        local = torch.zeros(SHAPE, dtype=torch.float16)
        source.register_kv_cache(cache)
        reader.register_kv_cache(local)
        peer = reader.add_peer(source.metadata())
        start = time.monotonic()
        try:
            reader.read_blocks(peer, [0], [0], timeout_s=5.0)
        except KVTransferError:
            assert time.monotonic() - start < 2.0  # refused at once, not timed out
            assert not local.any()
            return False
        assert torch.equal(local[0].view(torch.int16), cache[0].view(torch.int16))
        return True


def test_kv_pages_need_the_cluster_token_as_well_as_the_agent_token() -> None:
    assert _read_first_block(TOKEN, TOKEN)
    assert not _read_first_block(TOKEN, WRONG)
    assert not _read_first_block(TOKEN, None)
    assert _read_first_block(None, None)  # no cluster token anywhere: the agent's token alone, as before


# ---- the gateway: its key on /metrics, and its Prometheus ----------------------------------------------------

def _gateway(info: WorkerInfo, **overrides: Any) -> Any:
    """A gateway over `info` with `overrides` (the tokenizer only: no model weights loaded)."""
    from dynserve.gateway.server import GatewayServer, make_gateway_app
    from dynserve.model.resolve import resolve_model_path
    from dynserve.model.tokenizer import Tokenizer

    settings = Settings(port=0, **overrides)
    return GatewayServer(make_gateway_app(settings, [info], Tokenizer.load(resolve_model_path(None))), settings)


@pytest.fixture(scope="module")
def locked_gateway(guarded_worker: WorkerInfo) -> Iterator[Any]:
    """A gateway with an API key that locks /metrics, over the guarded worker (it presents the token)."""
    with _gateway(guarded_worker, api_key=KEY, metrics_require_key=True, cluster_token=TOKEN) as server:
        yield server


def test_the_gateway_reaches_a_guarded_worker(locked_gateway: Any) -> None:
    response = httpx.post(f"{locked_gateway.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": locked_gateway.app.state.model_id, "prompt": "hi", "max_tokens": 3},
                          timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/metrics", "/metrics/targets"])
def test_metrics_need_the_key_when_asked(locked_gateway: Any, path: str) -> None:
    url = f"{locked_gateway.url}{path}"
    for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": KEY}):
        refused = httpx.get(url, headers=headers, timeout=10)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "dynserve_" not in refused.text and "targets" not in refused.text
    served = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert served.status_code == 200
    assert ("dynserve_requests" in served.text) if path == "/metrics" else served.json()[0]["targets"]
    assert httpx.get(f"{locked_gateway.url}/health", timeout=10).status_code == 200  # liveness stays open


def test_metrics_stay_open_without_the_setting(guarded_worker: WorkerInfo) -> None:
    with _gateway(guarded_worker, api_key=KEY, cluster_token=TOKEN) as open_metrics:
        assert httpx.get(f"{open_metrics.url}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{open_metrics.url}/v1/models", timeout=10).status_code == 401  # the API stays locked


def test_dynctl_serves_prometheus_scrapes_a_locked_gateway_with_the_key(locked_gateway: Any) -> None:
    from dynserve.observability.prometheus import CREDENTIALS_NAME, PrometheusServer
    from dynserve.observability.promql import PrometheusClient

    with PrometheusServer(f"{locked_gateway.url}/metrics/targets", scrape_interval_s=0.5,
                          bearer_token=KEY) as server, PrometheusClient(server.url) as client:
        config = (server.workdir / "prometheus.yml").read_text()
        credentials = server.workdir / CREDENTIALS_NAME
        assert KEY not in config and CREDENTIALS_NAME in config
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        deadline = time.monotonic() + 30
        while True:
            health = {t.labels.get("component"): t.health for t in client.targets()}
            if health.get("gateway") == "up" and health.get("worker") == "up":
                break
            assert time.monotonic() < deadline, f"targets never came up: {client.targets()}"
            time.sleep(0.25)
