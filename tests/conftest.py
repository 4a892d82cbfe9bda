"""Shared test fixtures, and the suite's markers, derived from the fixtures each test reaches.

Every expensive fixture says what it needs with `@needs(...)`: the real model's weights (`model`), Ray
(`ray`), a serving fleet of processes (`fleet`: `dynctl serve`, a mocker server, pools of workers), real
Redis or Prometheus (`services`), hosts made of network namespaces (`netns`), a fresh `pip install`
(`install`), a fuzzer's budget (`fuzz`). A test is marked with everything its fixtures need, directly or
through other fixtures, so `-m "not model"` and `make test-fast` (none of them) need no hand-kept list.

Collection imports no torch and loads no weights: the model, the engine and Ray are imported by the
fixtures that need them. TRITON_INTERPRET must be set before anything imports triton, so it is set here,
first.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
# Every process of these tests but the multi-host ones runs on this one host: workers and the event plane
# serve on loopback (the variable reaches Ray's actors through the raylet the session starts).
os.environ.setdefault("DYN_ADVERTISE_HOST", "127.0.0.1")
# The suite runs more compute threads than the machine has cores (two test workers, each with engines and
# model workers of two threads). OpenMP's idle threads spin by default, taking the core from the thread that
# has work: two heavy test files side by side took 2 min 8 s spinning, 55 s with waiting threads asleep.
# Set before torch is imported anywhere; Ray's workers and `dynctl serve` inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray's log monitor (one per Ray node the tests start) looks for new worker log files every 0.1 s while there
# are under 1,000 of them: with the 146 files of 40 actors it took 3.2% of a core, for logs no test reads
# (`log_to_driver=False`). Asked to look every 5 s, 1.3%.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")

from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, TypeVar  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402

from dynserve.config import Settings  # noqa: E402
from dynserve.model.resolve import default_model_path  # noqa: E402

if TYPE_CHECKING:
    from dynserve.engine.llm_engine import LLMEngine, LoadedModel

REPO = Path(__file__).resolve().parent.parent

# ---- markers from fixtures -------------------------------------------------------------------------------

MARKERS = {
    "model": "loads the real model's weights (in the test process or in a worker)",
    "ray": "needs Ray: the test run's instance, or one the test starts",
    "fleet": "starts a serving fleet of processes: dynctl serve, a mocker server, pools of workers",
    "services": "starts a real Redis or Prometheus server",
    "netns": "builds hosts out of network namespaces (root)",
    "install": "pip-installs the package into a fresh virtualenv",
    "fuzz": "runs a fuzzer's budget of generated requests",
    "peers": "runs a peer system from its own venv (vLLM's CPU build): make test-peers, not make test",
    "models": "serves real models other than the default (Gemma 3 270M): make test-models, not make test",
    "gpu": "needs a CUDA device (make test-gpu, scripts/gpu-run.sh); skips without one",
}
F = TypeVar("F", bound=Callable[..., Any])


def needs(*markers: str) -> Callable[[F], F]:
    """Declare what a fixture needs (keys of MARKERS): every test that reaches it is marked so."""
    unknown = set(markers) - set(MARKERS)
    assert not unknown, f"unknown markers {unknown}: declare them in MARKERS"

    def declare(fixture: F) -> F:
        fixture._dynserve_needs = frozenset(markers)  # type: ignore[attr-defined]
        return fixture

    return declare


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--ray-address", default=None,
                     help="run the tests that are not about starting Ray on this Ray cluster instead of a "
                          "local one started for the test run")
    parser.addoption("--fuzz-profile", default=os.environ.get("DYN_FUZZ_PROFILE", "ci"),
                     choices=["ci", "thorough"],
                     help="the fuzzers' budget: 'ci' (make test) or 'thorough' (1,000+ requests; benchmarks, "
                          "nightly runs); env: DYN_FUZZ_PROFILE")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _needs_of(item: pytest.Item) -> set[str]:
    info = getattr(item, "_fixtureinfo", None)
    found: set[str] = set()
    if info is None:
        return found
    for name in item.fixturenames:  # the whole closure: fixtures reached through other fixtures too
        for definition in info.name2fixturedefs.get(name, ()):
            found |= getattr(definition.func, "_dynserve_needs", frozenset())
    return found


# The test files that cost most, slowest first (docs/testing.md): run first, so that with several workers
# (`-n`) the long ones start at once and the short ones fill in at the end.
SLOWEST_FIRST = [
    "test_multihost.py", "test_hf_parity.py", "test_structured_output.py", "test_packaging.py",
    "test_gateway.py", "test_planner_live.py", "test_operator_pods.py", "test_disagg.py",
    "test_architectures.py", "test_accelerator_path.py", "test_observability.py", "test_mocker.py",
    "test_vllm_worker.py", "test_pool.py", "test_deploy_cli.py", "test_events.py", "test_engine.py",
    "test_multimodel.py", "test_structured_corpus.py", "test_gguf_tokenizers.py", "test_cli_serve.py",
    "test_fuzz.py", "test_tokenizer.py", "test_routing.py", "test_peer_pulls.py", "test_router_index.py",
    "test_checkov.py", "test_helm_chart.py", "test_loader.py", "test_suite.py", "test_security.py",
    "test_recovery.py", "test_migration.py", "test_http_limits.py", "test_kv_transfer.py",
    "test_triton_kernels.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker in sorted(_needs_of(item)):
            item.add_marker(marker)
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    # a stable sort of whole files: a file's tests keep their order, so its module fixtures are built once
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


class LazyModule:
    """A module imported on first use: test modules of torch code name `torch` (or an engine module) at the
    top and still import nothing heavy while pytest collects them. Only reading goes through it: patch a
    module by its dotted name (`monkeypatch.setattr("package.module.NAME", value)`)."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _module(self) -> Any:
        import importlib

        return importlib.import_module(object.__getattribute__(self, "_name"))

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):  # what collection asks of every object (`__test__`, `_mock_name`)
            raise AttributeError(attribute)
        return getattr(self._module(), attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        raise TypeError(f"set {attribute!r} on the module itself, not on its lazy name")


def lazy_import(name: str) -> Any:
    return LazyModule(name)


# ---- fuzzing budget ----------------------------------------------------------------------------------------

def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


# A seed derived from the commit: a run is reproducible, and the search moves on from commit to commit.
FUZZ_SEED = int(hashlib.sha256(_commit().encode()).hexdigest()[:12], 16)


@pytest.fixture(scope="session")
@needs("fuzz")
def fuzz_budget(request: pytest.FixtureRequest) -> Callable[[int], hypothesis_settings]:
    """fuzz_budget(thorough_examples) -> Hypothesis settings: the thorough profile's count, or a quarter of it
    (at least 20) in make test, with no example database. (The tests seed their search with `FUZZ_SEED`.)"""
    thorough = request.config.getoption("--fuzz-profile") == "thorough"

    def budget(thorough_examples: int) -> hypothesis_settings:
        from hypothesis import HealthCheck

        examples = thorough_examples if thorough else max(20, thorough_examples // 4)
        return hypothesis_settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                                   suppress_health_check=list(HealthCheck))

    return budget


# ---- the model -------------------------------------------------------------------------------------------

EngineFactory = Callable[..., "LLMEngine"]


@pytest.fixture(scope="session")
@needs("model")
def loaded_model() -> LoadedModel:
    """SmolLM2-135M-Instruct, fp32 on CPU, loaded once for the whole session."""
    from dynserve.engine.llm_engine import load_model

    return load_model(Settings(dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def make_engine(loaded_model: LoadedModel) -> EngineFactory:
    """Build an engine (its own KV cache and scheduler) over the shared model: make_engine(kv_blocks=64)."""
    from dynserve.engine.llm_engine import LLMEngine

    def factory(**overrides: Any) -> LLMEngine:
        settings = Settings(**{"dtype": "float32", "device": "cpu", "kv_blocks": 512, **overrides})
        return LLMEngine(settings, loaded=loaded_model)

    return factory


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's tokenizer, read from its GGUF file (no weights)."""
    from dynserve.model.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M's GGUF (a SentencePiece tokenizer), fetched by `make setup` (scripts/gemma.sh); the test
    skips, saying so, where it is absent."""
    from benchmarks._models import gemma_gguf_path

    try:
        return gemma_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
@needs("model")
def hf_model() -> Any:
    """Hugging Face transformers' model loaded from the same GGUF file (the parity reference).

    Converting the GGUF is transformers' slow part (it dequantizes every tensor in Python), so its result is
    kept once per machine: the fp32 weights of the model transformers built and its config, under a key of the
    GGUF file's bytes and the transformers and torch versions, and reloaded from there by transformers (the
    same logits, bit for bit). What the parity tests compare against is still transformers' reading of that
    GGUF."""
    import torch
    import transformers

    path = default_model_path()
    digest = hashlib.sha256(path.read_bytes())
    digest.update(f"{transformers.__version__} {torch.__version__}".encode())
    cache = _cache_home() / "dynserve" / "hf-reference" / digest.hexdigest()[:24]
    if (cache / "complete").exists():
        return transformers.AutoModelForCausalLM.from_pretrained(str(cache), dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache.parent))
    from safetensors.torch import save_model

    save_model(model, str(staging / "model.safetensors"))  # (save_pretrained refuses a model read from GGUF)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(staging))
    (staging / "complete").touch()
    with contextlib.suppress(OSError):  # another process kept the same one first: either serves
        staging.rename(cache)
    shutil.rmtree(staging, ignore_errors=True)
    return model.eval()


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@pytest.fixture(scope="session")
@needs("gpu")
def cuda() -> Any:
    """The CUDA device; the test skips where there is none. Its Triton kernels must be compiled, not
    interpreted: run with TRITON_INTERPRET=0 (`make test-gpu` does)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 would run the GPU's kernels in the interpreter: set it to 0")
    return torch.device("cuda")


# ---- serving: one Ray instance, one engine worker, gateways over it ------------------------------------

@pytest.fixture(autouse=True, scope="module")
def _reclaim_client_sockets() -> Iterator[None]:
    """At a test module's end, collect what its tests left in reference cycles, quietly for sockets: an
    `openai.OpenAI` client a test made and dropped holds its keep-alive socket in a cycle, and otherwise the
    next full collection (a gateway starting in some later module runs one) would report it there, as an
    error of a test that leaked nothing. A socket left open during a test still errors in that test."""
    yield
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="unclosed <socket", category=ResourceWarning)
        gc.collect()


# Stopped before the test run's Ray shuts down: the gateways `make_gateway` started. Their routers and
# directories read the event plane, and one still running after `ray.shutdown()` reconnects through a Ray
# call, which starts a new local Ray (its agents outlived the run). `make_gateway` may have been set up
# before `ray_instance`, and so be torn down after it.
_STOP_BEFORE_RAY_SHUTDOWN: list[Callable[[], None]] = []


def _shutdown_ray(ray: Any) -> None:
    while _STOP_BEFORE_RAY_SHUTDOWN:
        _STOP_BEFORE_RAY_SHUTDOWN.pop()()
    ray.shutdown()


@pytest.fixture(scope="session")
@needs("ray")
def ray_instance(request: pytest.FixtureRequest) -> Any:
    """The test run's Ray: the cluster `--ray-address` names, else a local instance started for the run
    (small object store, no dashboard, no auth token)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    address = request.config.getoption("--ray-address")
    if address:
        ray.init(address=address, log_to_driver=False)
        yield ray
        _shutdown_ray(ray)
        return
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # logical CPUs: the session's worker takes one, and fleets that join later (pools, `dynctl serve
    # --ray-address`) schedule theirs beside it; with two, a file that ran after others on the same xdist
    # worker could wait for CPUs forever (Ray also starts as many worker processes at once as it has CPUs).
    # workers at niceness 0 by the system config, as every Ray dynserve starts (`dynserve.workers.ray_start`)
    from dynserve.config import ray_system_config

    ray.init(num_cpus=8, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False,
             _temp_dir=temp_dir, _system_config=ray_system_config())
    yield ray
    _shutdown_ray(ray)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
@needs("model")
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

# The gateways `make_gateway` started over workers of their own (`infos` given), stopped at the end of the
# module that started them: once that module's workers are gone, such a gateway still connects to their ports
# every 0.5 s and sends them its channel's frames, whatever server has taken the port since (a later module's
# worker, or its metrics server).
_MODULE_GATEWAYS: list[Any] = []


@pytest.fixture(scope="module", autouse=True)
def _stop_the_modules_gateways() -> Iterator[None]:
    yield
    while _MODULE_GATEWAYS:
        _MODULE_GATEWAYS.pop().stop()


@pytest.fixture(scope="session")
def make_gateway(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    """Start a gateway: make_gateway(api_key="k", max_queue=1) -> GatewayServer, over the session worker
    unless `infos` are given; with `registry` (an event plane), it follows the workers registered there."""
    from dynserve.gateway.server import GatewayServer, make_gateway_app

    servers = []

    def factory(infos: list[Any] | None = None, registry: Any = None, **overrides: Any) -> Any:
        settings = Settings(**{"port": 0, **overrides})
        own = infos is not None
        if infos is None:
            infos = [request.getfixturevalue("worker")[1]]
        app = make_gateway_app(settings, infos, tokenizer, registry=registry)
        server = GatewayServer(app, settings).start()
        servers.append(server)
        if own:
            _MODULE_GATEWAYS.append(server)
        _STOP_BEFORE_RAY_SHUTDOWN.append(server.stop)
        return server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def gateway(make_gateway: GatewayFactory, worker: Any) -> Any:
    """A gateway over the session's model worker."""
    return make_gateway()


@pytest.fixture()
def client(gateway: Any) -> Any:
    """The official openai client against the session gateway (no client-side retries)."""
    import openai

    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- mockers: simulated workers (no model) on the session's Ray -------------------------------------

@pytest.fixture(scope="module")
@needs("fleet")
def make_mocker(ray_instance: Any) -> Any:
    """Start a mocker worker actor: make_mocker("m0", mocker_speedup=10, kv_blocks=256) -> (handle, WorkerInfo);
    `role="prefill"` or `"decode"` for disaggregated serving.
    Mockers publish their KV events on the embedded event plane; a module's are killed at its end (an idle
    actor still costs about 1% of a core, and a session-long mocker idled through most of the run)."""
    from dynserve.workers.worker import launch_mocker

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
@needs("services")
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

@pytest.fixture(scope="session")
@needs("fleet")
def dynctl() -> str:
    """The `dynctl` command of this virtualenv, for tests that start a server or a fleet with it."""
    return str(Path(sys.executable).parent / "dynctl")


@pytest.fixture(scope="session")
@needs("fleet", "ray")
def dynctl_serve() -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """`local_dynctl_serve`, for tests that start a whole `dynctl serve` (with a local Ray of its own)."""
    return local_dynctl_serve


@pytest.fixture(scope="session")
@needs("fleet", "ray")
def dynctl_serve_on_test_ray(ray_instance: Any) -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """`local_dynctl_serve` for tests where starting Ray is not the point: the fleet joins the test run's Ray
    (`--ray-address`) in a namespace of its own (`--namespace`: its own registry and event plane, apart from
    the session's workers and other fleets). A Ray of its own costs about 8 s of CPU here (the head's
    dashboard and runtime-env agents, monitors, idle workers), which the saturated suite pays in wall time. On
    the way out, the fleet's event plane (a detached actor, as on a shared cluster) is removed too."""
    from dynserve.events.ray_plane import ACTOR_NAME, RAY_NAMESPACE

    address = ray_instance.get_runtime_context().gcs_address
    fleets = iter(range(1_000_000))

    @contextlib.contextmanager
    def serve(command: list[str], timeout_s: float, env: dict[str, str] | None = None,
              cwd: Any = None) -> Iterator[Served]:
        namespace = f"test-{os.getpid()}-{next(fleets)}"
        try:
            with local_dynctl_serve([*command, "--ray-address", address, "--namespace", namespace], timeout_s,
                                    env, cwd) as served:
                served.namespace = namespace
                yield served
        finally:
            with contextlib.suppress(ValueError):  # the fleet never got as far as its plane
                ray_instance.kill(ray_instance.get_actor(f"{ACTOR_NAME}-{namespace}", namespace=RAY_NAMESPACE))

    return serve


def wait_for_line(process: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """What `process` wrote to stderr up to the first line containing `marker` (it must stay alive). A process
    still silent at the deadline is killed: a read of its stderr would otherwise block past the deadline
    (a fleet waiting for resources its cluster never frees writes nothing)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    watchdog = threading.Timer(timeout_s, process.kill)
    watchdog.start()
    try:
        while not any(marker in line for line in lines):
            assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s} s: {''.join(lines)}"
            assert process.poll() is None, "".join(lines)
            lines.append(process.stderr.readline())  # type: ignore[union-attr]
    finally:
        watchdog.cancel()
    return "".join(lines)


def banner_port(banner: str) -> int:
    """The port in the `http://host:port/v1` a server's banner names (servers started with port 0)."""
    match = re.search(r"http://[^/\s]+:(\d+)/v1", banner)
    assert match is not None, banner
    return int(match.group(1))


def read_until_closed(sock: socket.socket, within_s: float) -> bytes | None:
    """Every byte the other end sends on `sock` before it closes it (a reset counts as a close: what we had
    not read may make it one), or None when it keeps it open past `within_s`."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return received


@contextlib.contextmanager
def http_get_standin(body: Callable[[], bytes]) -> Iterator[int]:
    """A real HTTP server on a free 127.0.0.1 port answering every GET with `body()` (a stand-in for a peer's
    page: vLLM's `/metrics`, the gateway's `/planner`); yields its port, and stops it on the way out."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            page = body()
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


class StderrDrain(threading.Thread):
    """Reads a long-running process's stderr into memory from the moment it starts, so the process never
    blocks on a full pipe (a fleet on Ray forwards its workers' logs there) and a hang's log can be shown."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        self.process = process
        self.lines: list[str] = []

    def run(self) -> None:
        with contextlib.suppress(ValueError, OSError):  # the pipe closed under it
            for line in self.process.stderr:  # type: ignore[union-attr]
                self.lines.append(line)

    def text(self, timeout_s: float = 10.0) -> str:
        """What it read; waits up to `timeout_s` for the end of the pipe (a grandchild may still hold it)."""
        self.join(timeout_s)
        return "".join(self.lines)


def stop_by_sigint(process: subprocess.Popen[str], drain: StderrDrain | None = None,
                   timeout_s: float = 30.0) -> tuple[int, str]:
    """Ctrl-C `process` and wait for it; (exit code, the rest of its stderr). After `timeout_s` it is killed,
    reaped and its stderr pipe closed, and this raises with the end of its stderr when `drain` reads it (with
    a `dynctl`'s thread stacks: SIGUSR1 first): the test that started it fails, and no later test inherits a
    running process or an open pipe."""
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        if drain is not None:  # a dynctl writes its threads' stacks on SIGUSR1: where it hangs, in the error
            process.send_signal(signal.SIGUSR1)
            time.sleep(2)
        process.kill()
        process.wait(timeout=30)
        tail = drain.text(timeout_s=5)[-12_000:] if drain is not None else "(not read)"
        _close_unless_read(process, drain)
        raise AssertionError(f"{process.args!r} did not exit within {timeout_s:g} s of Ctrl-C; the end of "
                             f"its stderr:\n{tail}") from exc
    if drain is not None:
        rest = drain.text()
    else:
        rest = process.stderr.read()  # type: ignore[union-attr]
    _close_unless_read(process, drain)
    return code, rest


def _close_unless_read(process: subprocess.Popen[str], drain: StderrDrain | None) -> None:
    """Close `process`'s stderr pipe, unless `drain` is still reading it (a grandchild holds its end open):
    the close would wait for that read forever; the daemon thread ends at the pipe's end instead."""
    if drain is None or not drain.is_alive():
        process.stderr.close()  # type: ignore[union-attr]


@dataclass
class Served:
    """A `dynctl serve` started by `local_dynctl_serve`: its banner, port and namespace; after the block, its
    exit code and the rest of its stderr."""

    banner: str
    port: int
    code: int | None = None
    rest: str = ""
    namespace: str = "dynserve"  # its registry and event plane's


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
    drain = None
    try:
        banner = wait_for_line(process, '"messages"', timeout_s)  # the last line of the banner
        served = Served(banner, banner_port(banner))
        drain = StderrDrain(process)
        drain.start()
        yield served
    finally:
        try:
            code, rest = stop_by_sigint(process, drain)
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    served.code, served.rest = code, rest


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> None:
    """A fixture that needs something (`needs`) is set up only for a test marked with it: a test that reaches
    it dynamically (`request.getfixturevalue`) must declare it statically too, or `-m` would let it through."""
    needed = getattr(fixturedef.func, "_dynserve_needs", frozenset())
    item = getattr(request, "_pyfuncitem", None)
    if not needed or item is None:
        return
    missing = needed - {marker.name for marker in item.iter_markers()}
    if missing:
        pytest.fail(f"{item.nodeid} reaches fixture {fixturedef.argname!r}, which needs {sorted(missing)}, without "
                    "asking for it by name: take it as an argument, or mark the parameter that reaches it", False)
