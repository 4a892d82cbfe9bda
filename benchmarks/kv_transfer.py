"""KV-page read bandwidth between two Ray actors: NIXL (UCX) and the TCP fallback against a plain memcpy.

Two actors (one CPU each) own block-major KV caches of 512 blocks of 256 KiB (fp16, [blocks, 4 layers, 2,
16 tokens, 8 KV heads, 128]). The reader pulls batches of 1, 4, 16 and 64 MiB from the owner, two ways:
- `contiguous`: a run of adjacent blocks on both sides, one descriptor;
- `scattered` (full run only): every other block on both sides, one descriptor per block.
Baseline in the same run and process: `memcpy`, torch copies of the same bytes between two tensors of the
reader (one copy for contiguous, one per block for scattered). Each repeat times memcpy, NIXL and TCP back
to back so load on the machine hits all three alike; `*_gbps_*` and `nixl_vs_memcpy_*` come from each
one's fastest repeat, `nixl_vs_memcpy_median_*` from median times. Every batch is checked byte for byte.
`idle_cpu_percent` is what both actors burn while nothing moves; the full run then repeats 16 MiB with
NIXL's own progress thread on (`*_progress_thread_*`), the setting this layer turns off by default.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.kv_transfer [--quick]
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.kv_transfer --hosts [--quick]   # across hosts (root)

The last stdout line is the JSON result; a copy goes to `benchmarks/results/`. UCX runs with
`DYN_TRANSFER_UCX_TLS` / `DYN_TRANSFER_UCX_NET_DEVICES` when set, else cma,tcp,self on lo.

With cma, a NIXL READ is the kernel's process_vm_readv on the owner's pages. The measurements and their
history: `docs/benchmarks.md` (kv_transfer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks._common import git_commit, log, machine_info, start_local_ray, write_result
from dynserve.config import Settings
from dynserve.kv_transfer import coalesce_block_runs, make_connector
from dynserve.kv_transfer.nixl_backend import nixl_available

BLOCK_SHAPE = (4, 2, 16, 8, 128)  # layers, K/V, tokens, KV heads, head_dim: 256 KiB in fp16
BLOCK_BYTES = 4 * 2 * 16 * 8 * 128 * 2
NUM_BLOCKS = 512
SIZES_MIB = (1, 4, 16, 64)


def _block_ids(size_mib: int, pattern: str) -> tuple[list[int], list[int]]:
    """(remote, local) block ids of one batch."""
    count = size_mib * 2**20 // BLOCK_BYTES
    if pattern == "contiguous":
        return list(range(count)), list(range(NUM_BLOCKS - count, NUM_BLOCKS))
    return list(range(0, 2 * count, 2)), list(range(1, 2 * count, 2))


def _cache(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=generator)
    return raw.view(torch.float16).view(NUM_BLOCKS, *BLOCK_SHAPE)


class KVAgent:
    """One worker's KV cache and a connector of each backend over it (a Ray actor)."""

    def __init__(self, name: str, seed: int, connectors: dict[str, dict[str, Any]]) -> None:
        self.name = name
        self.cache = _cache(seed)
        self.scratch = torch.zeros_like(self.cache)  # the memcpy baseline's source
        self.connectors: dict[str, Any] = {}
        for label, settings in connectors.items():
            self.add_connector(label, settings)

    def add_connector(self, label: str, settings: dict[str, Any]) -> None:
        if "advertise_host" not in settings:  # across hosts: serve on this node's address
            import ray

            settings = {**settings, "advertise_host": ray.util.get_node_ip_address()}
        connector = make_connector(Settings(**settings), f"{self.name}-{label}")
        connector.register_kv_cache(self.cache)
        self.connectors[label] = connector

    def close_connector(self, label: str) -> None:
        self.connectors.pop(label).close()

    def cpu_s(self) -> float:
        return time.process_time()

    def info(self) -> dict[str, Any]:
        return {"torch_num_threads": torch.get_num_threads(), "pid": os.getpid(),
                "ucx_tls": os.environ.get("UCX_TLS"), "ucx_net_devices": os.environ.get("UCX_NET_DEVICES"),
                "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE")}

    def metadata(self, labels: list[str]) -> dict[str, bytes]:
        return {label: self.connectors[label].metadata() for label in labels}

    def add_peers(self, metadata: dict[str, bytes]) -> dict[str, str]:
        return {label: self.connectors[label].add_peer(md) for label, md in metadata.items()}

    def round(self, peers: dict[str, str], remote_ids: list[int], local_ids: list[int]) -> dict[str, float]:
        """One repeat: seconds for the memcpy baseline, then a read with each backend."""
        runs = coalesce_block_runs(remote_ids, local_ids)
        start = time.perf_counter()
        for run in runs:
            self.cache[run.local_start : run.local_start + run.num_blocks].copy_(
                self.scratch[run.remote_start : run.remote_start + run.num_blocks])
        seconds = {"memcpy": time.perf_counter() - start}
        for backend, peer in peers.items():
            start = time.perf_counter()
            self.connectors[backend].read_blocks(peer, remote_ids, local_ids, timeout_s=60)
            seconds[backend] = time.perf_counter() - start
        return seconds

    def verify(self, peer: str, backend: str, owner_seed: int, remote_ids: list[int],
               local_ids: list[int]) -> bool:
        self.cache[local_ids] = 0
        self.connectors[backend].read_blocks(peer, remote_ids, local_ids, timeout_s=60)
        expected = _cache(owner_seed)[remote_ids]
        return torch.equal(self.cache[local_ids].view(torch.uint8), expected.view(torch.uint8))

    def close(self) -> None:
        for connector in self.connectors.values():
            connector.close()


