"""Record what a real vLLM server says, for the tests that run without vLLM (`tests/test_vllm_worker.py`).

    python -m benchmarks.record_vllm [--out tests/fixtures/vllm]

Starts vLLM's CPU build (`.venv-vllm`, `scripts/setup-peers.sh vllm`) on SmolLM2 with its KV-event publisher
and replay socket on, sends token-id prompts the way `workers/openai_channel.py` does (two sharing a prefix,
one with logprobs, one refused as too long), and writes, under `--out/<vLLM version>/`:
- `exchanges.json`: each request body, the status, and the raw response body (SSE lines);
- `metrics.txt`: `/metrics` while idle;
- `events.json`: every KV-event message (topic, seq, payload as hex) received on the PUB socket, and what the
  replay socket answered for seq 0;
- `kv_event_sources.json`: what vLLM's `GET /kv_event_sources` answered;
- `server.json`: the vLLM version, block size and model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import log
from benchmarks._services import free_port
from benchmarks._vllm import ensure_vllm, vllm_serve
from benchmarks.vs_vllm import ensure_model_dir

BLOCK_SIZE = 32  # the CPU build attends in blocks of a multiple of 32


def _subscribe(endpoint: str, messages: list[dict[str, Any]], stop: threading.Event) -> None:
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            topic, seq, payload = sub.recv_multipart()
            messages.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big", signed=True),
                             "payload": payload.hex()})
    sub.close(linger=0)


def _replay(endpoint: str) -> list[dict[str, Any]]:
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    answered = []
    while dealer.poll(5000):
        frames = dealer.recv_multipart()
        seq = int.from_bytes(frames[-2], "big", signed=True)
        answered.append({"frames": len(frames), "seq": seq, "payload": frames[-1].hex()})
        if seq == -1:
            break
    dealer.close(linger=0)
    return answered


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/vllm"))
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    python = ensure_vllm()
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    model_dir = ensure_model_dir(None, args.dtype)
    from dynserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained_dir(model_dir)
    pub, replay = free_port(), free_port()
    # a wildcard endpoint, which vLLM binds (a host's address it connects to, expecting the subscriber to bind)
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                     "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}
    flags = ["--dtype", args.dtype, "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
             "--enable-prompt-tokens-details", "--max-model-len", "512", "--kv-events-config",
             json.dumps(events_config)]
    out = args.out / version
    out.mkdir(parents=True, exist_ok=True)
    shared = tokenizer.encode("You are a helpful assistant who answers in one short sentence. " * 5)
    prompts = [shared + tokenizer.encode(" What is the capital of France?"),
               shared + tokenizer.encode(" Name a large ocean."),
               tokenizer.encode("Count: one two three")]
    base = {"model": model_dir.name, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "skip_special_tokens": False,
            "return_tokens_as_token_ids": True}
    bodies = [{**base, "prompt": prompts[0]}, {**base, "prompt": prompts[1]},
              {**base, "prompt": prompts[2], "logprobs": 2, "stop_token_ids": [tokenizer.eos_token_id]},
              {**base, "prompt": prompts[2], "max_tokens": 600}]
    log_dir = out / "log"
    log_dir.mkdir(exist_ok=True)
    with vllm_serve(python, model_dir, model_dir.name, flags, log_dir=log_dir,
                    env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
        messages: list[dict[str, Any]] = []
        stop = threading.Event()
        thread = threading.Thread(target=_subscribe, args=(f"tcp://127.0.0.1:{pub}", messages, stop), daemon=True)
        thread.start()
        time.sleep(1.0)  # the subscription reaches the publisher
        url = f"http://127.0.0.1:{server.port}"
        exchanges = []
        for body in bodies:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            exchanges.append({"request": body, "status": response.status_code, "body": response.text})
            log(f"request {len(exchanges)}: {response.status_code}")
        time.sleep(2.0)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        sources = httpx.get(f"{url}/kv_event_sources", timeout=30)
        stop.set()
        thread.join()
        replayed = _replay(f"tcp://127.0.0.1:{replay}")
    (out / "exchanges.json").write_text(json.dumps(exchanges, indent=1))
    (out / "metrics.txt").write_text(metrics)
    (out / "events.json").write_text(json.dumps({"messages": messages, "replay_from_0": replayed}, indent=1))
    (out / "kv_event_sources.json").write_text(json.dumps({"status": sources.status_code, "body": sources.text},
                                                          indent=1))
    (out / "server.json").write_text(json.dumps({"vllm": version, "block_size": BLOCK_SIZE, "model": model_dir.name,
                                                 "dtype": args.dtype, "eos_token_id": tokenizer.eos_token_id},
                                                indent=1))
    log(f"recorded {len(exchanges)} exchanges and {len(messages)} event messages into {out}")


if __name__ == "__main__":
    main()
