"""Shared test fixtures: one loaded model per session, a factory for engines that share it, and the
Hugging Face reference model for parity tests.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
# Every process of these tests but the multi-host ones runs on this one host: workers and the event plane
# serve on loopback (the variable reaches Ray's actors through the raylet the session starts).
os.environ.setdefault("DYN_ADVERTISE_HOST", "127.0.0.1")

from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from dynserve.config import Settings  # noqa: E402
from dynserve.engine.llm_engine import LLMEngine, LoadedModel, load_model  # noqa: E402
from dynserve.model.resolve import default_model_path  # noqa: E402

EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """SmolLM2-135M-Instruct, fp32 on CPU, loaded once for the whole session."""
    return load_model(Settings(dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def make_engine(loaded_model: LoadedModel) -> EngineFactory:
    """Build an engine (its own KV cache and scheduler) over the shared model: make_engine(kv_blocks=64)."""

    def factory(**overrides: Any) -> LLMEngine:
        settings = Settings(**{"dtype": "float32", "device": "cpu", "kv_blocks": 512, **overrides})
        return LLMEngine(settings, loaded=loaded_model)

    return factory


@pytest.fixture(scope="session")
def tokenizer(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """Hugging Face transformers' model loaded from the same GGUF file (the parity reference)."""
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


# ---- serving: one Ray instance, one engine worker, gateways over it ------------------------------------

@pytest.fixture(scope="session")
def ray_instance() -> Any:
    """A local Ray instance for the session (small object store, no dashboard, no auth token)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False,
             _temp_dir=temp_dir)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def worker(ray_instance: Any) -> Any:
    """One engine worker actor (fp32, 512 KV blocks of 16 tokens) publishing its KV events on the embedded
    event plane; returns (handle, WorkerInfo)."""
    from dynserve.workers.worker import launch_worker

    settings = Settings(dtype="float32", device="cpu", kv_blocks=512, num_threads=2)
    handle, info_ref = launch_worker(settings, "w0", num_cpus=1, publish_events=True)
    info = ray_instance.get(info_ref, timeout=300)
    yield handle, info
    ray_instance.kill(handle)


GatewayFactory = Callable[..., Any]


@pytest.fixture(scope="session")
def make_gateway(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    """Start a gateway: make_gateway(api_key="k", max_queue=1) -> GatewayServer, over the session worker
    unless `infos` are given; with `registry` (an event plane), it follows the workers registered there."""
    from dynserve.gateway.server import GatewayServer, make_gateway_app

    servers = []

    def factory(infos: list[Any] | None = None, registry: Any = None, **overrides: Any) -> Any:
        settings = Settings(**{"port": 0, **overrides})
        if infos is None:
            infos = [request.getfixturevalue("worker")[1]]
        app = make_gateway_app(settings, infos, tokenizer, registry=registry)
        server = GatewayServer(app, settings).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def gateway(make_gateway: GatewayFactory) -> Any:
    return make_gateway()


@pytest.fixture()
def client(gateway: Any) -> Any:
    """The official openai client against the session gateway (no client-side retries)."""
    import openai

    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- mockers: simulated workers (no model) on the session's Ray -------------------------------------

@pytest.fixture(scope="session")
def make_mocker(ray_instance: Any) -> Any:
    """Start a mocker worker actor: make_mocker("m0", mocker_speedup=10, kv_blocks=256) -> (handle, WorkerInfo);
    `role="prefill"` or `"decode"` for disaggregated serving.
    Mockers publish their KV events on the embedded event plane; all are killed at the end of the session."""
    from dynserve.workers.mocker import launch_mocker

    handles = []

    def factory(worker_id: str, role: str = "both", **overrides: Any) -> tuple[Any, Any]:
        settings = Settings(**{"mocker": "cpu", "kv_blocks": 512, **overrides})
        handle, info_ref = launch_mocker(settings, worker_id, role=role, publish_events=True)
        handles.append(handle)
        return handle, ray_instance.get(info_ref, timeout=120)

    yield factory
    for handle in handles:
        ray_instance.kill(handle)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free 127.0.0.1 port for the session, stopped by PID at the end."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (make setup installs it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(10)


async def replay_event_plane() -> tuple[Any, list[str]]:
    """Everything on the embedded event plane so far, applied to a fresh `KVIndex` (every batch must apply
    in order), and the workers registered there."""
    from dynserve.events.ray_plane import RayEventPlane
    from dynserve.router.indexer import KVIndex

    plane = RayEventPlane()
    index, cursor = KVIndex(), "0"
    try:
        while True:
            batches, cursor = await plane.read(cursor, block_s=0.2)
            if not batches:
                return index, [w.worker_id for w in await plane.workers()]
            for batch in batches:
                assert index.apply(batch.worker_id, batch.events)
    finally:
        await plane.close()


# ---- child processes: `dynctl serve` and standalone servers -----------------------------------------------

def wait_for_line(process: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """What `process` wrote to stderr up to the first line containing `marker` (it must stay alive)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not any(marker in line for line in lines):
        assert process.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s} s: {''.join(lines)}"
        lines.append(process.stderr.readline())  # type: ignore[union-attr]
    return "".join(lines)


def banner_port(banner: str) -> int:
    """The port in the `http://host:port/v1` a server's banner names (servers started with port 0)."""
    match = re.search(r"http://[^/\s]+:(\d+)/v1", banner)
    assert match is not None, banner
    return int(match.group(1))


def stop_by_sigint(process: subprocess.Popen[str]) -> tuple[int, str]:
    """Ctrl-C `process` and wait for it (30 s, then it is killed and this raises); (exit code, the rest of
    its stderr)."""
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    rest = process.stderr.read()  # type: ignore[union-attr]
    process.stderr.close()  # type: ignore[union-attr]
    return code, rest


@dataclass
class Served:
    """A `dynctl serve` started by `local_dynctl_serve`: its banner and port; after the block, its exit code
    and the rest of its stderr."""

    banner: str
    port: int
    code: int | None = None
    rest: str = ""


@contextlib.contextmanager
def local_dynctl_serve(command: list[str], timeout_s: float, env: dict[str, str] | None = None,
                       cwd: Any = None) -> Iterator[Served]:
    """Run `command` (a `dynctl serve ... --port 0`) with a local Ray of its own: RAY_TMPDIR a fresh short dir
    (Ray's socket paths must stay under 108 bytes), no RAY_ADDRESS. Yields once its banner is out (port 0: a
    port picked beforehand could be taken by Ray's own start-up; the banner names the one bound); on the way
    out, Ctrl-C (`code`, `rest`) and the Ray dir removed."""
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {**(os.environ if env is None else env), "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        banner = wait_for_line(process, '"messages"', timeout_s)  # the last line of the banner
        served = Served(banner, banner_port(banner))
        yield served
    finally:
        try:
            code, rest = stop_by_sigint(process)
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    served.code, served.rest = code, rest