def _transfer_settings(backend: str, **overrides: Any) -> dict[str, Any]:
    settings = Settings()
    return {"transfer_backend": backend, "transfer_ucx_tls": settings.transfer_ucx_tls or "cma,tcp,self",
            "transfer_ucx_net_devices": settings.transfer_ucx_net_devices or "lo",
            "transfer_progress_thread": settings.transfer_progress_thread, "advertise_host": "127.0.0.1",
            **overrides}


def _connect(ray: Any, owner: Any, reader: Any, labels: list[str]) -> dict[str, str]:
    return ray.get(reader.add_peers.remote(ray.get(owner.metadata.remote(labels))))


def _measure(ray: Any, reader: Any, peers: dict[str, str], pattern: str, size_mib: int,
             repeats: int) -> dict[str, list[float]]:
    """Seconds of each repeat, per name ("memcpy" and each peer's label)."""
    remote_ids, local_ids = _block_ids(size_mib, pattern)
    ray.get(reader.round.remote(peers, remote_ids, local_ids))  # warm-up (first touch, connection)
    seconds: dict[str, list[float]] = {name: [] for name in ("memcpy", *peers)}
    for _ in range(repeats):
        for name, taken_s in ray.get(reader.round.remote(peers, remote_ids, local_ids)).items():
            seconds[name].append(taken_s)
    return seconds


def _figures(seconds: dict[str, list[float]], size_mib: int, key: str,
             labels: dict[str, str]) -> dict[str, float]:
    """GB/s of the fastest repeat per name, and the NIXL / memcpy ratio of fastest and of median times."""
    gbps = {name: size_mib * 2**20 / min(taken) / 1e9 for name, taken in seconds.items()}
    out = {f"{labels[name]}_gbps_{key}": round(value, 3) for name, value in gbps.items()}
    for name in seconds:
        if name.startswith("nixl"):
            out[f"{labels[name]}_vs_memcpy_{key}"] = round(gbps[name] / gbps["memcpy"], 3)
            ratio = statistics.median(seconds["memcpy"]) / statistics.median(seconds[name])
            out[f"{labels[name]}_vs_memcpy_median_{key}"] = round(ratio, 3)
    return out


def _idle_cpu_percent(ray: Any, actors: list[Any], window_s: float = 2.0) -> float:
    """CPU the two actor processes use while nothing is transferred (pollers, progress threads)."""
    before = sum(ray.get([a.cpu_s.remote() for a in actors]))
    time.sleep(window_s)
    return round((sum(ray.get([a.cpu_s.remote() for a in actors])) - before) / window_s * 100, 1)


def _with_nixl_progress_thread(ray: Any, owner: Any, reader: Any, repeats: int) -> dict[str, float]:
    """The diagnosis of the default: NIXL with its own UCX progress thread on both sides, 16 MiB only (the
    threads exist only during this phase, so they disturb none of the other figures)."""
    label, settings = "nixl_pt", _transfer_settings("nixl", transfer_progress_thread=True)
    ray.get([owner.add_connector.remote(label, settings), reader.add_connector.remote(label, settings)])
    peers = _connect(ray, owner, reader, [label])
    out = {"idle_cpu_percent_with_nixl_progress_thread": _idle_cpu_percent(ray, [owner, reader])}
    seconds = _measure(ray, reader, peers, "contiguous", 16, repeats)
    ray.get([owner.close_connector.remote(label), reader.close_connector.remote(label)])
    out.update(_figures(seconds, 16, "16mib", {"memcpy": "memcpy_pt_phase", label: "nixl_progress_thread"}))
    log(f"with NIXL's progress thread: {out}")
    return out


