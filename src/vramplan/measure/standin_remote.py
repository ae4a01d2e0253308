"""Stand-ins for two repository-code families that transformers has no class for, so that
their training step can run under the meter without running repository code.

vramplan never imports or executes a model repository's Python (trust_remote_code). These
modules are written here, op for op where an op allocates or saves for backward, from the
repositories' modeling files as read (not copied):
- InternLM2 / InternLM2.5: internlm/internlm2_5-7b-chat modeling_internlm2.py
  (InternLM2RMSNorm, InternLM2RotaryEmbedding, InternLM2Attention / InternLM2SdpaAttention,
  InternLM2Model._update_causal_mask, InternLM2ForCausalLM.forward).
- Baichuan 2: baichuan-inc/Baichuan2-7B-* and -13B-* modeling_baichuan.py (RMSNorm,
  RotaryEmbedding + apply_rotary_pos_emb and _prepare_decoder_attention_mask of the 7B,
  get_alibi_mask of the 13B, BaichuanAttention without xformers, NormHead,
  BaichuanForCausalLM.forward with its z-loss).
Differences from the real modules, argued from those files: none in what is allocated or
saved for a training step without a KV cache, padding mask, gradient checkpointing or
xformers (the paths measured here); the modules leave out generation, caching, flash-attn
and the repositories' pretraining_tp split (1 in every published config). So a
measurement is of the structure the estimate models, and the parameter names and shapes
equal the estimate's (tests/test_families_remote.py); it is not a measurement of the
repository's file itself.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

STANDINS = ("internlm2", "baichuan")


def build_standin(model_type: str, cfg: dict, job: dict, dtype: torch.dtype) -> nn.Module:
    if job.get("method", "full") not in ("full", "lora") or job.get("gradient_checkpointing") not in (
            None, False, "none", "off"):
        raise ValueError(f"model: the {model_type} stand-in measures full fine-tuning and LoRA without "
                         "checkpointing only")
    from vramplan.sources import model_from_hf_config
    desc = model_from_hf_config({"model_type": model_type, **cfg})  # the config class's defaults
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # what from_config(dtype=...) does while modules are built
    try:
        model = (InternLM2(desc, cfg, job) if model_type == "internlm2" else Baichuan(desc, cfg))
    finally:
        torch.set_default_dtype(old)
    return model


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n):
    if n == 1:
        return x
    b, k, s, d = x.shape
    return x[:, :, None].expand(b, k, n, s, d).reshape(b, k * n, s, d)


class _Base(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.config = SimpleNamespace(use_cache=False, vocab_size=vocab_size, model_type="custom",
                                      tie_word_embeddings=False)

    def prepare_inputs_for_generation(self, *args, **kwargs):  # PeftModelForCausalLM reads it
        raise NotImplementedError("the stand-ins only train")


# ------------------------------------------------------------------ InternLM2
class LlamaStyleRMSNorm(nn.Module):  # InternLM2RMSNorm
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class InternLM2Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.k, self.hd = d.num_heads, d.num_kv_heads, d.head_dim
        self.wqkv = nn.Linear(d.hidden_size, (self.a + 2 * self.k) * self.hd, bias=d.qkv_bias)
        self.wo = nn.Linear(self.a * self.hd, d.hidden_size, bias=d.o_bias)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float() / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotary(self, x, position_ids):  # InternLM2RotaryEmbedding.forward (no_grad)
        with torch.no_grad():
            inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
            pos = position_ids[:, None, :].float()
            with torch.autocast(device_type=x.device.type, enabled=False):
                freqs = (inv.float() @ pos.float()).transpose(1, 2)
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos(), emb.sin()
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def forward(self, x, position_ids, mask, impl):
        b, s, _ = x.shape
        g = self.a // self.k
        qkv = self.wqkv(x).view(b, s, self.k, g + 2, self.hd)  # rearrange "b q (h gs d) -> b q h gs d"
        q = qkv[..., :g, :].reshape(b, s, self.a, self.hd).transpose(1, 2)  # "b q h gs d -> b q (h gs) d"
        k, v = qkv[..., -2, :].transpose(1, 2), qkv[..., -1, :].transpose(1, 2)
        cos, sin = self.rotary(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
        k, v = repeat_kv(k, g), repeat_kv(v, g)
        if impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                 is_causal=mask is None and s > 1)
        else:
            w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
            w = w + mask[:, :, :, : k.shape[-2]]
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(w, v)
        return self.wo(out.transpose(1, 2).contiguous().reshape(b, s, self.a * self.hd))


class InternLM2Layer(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.attention = InternLM2Attention(d)
        self.feed_forward = nn.Module()
        for n, (o, i) in {"w1": (d.intermediate_size, d.hidden_size), "w3": (d.intermediate_size, d.hidden_size),
                          "w2": (d.hidden_size, d.intermediate_size)}.items():
            setattr(self.feed_forward, n, nn.Linear(i, o, bias=False))
        self.attention_norm, self.ffn_norm = LlamaStyleRMSNorm(d.hidden_size, eps), LlamaStyleRMSNorm(d.hidden_size, eps)

    def forward(self, x, position_ids, mask, impl):
        x = x + self.attention(self.attention_norm(x), position_ids, mask, impl)
        f, h = self.feed_forward, self.ffn_norm(x)
        return x + f.w2(F.silu(f.w1(h)) * f.w3(h))


class InternLM2(_Base):
    def __init__(self, d, cfg, job):
        super().__init__(d.vocab_size)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.impl = d.attn_implementation  # the config's (INTERNLM2_ATTENTION_CLASSES), not the job's
        if self.impl not in ("eager", "sdpa"):
            raise ValueError("model: the internlm2 stand-in runs attn_implementation eager or sdpa on CPU")
        self.model = nn.Module()
        self.model.tok_embeddings = nn.Embedding(d.vocab_size, d.hidden_size, padding_idx=cfg.get("pad_token_id", 0))
        self.model.layers = nn.ModuleList(InternLM2Layer(d, eps) for _ in range(d.num_layers))
        self.model.norm = LlamaStyleRMSNorm(d.hidden_size, eps)
        self.output = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
        self.vocab = d.vocab_size

    def forward(self, input_ids, labels, **_):  # PEFT passes attention_mask=None and the like
        x = self.model.tok_embeddings(input_ids)
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=x.device).unsqueeze(0)
        mask = None  # _update_causal_mask: SDPA without padding -> is_causal
        if self.impl == "eager":
            mask = torch.triu(torch.full((s, s), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device), 1)
            mask *= torch.arange(s, device=x.device) > torch.arange(s, device=x.device).reshape(-1, 1)
            mask = mask[None, None].expand(b, 1, -1, -1)
        for layer in self.model.layers:
            x = layer(x, position_ids, mask, self.impl)
        hidden_states = self.model.norm(x)  # `hidden_states = outputs[0]`: alive through the loss
        logits = self.output(hidden_states).float()
        shift_logits = logits[..., :-1, :].contiguous().view(-1, self.vocab)
        loss = F.cross_entropy(shift_logits, labels[..., 1:].contiguous().view(-1))
        return SimpleNamespace(loss=loss, logits=logits)


# ------------------------------------------------------------------ Baichuan 2
class BaichuanRMSNorm(nn.Module):
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class BaichuanAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.h, self.a, self.hd, self.alibi = d.hidden_size, d.num_heads, d.head_dim, d.alibi
        self.W_pack = nn.Linear(self.h, 3 * self.h, bias=False)
        self.o_proj = nn.Linear(self.h, self.h, bias=False)
        if not self.alibi:  # the 7B's RotaryEmbedding: plain fp32 attributes, no buffers
            self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
            t = torch.arange(d.max_position_embeddings, dtype=torch.float32)
            emb = torch.cat((torch.outer(t, self.inv_freq),) * 2, dim=-1)
            self.cos_cached = emb.cos()[None, None].to(torch.float32)
            self.sin_cached = emb.sin()[None, None].to(torch.float32)

    def forward(self, x, mask, position_ids):
        b, s, _ = x.shape
        proj = self.W_pack(x).unflatten(-1, (3, self.h)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        q, k, v = (proj[i].view(b, s, self.a, self.hd).transpose(1, 2) for i in range(3))
        if self.alibi:
            w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
            w = torch.max(w + mask, torch.tensor(torch.finfo(w.dtype).min))
            out = torch.matmul(F.softmax(w, dim=-1), v)
        else:
            cos = self.cos_cached[:, :, :s, ...].squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
            sin = self.sin_cached[:, :, :s, ...].squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
            qe = (q.float() * cos) + (rotate_half(q.float()) * sin)
            ke = (k.float() * cos) + (rotate_half(k.float()) * sin)
            out = F.scaled_dot_product_attention(qe.to(q.dtype), ke.to(k.dtype), v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.h))


class BaichuanLayer(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.self_attn = BaichuanAttention(d)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=False)
        self.mlp.up_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.input_layernorm = BaichuanRMSNorm(d.hidden_size, eps)
        self.post_attention_layernorm = BaichuanRMSNorm(d.hidden_size, eps)

    def forward(self, x, mask, position_ids):
        x = x + self.self_attn(self.input_layernorm(x), mask, position_ids)
        h, m = self.post_attention_layernorm(x), self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


def alibi_slopes(n):
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    p = 2 ** math.floor(math.log2(n))
    return power_of_2(p) + alibi_slopes(2 * p)[0::2][: n - p]


class Baichuan(_Base):
    def __init__(self, d, cfg):
        super().__init__(d.vocab_size)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.desc, self.alibi_mask = d, None
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size, cfg.get("pad_token_id", 0))
        self.model.layers = nn.ModuleList(BaichuanLayer(d, eps) for _ in range(d.num_layers))
        self.model.norm = BaichuanRMSNorm(d.hidden_size, eps)
        self.lm_head = nn.Module()  # NormHead
        self.lm_head.weight = nn.Parameter(torch.empty(d.vocab_size, d.hidden_size))
        nn.init.kaiming_uniform_(self.lm_head.weight, a=math.sqrt(5))

    def masks(self, x, b, s):
        if self.desc.alibi:  # get_alibi_mask (training) via _buffered_future_mask, cached on the model
            if self.alibi_mask is None or self.alibi_mask.shape[-1] != s:
                slopes = torch.Tensor(alibi_slopes(self.desc.num_heads))
                point = (torch.arange(s) - s + 1).unsqueeze(0).unsqueeze(0).expand(self.desc.num_heads, s, -1)
                point = point - torch.diag(point[0]).unsqueeze(0).unsqueeze(0).transpose(-1, -2)
                alibi = slopes.unsqueeze(1).unsqueeze(1) * point
                future = torch.triu(torch.zeros([s, s]).float().fill_(float("-inf")), 1)
                self.alibi_mask = (future.unsqueeze(0) + alibi).to(x)[: self.desc.num_heads, :s, :s]
            return self.alibi_mask
        # _prepare_decoder_attention_mask(ones(b, s, bool)): _make_causal_mask + _expand_mask
        dtype, mn = x.dtype, torch.finfo(x.dtype).min
        dev = x.device  # _make_causal_mask(..., device=inputs_embeds.device)
        causal = torch.full((s, s), torch.tensor(mn, device=dev), device=dev)
        cond = torch.arange(s, device=dev)
        causal.masked_fill_(cond < (cond + 1).view(s, 1), 0)
        causal = causal.to(dtype)[None, None].expand(b, 1, s, s)
        expanded = torch.ones((b, s), dtype=torch.bool, device=dev)[:, None, None, :].expand(b, 1, s, s).to(dtype)
        inverted = 1.0 - expanded
        return inverted.masked_fill(inverted.to(torch.bool), mn) + causal

    def forward(self, input_ids, labels, **_):
        b, s = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        mask = self.masks(x, b, s)
        position_ids = torch.arange(0, s, dtype=torch.long, device=x.device).unsqueeze(0).view(-1, s)
        for layer in self.model.layers:
            x = layer(x, mask, position_ids)
        hidden_states = self.model.norm(x)  # `hidden_states = outputs[0]`: alive through the loss
        logits = F.linear(hidden_states, F.normalize(self.lm_head.weight))  # NormHead, training
        shift_logits = logits[..., :-1, :].contiguous().view(-1, self.desc.vocab_size)
        shift_labels = labels[..., 1:].contiguous().view(-1)
        z_loss = self.desc.z_loss_weight * (shift_logits.max(-1).values ** 2).mean()
        return SimpleNamespace(loss=F.cross_entropy(shift_logits, shift_labels) + z_loss, logits=logits)
