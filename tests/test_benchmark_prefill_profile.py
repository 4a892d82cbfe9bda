"""`benchmarks.prefill_profile`'s FLOP counts, which its fractions of the CPU's peak divide by: SmolLM2-135M's
shapes counted by hand. (The module imports torch, so it is imported inside the test.)"""

from __future__ import annotations


def test_the_flops_of_a_prefill_are_its_projections_and_its_causal_attention() -> None:
    from benchmarks.prefill_profile import flops
    from dynserve.engine.loader import ModelConfig

    smollm2 = ModelConfig(model_id="smollm2", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                          rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)
    linear, attention = flops(smollm2, 512)
    # per layer: qkv 576 x (576 + 2 x 192), o 576 x 576, gate and up 2 x 576 x 1536, down 1536 x 576
    assert linear == 2 * 512 * 30 * (552_960 + 331_776 + 1_769_472 + 884_736)
    assert round(linear / 1e9, 1) == 108.7  # docs/prefill.md's figure
    # QK and PV over 512 x 513 / 2 causal pairs, 64 dimensions, 9 heads, 30 layers
    assert attention == 2 * 2 * 64 * 9 * (512 * 513 // 2) * 30
