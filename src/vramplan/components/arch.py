"""Forward passes of the supported architectures, written on the symbolic recorder.

Each function mirrors the transformers 5.x modeling code it names, op for op where the op
allocates or saves: `models/llama/modeling_llama.py` (LlamaRMSNorm, LlamaAttention,
LlamaMLP, apply_rotary_pos_emb; Mistral, Qwen2/3, Mixtral and Phi-3 share it),
`models/gemma*/modeling_gemma*.py` for Gemma's (1 + w) norm and sqrt(h) scaling, PEFT's
`tuners/lora/layer.py` Linear.forward for adapters.
Legend: b micro-batch, s sequence, h hidden, a heads, k KV heads, d head_dim, f MLP width.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

from vramplan.components.checkpoint_moments import record_dropout_moment, record_lora_a_moment, record_lora_stop
from vramplan.components.dora import dora_linear
from vramplan.components.grad_moments import mark_readers
from vramplan.components.graph import Param, Recorder, Sym
from vramplan.model import ModelDesc, NormKind


@dataclass(slots=True)
class Ctx:
    """What a forward needs besides the recorder: parameters and run settings."""

    desc: ModelDesc
    params: dict[str, Param]
    lora: dict[str, tuple[Param, Param]]
    """module path -> (lora_A, lora_B) for wrapped linears."""
    lora_dropout: float
    act_dtype: str
    """Dtype of the residual stream and of non-autocast compute (weights' dtype)."""
    attention: str
    """eager | sdpa | flash."""
    gqa_native: bool
    """SDPA called with enable_gqa (k/v not repeated): transformers' use_gqa_in_sdpa."""
    training_dropout: bool = True
    checkpointed: bool = False
    """Full checkpointing: a layer's forward moments count (its forward_peak, its recomputation's
    stop); a layer that keeps its saved tensors has no use for the early ones."""
    module_dropout: bool = True
    """The nn.Dropout modules drop (residual, embedding, GPT-2's and BERT's attention); False
    under TRL's disable_dropout, which sets their p to 0. An attention dropout passed as the
    config's float (`dropout=self.attention_dropout`, Llama's and most families') still drops."""
    lora_dropout_module: bool = False
    """lora_dropout is an nn.Dropout (configured > 0), whatever p it runs with (components/dora.py)."""
    input_hook: bool = False
    """transformers' enable_input_require_grads is on (checkpointing): see `input_hook`."""
    dora: bool = False
    """PEFT use_dora: adapted linears run DoRA's forward (components/dora.py)."""
    packed: bool = False
    """Packed rows (spec.packing): position_ids restart per document and no attention_mask,
    so transformers' create_causal_mask builds a block-causal mask for SDPA
    (masking_utils.find_packed_sequence_indices; `allow_is_causal_skip = False`)."""
    shared: dict[str, Sym] = field(default_factory=dict)
    """Tensors made once per forward (rotary cos/sin)."""
    shared_keys: dict = field(default_factory=dict)
    """Per-forward memo (per-layer signatures)."""

    def p(self, name: str) -> Param:
        return self.params[name]

    def module_p(self, p: float) -> float:
        """The p an nn.Dropout module runs with: none outside training or under TRL's
        disable_dropout (module_dropout)."""
        return p if self.training_dropout and self.module_dropout else 0.0

    def opt(self, name: str) -> Param | None:
        return self.params.get(name)


def input_hook(ctx: Ctx, x: Sym) -> Sym:
    """The input embedding's output under enable_input_require_grads (modeling_utils.py: a
    forward hook on get_input_embeddings() calls output.requires_grad_(True)) when the
    embedding is frozen: a leaf that requires grad, so what follows it inside the embedding
    module (GPT-2's sum and dropout, BERT's LayerNorm and dropout) saves for backward (CPU
    meter: BERT LoRA under checkpointing keeps the LayerNorm input and the dropout's noise)."""
    if not ctx.input_hook or x.requires_grad:
        return x
    ctx.shared_keys["input_leaf"] = x.storage.nbytes
    return Sym(x.name, x.shape, x.dtype, True, x.storage)


def lin(rec: Recorder, ctx: Ctx, x: Sym, module: str, name: str) -> Sym:
    """A Linear, with its LoRA branch when wrapped (PEFT lora.Linear.forward)."""
    w = ctx.p(module + ".weight")
    bias = ctx.opt(module + ".bias")
    mark_readers(rec.grad_moments, x)  # an earlier op on this input runs its backward after this one
    conv1d = ctx.desc.model_type == "gpt2" and module.rsplit(".", 1)[-1].startswith("c_")
    out = rec.linear(x, w, bias, name=("conv1d:" if conv1d else "") + name)
    if module not in ctx.lora:
        return out
    a, b = ctx.lora[module]
    xc = rec.to(x, a.dtype, name=f"{name}.lora_in")  # `_cast_input_dtype` to the adapter dtype
    if ctx.dora:
        return dora_linear(rec, x, xc, out, w, bias, a, b, ctx.lora_dropout, name, ctx.lora_dropout_module)
    xa = rec.dropout(xc, ctx.lora_dropout, name=f"{name}.lora_dropout")
    record_dropout_moment(rec, (x, xc, out), xa, early=ctx.checkpointed)
    ya = rec.linear(xa, a, name=f"{name}.lora_A")
    record_lora_a_moment(rec, (x, xc, xa, out, ya), xa, early=ctx.checkpointed)
    yb = rec.linear(ya, b, name=f"{name}.lora_B")
    if b.trainable and ctx.checkpointed:  # lora_B saves ya: the last pack of a layer whose output projection has LoRA
        record_lora_stop(rec, (x, xc, xa, out, ya), out, yb)
    scaled = rec.scale(yb, name=f"{name}.lora_scaled")
    # `result = result + lora_B(lora_A(dropout(x))) * scaling` (peft/tuners/lora/layer.py
    # Linear.forward): at the product the base result, the input's cast to the adapters'
    # dtype (`x` rebound by `_cast_input_dtype`), lora_B's output and its scaled copy are
    # alive beside what the callers hold. In a layer that keeps its saved tensors the moment
    # counts by what it exceeds the layer's later saves by (Recorder.unsaved_peak): the
    # output projection's, the layer's last linear, can be its forward's peak.
    rec.forward_moment(*rec.frame, *rec.held, x, xc, out, yb, scaled, early=ctx.checkpointed)
    yb = scaled
    summed = rec.add(out, yb, name=f"{name}.lora_sum")
    return rec.to(summed, out.dtype, name=name)


def rms_norm(rec: Recorder, ctx: Ctx, x: Sym, module: str, name: str) -> Sym:
    """LlamaRMSNorm: fp32 statistics, then weight * x_hat.to(input dtype).
    Gemma: output = x_hat * (1 + w.float()) in fp32, then .type_as(x)."""
    w = ctx.p(module + ".weight")
    x32 = rec.to(x, "fp32", name=f"{name}.fp32")
    sq = rec.unary_saving_input(x32, f"{name}.pow")
    var = rec.reduce(sq, x.shape[:-1] + (1,), f"{name}.var")
    rstd = rec.unary_saving_output(var, f"{name}.rstd")
    xhat = rec.mul(x32, rstd, name=f"{name}.xhat")
    if ctx.desc.model_type.startswith("gemma"):
        scale = Param(w.name, w.shape, "fp32", w.trainable)  # (1 + w.float()): a tiny copy
        out32 = rec.mul(xhat, scale, name=f"{name}.scaled")
        return rec.to(out32, x.dtype, name=name)
    xcast = rec.to(xhat, x.dtype, name=f"{name}.xhat_cast")
    return rec.mul(xcast, w, name=name)


def norm(rec: Recorder, ctx: Ctx, x: Sym, module: str, name: str) -> Sym:
    if ctx.desc.norm is NormKind.LAYERNORM:
        return rec.layer_norm(x, ctx.p(module + ".weight"), name)
    return rms_norm(rec, ctx, x, module, name)


def rotary(rec: Recorder, ctx: Ctx, b: int, s: int) -> tuple[Sym, Sym]:
    """LlamaRotaryEmbedding: cos and sin of shape (1, s, d) in the hidden states' dtype,
    made once per forward and shared by every layer."""
    if "cos" not in ctx.shared:
        d = ctx.desc.head_dim
        ctx.shared["cos"] = rec.new("rotary/cos", (1, s, d), ctx.act_dtype, False)
        ctx.shared["sin"] = rec.new("rotary/sin", (1, s, d), ctx.act_dtype, False)
    return ctx.shared["cos"], ctx.shared["sin"]


def rope(rec: Recorder, x: Sym, cos: Sym, sin: Sym, name: str) -> Sym:
    """q * cos + rotate_half(q) * sin; rotate_half is a cat of the negated halves."""
    a = rec.mul(x, cos, name=f"{name}.cos")
    neg = rec.new(f"{name}.neg", x.shape[:-1] + (x.shape[-1] // 2,), x.dtype, x.requires_grad)
    rot = rec.new(f"{name}.rotate_half", x.shape, neg.dtype, x.requires_grad)
    bsin = rec.mul(rot, sin, name=f"{name}.sin")
    return rec.add(a, bsin, name=name)


def local_window(desc: ModelDesc, i: int) -> int | None:
    """The local attention span of layer i: the sliding window of its sliding layers, or a
    family's chunk (Llama-4's attention_chunk_size, `local_window_of`); None when global."""
    if i in desc.sliding_window_layers:
        return desc.sliding_window
    chunks = getattr(desc, "local_window_of", None)
    return chunks(i) if chunks else None


def model_rows(spec) -> tuple[int, int]:
    """(rows, tokens per row) of the batch the model is called with. Padding-free batches of
    the HF Trainer and TRL are flattened into one row of b*s tokens: transformers'
    DataCollatorWithFlattening (data/data_collator.py `__call__`) and TRL's
    DataCollatorForLanguageModeling with padding_free (trl/trainer/sft_trainer.py
    `torch_call`: `input_ids = [torch.cat(input_ids, dim=0)]`), so SDPA's block-causal mask
    is (1, 1, b*s, b*s). Measured: bench/trainers `sft/*/packing`, `padding-free`."""
    from vramplan.spec.stack import TRAINER_STEP_FRAMEWORKS

    b, s = spec.micro_batch_size, spec.seq_len
    if spec.packing and spec.stack.framework in TRAINER_STEP_FRAMEWORKS:
        return 1, b * s
    return b, s


def sdpa_gets_mask(desc: ModelDesc, i: int, s: int) -> bool:
    """transformers masking_utils._ignore_causal_mask_sdpa: without padding SDPA is called
    with is_causal and no mask, except on a local layer whose window is not longer than the
    sequence (`kv_length >= local_attention_size`): then it gets a (b, 1, s, s) bool mask.
    A bidirectional block (Gemma 3's image tokens, `mask_every_layer`) puts one on every layer."""
    if desc.mask_every_layer:
        return True
    window = local_window(desc, i)
    return window is not None and s >= window


def attention_dropout(ctx: Ctx) -> float:
    """The p the attention's dropout runs with: none outside training; under TRL's
    disable_dropout none where it is a module (ModelDesc.attention_dropout_module)."""
    on = ctx.training_dropout and (ctx.module_dropout or not ctx.desc.attention_dropout_module)
    return ctx.desc.attention_dropout if on else 0.0


def attention_core(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym, name: str, masked: bool = False) -> Sym:
    """softmax(q k^T / sqrt(d) + mask) v, as the configured implementation saves it.
    `masked`: SDPA gets an explicit mask (sdpa_gets_mask)."""
    desc = ctx.desc
    b, a, s, d = q.shape
    drop = attention_dropout(ctx)
    sdpa = ctx.attention != "eager"
    masked = masked or (ctx.packed and ctx.attention == "sdpa")
    if sdpa and ctx.gqa_native and not masked:
        return rec.sdpa(q, k, v, (b, s, a, d), name, dropout=drop,  # output laid out (b, s, a, d)
                        impl="flash" if ctx.attention.startswith("flash") else "sdpa")
    k_kv = None
    if desc.num_kv_heads != desc.num_heads:
        k_kv = (k, v)
        # repeat_kv: expand + reshape materializes k and v at full head count (sdpa: a mask
        # turns off transformers' use_gqa_in_sdpa, integrations/sdpa_attention.py).
        k = rec.new(f"{name}.k_repeated", (b, a, s, d), k.dtype, k.requires_grad)
        v = rec.new(f"{name}.v_repeated", (b, a, s, d), v.dtype, v.requires_grad)
    if not sdpa:
        return eager_attention(rec, ctx, q, k, v, name, k_kv)
    if masked and drop == 0:
        # F.scaled_dot_product_attention turns a bool mask into a float one in the query's
        # (autocast) dtype, a new (b, 1, s, s) tensor in each call (aten/src/ATen/native/
        # transformers/attention.cpp convert_boolean_attn_mask: at::where), and the fused
        # kernels keep their attn_mask for backward (derivatives.yaml
        # _scaled_dot_product_flash_attention_for_cpu / _efficient_attention_forward).
        # Seen with the exact CPU meter: Gemma-3's sliding layers, one per layer.
        rec.save(rec.new(f"{name}.mask_float", (b, 1, s, s), rec.autocast or q.dtype, False))
    return rec.sdpa(q, k, v, (b, s, a, d), name, dropout=drop)


def eager_attention(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym, name: str, k_kv: tuple | None = None) -> Sym:
    """eager_attention_forward: matmul, * scaling, + causal mask, softmax in fp32 then
    back to q's dtype, dropout, matmul with v, transpose(1, 2).contiguous(). `k_kv`: the
    unrepeated k and v, alive beside the repeated ones (GQA)."""
    (b, a, s, d), in_dtype = q.shape, q.dtype
    dtype = rec.autocast or q.dtype
    q, k, v = (rec._autocast_input(t) for t in (q, k, v))
    if k.requires_grad:
        rec.save(q)
    if q.requires_grad:
        rec.save(k)
    raw = rec.new(f"{name}.scores", (b, a, s, s), dtype, q.requires_grad or k.requires_grad)
    rec.log_op("bmm", raw)  # torch.matmul of 4-D tensors runs bmm on (b * a, s, d)
    scores = rec.scale(raw, name=f"{name}.scaled")
    # Moments of this function's own forward (transformers' eager_attention_forward, e.g.
    # models/qwen2/modeling_qwen2.py): `torch.matmul(q, k^T) * scaling` holds the product and
    # the scaled copy, `+ attention_mask` the scaled and the masked, F.softmax(dtype=float32)
    # its input, the fp32 copy it makes of a narrower one (aten softmax: input.to(dtype) then
    # _softmax) and the output; q, k, v, the repeated k and v (locals) and the frame (the
    # layer's normed input) stay alive. A checkpointed layer's forward peaks here when
    # a * s exceeds about the MLP's width (seen with the exact CPU meter: Qwen2, b2 s1000).
    held = (*rec.frame, q, k, v, *(() if k_kv is None else k_kv))
    rec.forward_moment(*held, raw, scores)
    if ctx.desc.attn_logit_softcapping:
        # Gemma 2: scores / cap, tanh (saves its output), * cap
        scores = rec.scale(rec.unary_saving_output(rec.scale(scores, f"{name}.capped"), f"{name}.softcap_tanh"),
                           f"{name}.uncapped")
    masked = rec.new(f"{name}.masked", scores.shape, scores.dtype, scores.requires_grad)
    rec.forward_moment(*held, scores, masked)
    if getattr(ctx.desc, "softmax_in_input_dtype", False) and rec.autocast is None:
        # Llama-4's eager_attention_forward: softmax in the scores' dtype, no fp32 upcast
        # (under autocast softmax is on the fp32 list, as for the others: seen with the meter)
        probs = probs32 = rec.unary_saving_output(masked, f"{name}.softmax")
        rec.forward_moment(*held, masked, probs)
    else:
        wide = rec.to(masked, "fp32")
        probs32 = rec.unary_saving_output(wide, f"{name}.softmax", "fp32")
        rec.forward_moment(*held, masked, wide, probs32)
        probs = rec.to(probs32, q.dtype, name=f"{name}.probs")
        rec.forward_moment(*held, probs32, probs)
    probs = rec.dropout(probs, attention_dropout(ctx), f"{name}.dropout")
    # the attention weights (`.to(query.dtype)`: no copy of an fp32 query, amp after an fp32 rotary),
    # bound by the decoder layer to `_` (LlamaDecoderLayer.forward and copies): alive to its return
    ctx.shared_keys["attn_weights"] = probs32 if in_dtype == "fp32" and probs.dtype != "fp32" else probs
    if v.requires_grad:
        rec.save(probs)
    if probs.requires_grad:
        rec.save(v)
    out = rec.new(f"{name}.out", (b, a, s, d), dtype, probs.requires_grad or v.requires_grad)
    rec.log_op("bmm", out)
    return rec.new(f"{name}.out_t", (b, s, a, d), dtype, out.requires_grad)  # .contiguous()


def self_attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    desc = ctx.desc
    pre = f"model.layers.{i}.self_attn"
    a, k, d = desc.num_heads, desc.num_kv_heads, desc.head_dim
    if desc.fused_qkv:
        qkv = lin(rec, ctx, x, f"{pre}.qkv_proj", "attn/qkv")
        q = rec.view(qkv, (b, a, s, d), "attn/q")
        kk = rec.view(qkv, (b, k, s, d), "attn/k")
        v = rec.view(qkv, (b, k, s, d), "attn/v")
    else:
        q = rec.view(lin(rec, ctx, x, f"{pre}.q_proj", "attn/q"), (b, a, s, d))
        kk = rec.view(lin(rec, ctx, x, f"{pre}.k_proj", "attn/k"), (b, k, s, d))
        v = rec.view(lin(rec, ctx, x, f"{pre}.v_proj", "attn/v"), (b, k, s, d))
    if desc.qk_norm:
        q = rms_norm(rec, ctx, q, f"{pre}.q_norm", "attn/q_norm")
        kk = rms_norm(rec, ctx, kk, f"{pre}.k_norm", "attn/k_norm")
    cos, sin = rotary(rec, ctx, b, s)
    q = rope(rec, q, cos, sin, "attn/q_rope")
    kk = rope(rec, kk, cos, sin, "attn/k_rope")
    rec.frame.append(x)  # the attention's normed input, held by the decoder layer until it returns
    out = attention_core(rec, ctx, q, kk, v, "attn/core", sdpa_gets_mask(desc, i, s))
    rec.frame.pop()
    out = rec.view(out, (b, s, a * d))
    return lin(rec, ctx, out, f"{pre}.o_proj", "attn/o")


def mlp(rec: Recorder, ctx: Ctx, x: Sym, i: int) -> Sym:
    return mlp_shared(rec, ctx, x, f"model.layers.{i}.mlp")


def mlp_shared(rec: Recorder, ctx: Ctx, x: Sym, pre: str) -> Sym:
    """LlamaMLP: down(act(gate(x)) * up(x)); Phi-3 computes gate and up in one linear."""
    desc = ctx.desc
    rec.frame.append(x)  # LlamaMLP.forward's (Phi3MLP.forward's) argument, alive until it returns
    if desc.fused_gate_up:
        gu = lin(rec, ctx, x, f"{pre}.gate_up_proj", "mlp/gate_up")
        half = gu.shape[:-1] + (gu.shape[-1] // 2,)
        gate, up = rec.view(gu, half, "mlp/gate"), rec.view(gu, half, "mlp/up")
    else:
        gate = lin(rec, ctx, x, f"{pre}.gate_proj", "mlp/gate")
        rec.held.append(gate)  # act_fn(gate) (gate's size) is alive while up_proj runs
        up = lin(rec, ctx, x, f"{pre}.up_proj", "mlp/up")
        rec.held.pop()
    act = activation(rec, gate, desc.hidden_act, "mlp/act")
    prod = rec.mul(act, up, name="mlp/act_times_up")
    # At the product, the layer's forward holds the decoder layer's residual and the MLP's
    # input (`frame`), act, up (gate was freed into act, `act_fn(gate_proj(x)) * up_proj(x)`
    # in models/llama/modeling_llama.py LlamaMLP.forward; Phi-3: the fused gate_up output its
    # halves view) and the product: what a checkpointed layer's forward peaks at, none of it
    # kept (torch/utils/checkpoint.py, non-reentrant). For a gated MLP this (2h + 3i per token)
    # exceeds the attention's moment (the norm output, q, k, v, the SDPA output: 3h + 2kd),
    # so only this moment is recorded.
    rec.forward_moment(*rec.frame, x, *((gate,) if desc.fused_gate_up else ()), up, act, prod)
    out = lin(rec, ctx, prod, f"{pre}.down_proj", "mlp/down")
    # down_proj's output beside its input: the product is not saved when down_proj is frozen
    # (LoRA elsewhere), so a layer that keeps its saved tensors peaks here on top of them
    rec.forward_moment(*rec.frame, x, prod, out)
    rec.frame.pop()
    return out


def activation(rec: Recorder, x: Sym, kind: str, name: str) -> Sym:
    """silu, relu and exact gelu save their input; the tanh approximation written as
    Python ops (GPT-2's NewGELUActivation) saves more, see gelu_new."""
    if kind in ("gelu_new", "gelu_pytorch_tanh_python"):
        return gelu_new(rec, x, name)
    return rec.unary_saving_input(x, name)


def gelu_new(rec: Recorder, x: Sym, name: str) -> Sym:
    """NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))."""
    half_x = rec.scale(x, f"{name}.half_x")
    cube = rec.unary_saving_input(x, f"{name}.pow3")
    c3 = rec.scale(cube, f"{name}.c3")
    # four (T, f) tensors at once, and so at each later op (the input, `0.5 * input`, an
    # operand and a result): a checkpointed GPT-2 block's forward peaks here (CPU meter: the
    # addmm, pow and two mul outputs of its last block)
    rec.forward_moment(*rec.frame, *rec.held, x, half_x, cube, c3)
    inner = rec.add(x, c3, name=f"{name}.inner")
    th = rec.unary_saving_output(rec.scale(inner, f"{name}.k"), f"{name}.tanh")
    one_plus = rec.add(th, th, name=f"{name}.one_plus")
    return rec.mul(half_x, one_plus, name=name)


LayerFn = Callable[[Recorder, Ctx, Sym, int, int, int], Sym]


def llama_layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """LlamaDecoderLayer (pre-norm; Gemma 2/3 add post-norms around each block)."""
    pre = f"model.layers.{i}"
    h = norm(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    h = self_attention(rec, ctx, h, i, b, s)
    held = [w for w in (ctx.shared_keys.pop("attn_weights", None),) if w is not None]  # eager's `_`
    rec.frame += held  # held to the layer's return
    if ctx.desc.sandwich_norm:
        h = norm(rec, ctx, h, f"{pre}.post_attention_layernorm", "attn_post_norm")
    h = rec.dropout(h, ctx.module_p(ctx.desc.hidden_dropout),
                    "attn/resid_dropout")
    x = rec.add(x, h, name="attn_residual")
    mlp_norm = "pre_feedforward_layernorm" if ctx.desc.sandwich_norm else "post_attention_layernorm"
    h = norm(rec, ctx, x, f"{pre}.{mlp_norm}", "mlp_norm")
    if i in ctx.desc.moe_layers:
        from vramplan.components.moe import moe_block
        h = moe_block(rec, ctx, h, i, residual=x)
    else:
        rec.frame.append(x)  # the residual, held by LlamaDecoderLayer.forward across the MLP
        h = mlp(rec, ctx, h, i)
        rec.frame.pop()
    if ctx.desc.sandwich_norm:
        h = norm(rec, ctx, h, f"{pre}.post_feedforward_layernorm", "mlp_post_norm")
    h = rec.dropout(h, ctx.module_p(ctx.desc.hidden_dropout),
                    "mlp/resid_dropout")
    del rec.frame[len(rec.frame) - len(held):]
    return rec.add(x, h, name="mlp_residual")
