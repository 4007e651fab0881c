"""Builders of tiny random transformers DeepseekV3 models (the torch reference) for the tests."""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=2048, rms_norm_eps=1e-5, num_nextn_predict_layers=0, eos_token_id=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                     "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)


def tiny_hf_model(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    """fp32 random DeepseekV3 with YaRN (factor 64, beta_fast 32) and a random correction bias."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**TINY, **overrides})
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norm weights
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(0.08 * torch.randn_like(p))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.1 * torch.randn_like(gate.e_score_correction_bias))
    return model


def hf_logits_and_hidden(model, tokens: np.ndarray):
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(tokens, np.int64)), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def edited_copy(src, dst, edit):
    """Copy of a single-file HF dir with ``edit(tensors)`` applied to its safetensors dict."""
    from ddtree_jax.safetensors_io import SafetensorsFile, save_file

    shutil.copytree(src, dst)
    file = SafetensorsFile(os.path.join(dst, "model.safetensors"))
    tensors = {k: np.array(file.get(k)) for k in file.keys()}
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)
