"""`dynctl serve` as a user runs it: flags with env twins, a real process answering HTTP, Ctrl-C stopping it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

DYNCTL = str(Path(sys.executable).parent / "dynctl")


def test_serve_help_lists_each_flag_with_its_env_twin() -> None:
    out = " ".join(subprocess.run([DYNCTL, "serve", "--help"], capture_output=True, text=True,
                                  check=True).stdout.split())  # however the terminal wraps it
    for flag in ("model", "host", "port", "api-key", "max-queue", "dtype", "kv-blocks", "block-size", "ray-address"):
        env = "DYN_" + flag.upper().replace("-", "_")
        assert f"--{flag}" in out and f"env: {env}" in out, flag


def test_bad_flag_values_exit_2_with_a_message() -> None:
    done = subprocess.run([DYNCTL, "serve", "--port", "eighty"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--port" in done.stderr


def test_serve_answers_chat_and_stops_on_ctrl_c(dynctl_serve: Any) -> None:
    env = {**os.environ, "DYN_KV_BLOCKS": "256", "DYN_API_KEY": "k3y"}
    with dynctl_serve([DYNCTL, "serve", "--port", "0"], 240, env) as served:
        port = served.port
        assert f"http://localhost:{port}/v1" in served.banner and "curl" in served.banner
        assert "k3y" not in served.banner
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 401  # DYN_API_KEY took effect
        answer = httpx.post(url, json=body, headers={"Authorization": "Bearer k3y"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert served.code == 0
    assert "stopped" in served.rest
