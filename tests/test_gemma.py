"""The real Gemma 3 270M GGUF (q4_k_m; `scripts/gemma.sh` fetches it): its logits and greedy tokens equal what
`transformers` computes from the same file, in fp32 and (within bf16's tolerance, on the C++ fast path) in
bf16, for a short prompt and one past its 512-token sliding window; and `dynctl serve --model <it>` answers the
official `openai` client, streamed and not, aggregated and disaggregated alike.

`transformers`' side is recorded (tests/fixtures/gemma3_270m_hf.json, made by running this file: loading the
GGUF into transformers takes a minute and 4 GB); these tests load only dynserve. They are `make test-models`
(the `models` marker), not `make test`: each Gemma load dequantizes 270M weights (30 s or more here).
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import lazy_import

from dynserve.protocol import SamplingParams

torch = lazy_import("torch")

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_270m_hf.json"
_WORDS = ("prefill", "decode", "router", "cache", "block", "window", "worker", "planner", "gateway", "token")
PROMPTS = {
    "short": "The capital of France is",
    # about 700 tokens of varied text (a phrase repeated 60 times puts bf16 itself far from fp32 there)
    "past-window": " ".join(f"Note {i}: the {_WORDS[i % 10]} of stage {i * 7 % 13} took {i * i % 97} ms." for i in range(52)),
}
GREEDY_TOKENS = 12
TOP = 20  # logits recorded per prompt: the reference's top ids and values
pytestmark = pytest.mark.models


@cache
def _reference() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@cache
def _engine(path: str, dtype: str) -> Any:
    from dynserve.config import Settings
    from dynserve.engine.llm_engine import LLMEngine

    return LLMEngine(Settings(model=path, dtype=dtype, device="cpu", kv_blocks=128))


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-3), ("bfloat16", None)])
def test_gemma_logits_and_greedy_tokens_match_transformers(gemma_gguf: Path, dtype: str, atol: float | None) -> None:
    """fp32: the reference's top logits within 1e-3 and every greedy token; bf16 (the C++ fast path): its
    top logits within 5% (relative distance, the GPU tests' tolerance) and no further from fp32 than
    transformers' own bf16 is, and the first greedy token."""
    engine = _engine(str(gemma_gguf), dtype)
    if dtype == "bfloat16":
        assert engine.model.step_ops().name == "native-bf16"
    for name, text in PROMPTS.items():
        ref = _reference()[name]
        ids = engine.tokenizer.encode(text)
        assert ids == ref["ids"], name  # the tokenizer, too
        logits = engine.compute_logits([ids])[0]
        ours, theirs = logits[torch.tensor(ref["top_ids"])], torch.tensor(ref["top_values"])
        if atol is not None:
            err = (ours - theirs).abs().max().item()
            assert err < atol, f"{name} ({dtype}): max |logit error| over the reference's top {TOP}: {err}"
        else:
            rel = ((ours - theirs).norm() / theirs.norm()).item()
            assert rel < max(0.05, 1.5 * ref["bf16_rel_transformers"]), f"{name}: relative distance {rel:.4f}"
        assert logits.argmax().item() == ref["top_ids"][0]
        out = engine.generate([ids], SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
        # fp32: every greedy token is transformers'; bf16 may part at a near tie after the first
        expected = ref["greedy"] if dtype == "float32" else ref["greedy"][:1]
        assert out[0].token_ids[: len(expected)] == expected, f"{name} ({dtype})"


@pytest.mark.parametrize("layout", [["--workers", "1"], ["--prefill-workers", "1", "--decode-workers", "1",
                                                          "--disagg-local-prefill-tokens", "0"]],
                         ids=["aggregated", "disaggregated"])
def test_dynctl_serve_gemma_answers_the_openai_client(gemma_gguf: Path, dynctl: str, dynctl_serve: Any,
                                                      layout: list[str]) -> None:
    import openai

    env = {**os.environ, "DYN_KV_BLOCKS": "256", "DYN_DTYPE": "bfloat16"}
    command = [dynctl, "serve", "--port", "0", "--model", str(gemma_gguf), *layout]
    with dynctl_serve(command, 420, env) as served:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0,
                               timeout=180)
        model = client.models.list().data[0].id
        text = PROMPTS["past-window"]
        whole = client.completions.create(model=model, prompt=text, max_tokens=GREEDY_TOKENS, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=model, prompt=text, max_tokens=GREEDY_TOKENS, temperature=0, stream=True) if chunk.choices)
        assert whole.choices[0].text == streamed == _reference()["past-window"]["greedy_text_bf16"]
        chat = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                              messages=[{"role": "user", "content": "Name a color."}])
        assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert served.code == 0


def _record(path: Path) -> None:
    """Write the fixture: transformers' fp32 top logits and greedy tokens of each prompt, how far its own bf16
    logits are from them (relative distance over the top ids), and dynserve's bf16
    greedy text of the long one (what both serving layouts must return)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                dtype=torch.bfloat16).eval()
    engine = _engine(str(path), "float32")
    out: dict[str, Any] = {"model": path.name, "transformers": transformers.__version__}
    for name, text in PROMPTS.items():
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            greedy = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, len(ids):]
            bf16 = hf_bf16(torch.tensor([ids])).logits[0, -1].float()
        top = logits.topk(TOP)
        bf16_rel = ((bf16[top.indices] - top.values).norm() / top.values.norm()).item()
        out[name] = {"ids": ids, "top_ids": top.indices.tolist(), "top_values": top.values.tolist(),
                     "greedy": greedy.tolist(), "bf16_rel_transformers": bf16_rel}
    bf16 = _engine(str(path), "bfloat16")
    result = bf16.generate([bf16.tokenizer.encode(PROMPTS["past-window"])],
                           SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0))[0]
    out["past-window"]["greedy_text_bf16"] = result.text
    FIXTURE.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from benchmarks._models import gemma_gguf_path

    _record(gemma_gguf_path())
    print(f"wrote {FIXTURE}")
