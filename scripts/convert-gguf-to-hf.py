"""Convert a GGUF model (default: the bundled SmolLM2-135M-Instruct) to a Hugging Face directory, so servers
that read only that format (vLLM) and dynserve load the very same weights.

    .venv/bin/python scripts/convert-gguf-to-hf.py [--gguf FILE] [--dtype bfloat16|float32|float16] OUT_DIR

OUT_DIR gets `config.json`, `generation_config.json`, `model.safetensors` in the chosen dtype, and the
tokenizer (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`). Name OUT_DIR after the model
(e.g. `build/hf-bfloat16/SmolLM2-135M-Instruct`): dynserve serves a directory under its name.

The weights go through transformers' GGUF loader, told to dequantize them all (Q/K rows un-permuted, LM
head tied to the embedding), then `save_pretrained`. The tokenizer too, with one repair: transformers' GGUF
conversion drops the `smollm` pre-tokenizer's digit split, so the saved `tokenizer.json` splits digits one
by one before the byte-level step, as the original model and dynserve's GGUF tokenizer do. The script
then checks that the saved tokenizer gives the same ids and chat rendering as dynserve's tokenizer on the
GGUF, and exits 1 if it does not. A directory already converted from the same file in the same dtype is
left as it is (`--force` converts again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

_STAMP = "dynserve-conversion.json"
_CHECK_TEXTS = (
    "The capital of France is Paris.",
    "In 2024, 1,234,567 people paid $89.99 each (about 3.5% more than in 1999).",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Ünïcödé, emoji 🚀 and 中文 text, plus <|im_start|>special tokens<|im_end|> inline.",
    "   leading spaces, trailing tabs\t\t and\nnew\r\nlines   ",
)


def _source_id(gguf_path: Path, dtype: str) -> dict[str, object]:
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return {"gguf": str(gguf_path.resolve()), "gguf_fingerprint": digest, "dtype": dtype}


def is_converted(out_dir: Path, gguf_path: Path, dtype: str) -> bool:
    """Whether `out_dir` already holds this file converted in this dtype."""
    try:
        stamp = json.loads((out_dir / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp == _source_id(gguf_path, dtype) and (out_dir / "model.safetensors").exists()


def convert(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Write the HF directory (weights, config, generation config, tokenizer, chat template)."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / _STAMP).unlink(missing_ok=True)  # a conversion cut short is never taken for a finished one
    # dense weights, nothing left packed: transformers refuses to save a model whose GGUF blocks it kept
    quantization = GgufConfig(gguf_file=gguf_path.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=getattr(torch, dtype),
        quantization_config=quantization)
    if getattr(model.config, "quantization_config", None) is not None:  # dense: nothing left to unpack
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])  # fmt: skip
    tokenizer.save_pretrained(str(out_dir))


def check_tokenizer(out_dir: Path, gguf_path: Path) -> list[str]:
    """Differences between the saved tokenizer (as dynserve and transformers read it) and dynserve's GGUF
    tokenizer: ids of sample texts, BOS/EOS, and the rendered chat. Empty when they agree."""
    from transformers import AutoTokenizer

    from dynserve.model.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(gguf_path)
    ours_dir = Tokenizer.from_pretrained_dir(out_dir)
    hf = AutoTokenizer.from_pretrained(str(out_dir))
    problems = []
    for text in _CHECK_TEXTS:
        want = ours.encode(text)
        for name, got in (("dynserve on the directory", ours_dir.encode(text)),
                          ("transformers", hf.encode(text, add_special_tokens=True))):
            if got != want:
                problems.append(f"{name} encodes {text[:30]!r} differently: {got[:12]} vs {want[:12]}")
    if (hf.bos_token_id, hf.eos_token_id) != (ours.bos_token_id, ours.eos_token_id):
        problems.append(f"bos/eos {hf.bos_token_id}/{hf.eos_token_id} "
                        f"vs {ours.bos_token_id}/{ours.eos_token_id}")
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    want_chat = ours.apply_chat_template(messages)
    if hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) != want_chat:
        problems.append("transformers renders the chat template differently")
    if ours_dir.apply_chat_template(messages) != want_chat:
        problems.append("dynserve renders the directory's chat template differently")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/convert-gguf-to-hf.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path,
                        help="the Hugging Face directory to write (named after the model)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file [default: the bundled SmolLM2]")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                        help="dtype of the saved weights [default: bfloat16]")
    parser.add_argument("--force", action="store_true", help="convert even when the directory is up to date")
    args = parser.parse_args(argv)
    from dynserve.model.resolve import resolve_model_path

    gguf_path = resolve_model_path(args.gguf)
    if not args.force and is_converted(args.out_dir, gguf_path, args.dtype):
        print(f"convert: {args.out_dir} is up to date ({args.dtype})", file=sys.stderr)
        return 0
    start_s = time.monotonic()
    convert(gguf_path, args.out_dir, args.dtype)
    problems = check_tokenizer(args.out_dir, gguf_path)
    if problems:
        print("convert: the saved tokenizer differs from dynserve's:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    (args.out_dir / _STAMP).write_text(json.dumps(_source_id(gguf_path, args.dtype)) + "\n")
    elapsed_s = time.monotonic() - start_s
    print(f"convert: wrote {args.out_dir} ({args.dtype}) in {elapsed_s:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
