"""`python -m dynserve.operator.fetch URI PATH`: the init step of a pod whose model is a URI: download it to
PATH on the pod's model volume, unless a file is already there (a volume shared by pods, or a restart).
Written to a temporary name and renamed, so a pod never sees half a file; exits 1 with the reason on failure.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

__all__ = ["fetch"]

CHUNK_BYTES = 8 * 2**20


def fetch(uri: str, path: Path, timeout_s: float = 60.0) -> bool:
    """Download `uri` to `path`; False if it was already there."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(uri, timeout=timeout_s) as response, partial.open("wb") as out:  # noqa: S310
            while chunk := response.read(CHUNK_BYTES):
                out.write(chunk)
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[1].startswith(("http://", "https://")):
        sys.exit("usage: python -m dynserve.operator.fetch http(s)://URI PATH")
    try:
        fetched = fetch(sys.argv[1], Path(sys.argv[2]))
    except OSError as exc:
        sys.exit(f"fetching {sys.argv[1]} failed: {exc}")
    print(f"{sys.argv[2]}: {'fetched' if fetched else 'already there'}")