def _hosts_driver(ray_address: str, repeats: int) -> None:
    """The bandwidth part of `--hosts`, run on host a of the harness: the owner on host b, the reader on host c,
    NIXL (UCX as the hosts' environment sets it) and TCP, contiguous 16 and 64 MiB; the figures as JSON."""
    import ray

    ray.init(address=ray_address, log_to_driver=False)
    backends = ["nixl", "tcp"]
    connectors = {backend: {"transfer_backend": backend} for backend in backends}
    owner = ray.remote(KVAgent).options(num_cpus=1, resources={"host_b": 0.01}).remote("owner", 1, connectors)
    reader = ray.remote(KVAgent).options(num_cpus=1, resources={"host_c": 0.01}).remote("reader", 2, connectors)
    peers = _connect(ray, owner, reader, backends)
    result: dict[str, Any] = {"reader": ray.get(reader.info.remote())}
    for size_mib in (16, 64):
        seconds = _measure(ray, reader, peers, "contiguous", size_mib, repeats)
        remote_ids, local_ids = _block_ids(size_mib, "contiguous")
        for backend, peer in peers.items():
            if not ray.get(reader.verify.remote(peer, backend, 1, remote_ids, local_ids)):
                raise SystemExit(f"{backend} read the wrong bytes across hosts ({size_mib} MiB)")
        result.update(_figures(seconds, size_mib, f"{size_mib}mib", {"memcpy": "memcpy", "nixl": "nixl",
                                                                      "tcp": "fallback"}))
    ray.get([owner.close.remote(), reader.close.remote()])
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, contiguous pattern only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per size [default: 10, quick 8]")
    parser.add_argument("--hosts", action="store_true",
                        help="across hosts made of network namespaces (needs root): NIXL vs TCP bandwidth, and "
                             "a remotely prefilled request's TTFT across hosts vs on one host")
    parser.add_argument("--hosts-driver", metavar="RAY_ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hosts_driver:
        _hosts_driver(args.hosts_driver, args.repeats or (5 if args.quick else 10))
        return
    if args.hosts:
        from benchmarks._across_hosts import across_hosts

        result = {"benchmark": "kv_transfer_hosts", "commit": git_commit(), "quick": args.quick,
                  "machine": machine_info(), **across_hosts(args.quick)}
        write_result("kv_transfer_hosts", result)
        return
    repeats = args.repeats or (8 if args.quick else 10)
    patterns = ("contiguous",) if args.quick else ("contiguous", "scattered")
    backends = ["nixl", "tcp"] if nixl_available() else ["tcp"]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    start_local_ray(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False,
                    _temp_dir=temp_dir)
    agent = ray.remote(num_cpus=1)(KVAgent)
    connectors = {backend: _transfer_settings(backend) for backend in backends}
    owner = agent.remote("owner", 1, connectors)
    reader = agent.remote("reader", 2, connectors)
    peers = _connect(ray, owner, reader, backends)
    reader_info = ray.get(reader.info.remote())
    log(f"actors up; backends {backends}; reader {reader_info}")
    result: dict[str, Any] = {"benchmark": "kv_transfer", "commit": git_commit(), "quick": args.quick,
                              "repeats": repeats, "block_size_bytes": BLOCK_BYTES, "backends": backends,
                              "settings": connectors, "reader": reader_info, "machine": machine_info()}
    result["idle_cpu_percent"] = _idle_cpu_percent(ray, [owner, reader])
    labels = {"memcpy": "memcpy", "nixl": "nixl", "tcp": "fallback"}
    for pattern in patterns:
        suffix = "" if pattern == "contiguous" else "_scattered"
        for size_mib in SIZES_MIB:
            seconds = _measure(ray, reader, peers, pattern, size_mib, repeats)
            remote_ids, local_ids = _block_ids(size_mib, pattern)
            for backend, peer in peers.items():
                if not ray.get(reader.verify.remote(peer, backend, 1, remote_ids, local_ids)):
                    raise SystemExit(f"{backend} read the wrong bytes ({pattern}, {size_mib} MiB)")
            key = f"{size_mib}mib{suffix}"
            figures = _figures(seconds, size_mib, key, labels)
            result.update(figures)
            result[f"num_descriptors_{key}"] = len(coalesce_block_runs(remote_ids, local_ids))
            log(f"{pattern} {size_mib} MiB: {figures}")
    if "nixl" in backends and not args.quick:
        result.update(_with_nixl_progress_thread(ray, owner, reader, repeats))
    result["load_avg_1m_end"] = os.getloadavg()[0]
    ray.get([owner.close.remote(), reader.close.remote()])
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
    write_result("kv_transfer", result)


if __name__ == "__main__":
    main()
