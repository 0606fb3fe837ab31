"""Small random-weight models for the demo, tests and benchmarks (no model hub needed).

Each is built from a transformers config class and saved once under a cache folder; the
folder name carries a hash of the config so a changed recipe builds a fresh model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # the CPU attention backend rejects smaller heads
    max_position_embeddings=8192,
)

DEFAULT_CACHE = Path(os.environ.get("KVSCOPE_MODEL_CACHE", Path(__file__).resolve().parent.parent / ".kvscope-cache" / "models"))


def _recipe(name: str, window: int, layer_types: list[str] | None):
    import transformers as T

    if name == "llama":
        return T.LlamaConfig(**COMMON, num_hidden_layers=2), T.LlamaForCausalLM
    if name == "gemma3":
        types = layer_types or ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        cfg = T.Gemma3TextConfig(**COMMON, num_hidden_layers=len(types), sliding_window=window,
                                 layer_types=types, query_pre_attn_scalar=64)
        return cfg, T.Gemma3ForCausalLM
    if name == "gptoss":
        types = layer_types or ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        cfg = T.GptOssConfig(**COMMON, num_hidden_layers=len(types), sliding_window=window,
                             num_local_experts=4, num_experts_per_tok=2, layer_types=types)
        cfg.quantization_config = None
        return cfg, T.GptOssForCausalLM
    if name in ("qwen3next", "qwen3next-tp2"):  # Mamba-style linear attention (gated delta net) + full attention
        types = layer_types or ["linear_attention", "full_attention", "linear_attention", "full_attention"]
        heads = 2 if name == "qwen3next-tp2" else 1  # linear-attention key heads: tensor parallelism splits them
        cfg = T.Qwen3NextConfig(**COMMON, num_hidden_layers=len(types), layer_types=types,
                                linear_num_value_heads=2 * heads, linear_num_key_heads=heads,
                                linear_key_head_dim=64, linear_value_head_dim=64,
                                linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                decoder_sparse_step=1, mlp_only_layers=[])
        return cfg, T.Qwen3NextForCausalLM
    if name == "big-llama":  # prefill-dominated, for end-to-end benchmarks
        cfg = T.LlamaConfig(**{**COMMON, "hidden_size": 1024, "intermediate_size": 4096,
                               "num_attention_heads": 16, "num_key_value_heads": 4},
                            num_hidden_layers=8)
        return cfg, T.LlamaForCausalLM
    raise ValueError(f"unknown tiny model {name!r}; known: llama, gemma3, gptoss, qwen3next, qwen3next-tp2, "
                     "big-llama")


def build_model(name: str, window: int = 64, layer_types: list[str] | None = None,
                cache_dir: Path | str | None = None, seed: int = 0, attention_scale: float = 1.0) -> str:
    """Path of a saved random-weight model; builds it on first use. ``attention_scale`` scales every
    attention layer's queries and keys (`_sharpen_attention`)."""
    import torch

    cfg, cls = _recipe(name, window, layer_types)
    key = [name, window, layer_types, seed] + ([attention_scale] if attention_scale != 1.0 else [])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cache_dir or DEFAULT_CACHE) / f"{name}-{digest}"
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    cfg.torch_dtype = "bfloat16"
    model = cls(cfg).to(torch.bfloat16)
    if name.startswith("qwen3next"):
        _long_memory(model)
    if attention_scale != 1.0:
        _sharpen_attention(model, attention_scale)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    config_json = tmp / "config.json"
    data = json.loads(config_json.read_text())
    if "quantization_config" in data and data["quantization_config"] is None:
        del data["quantization_config"]  # gpt-oss loader wants no key at all
        config_json.write_text(json.dumps(data, indent=2))
    try:
        tmp.rename(path)
    except OSError:  # another process built the same model (the same weights: seeded) and renamed it first
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def _long_memory(model) -> None:
    """Make the linear-attention state matter: HF's random decay forgets within ~1 token.

    A_log = log(0.01) gives a per-token decay of ~0.987, and a 5x output projection makes the
    carried state visible in the logits (loading zeros into it changes the outputs).
    """
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.data.fill_(-4.6)
                layer.linear_attn.out_proj.weight.data.mul_(5)


def _sharpen_attention(model, scale: float) -> None:
    """Scale every attention layer's queries and keys by ``scale`` (its scores by its square).

    Random weights attend almost evenly, so one wrong block of a long prompt barely moves the outputs
    (a zeroed block among 54 moved a logprob by 0.025); attention this sharp makes single positions
    decide them, which is what a check of loaded KV needs."""
    import torch

    sharpened = 0
    with torch.no_grad():
        for module in model.modules():
            if not type(module).__name__.endswith("Attention"):  # not Qwen3-Next's linear attention
                continue
            sharpened += 1
            norms = [getattr(module, name, None) for name in ("q_norm", "k_norm")]
            if all(norm is not None for norm in norms):  # Gemma 3, Qwen3-Next: RMS norms scaling by 1 + w
                for norm in norms:
                    norm.weight.copy_((1 + norm.weight) * scale - 1)
                continue
            for projection in (module.q_proj, module.k_proj):  # Llama, GPT-OSS: no norm after them
                projection.weight.mul_(scale)
                if projection.bias is not None:
                    projection.bias.mul_(scale)
    if not sharpened:
        raise ValueError(f"no attention layer to sharpen in {type(model).__name__}")
