"""The DFlash drafter's plain PyTorch reference (transformers' Qwen3 components plus KV injection) and a tiny HF
drafter directory to load, for the tests."""

import json
import os

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from ddtree_jax.safetensors_io import save_file

YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
HF_CONFIG = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    vocab_size=256, max_position_embeddings=2048, num_target_layers=3, rope_theta=50000.0, rope_scaling=YARN,
    block_size=4, hidden_act="silu", attention_bias=False,
    dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 255},
)
N_TAPS = len(HF_CONFIG["dflash_config"]["target_layer_ids"])  # tapped target layers, concatenated


class RefAttention(nn.Module):
    """Qwen3 attention with DFlash KV injection: keys/values = [context features | block], non-causal."""

    def __init__(self, c):
        super().__init__()
        self.h, self.kvh, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin):
        b, tb, _ = x.shape
        tc = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, tb, self.h, self.hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, tc + tb, self.kvh, self.hd)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, tc + tb, self.kvh, self.hd)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, Tc+Tb, hd]
        q = q * cos[..., -tb:, :] + rotate_half(q) * sin[..., -tb:, :]
        k = k * cos + rotate_half(k) * sin
        groups = self.h // self.kvh
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        w = torch.softmax(q @ k.transpose(-1, -2) * self.hd ** -0.5, dim=-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, tb, self.h * self.hd))


class RefLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = RefAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDrafter(nn.Module):
    def __init__(self, c, n_taps):
        super().__init__()
        self.layers = nn.ModuleList([RefLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.fc = nn.Linear(n_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)

    def forward(self, target_hidden, noise, position_ids):
        """target_hidden [B, Tc, n*D], noise [B, Tb, D], position_ids [B, Tc+Tb] -> [B, Tb, D]."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise, position_ids)
        x = noise
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        return self.norm(x)


def torch_config(raw=HF_CONFIG):
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act")
    return Qwen3Config(**{k: raw[k] for k in keys}, rope_parameters={**raw["rope_scaling"],
                                                                      "rope_theta": raw["rope_theta"]})


def random_reference(seed=0):
    torch.manual_seed(seed)
    ref = RefDrafter(torch_config(), N_TAPS).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    return ref


def export(tensors, directory, config=HF_CONFIG):
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def ref_tensors(ref, prefix=""):
    return {prefix + k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
