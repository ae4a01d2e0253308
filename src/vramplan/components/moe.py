"""Mixture-of-experts feed-forward on the symbolic recorder.

Mirrors transformers 5.x `Qwen2MoeSparseMoeBlock` / `MixtralSparseMoeBlock` with the eager
expert loop (`Qwen2MoeExperts.forward`): the router's fp32 softmax over experts is saved,
then each expert gathers its tokens (`hidden_states[token_idx]`), applies gate_up, the
activation, down, and the routing weight, and scatters back with index_add_. Summed over
experts, the gathered rows number T * top_k (T = b * s tokens), assuming even routing.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, mlp_shared
from vramplan.components.grad_moments import GradMoment
from vramplan.components.graph import Param, Recorder, Sym
from vramplan.units import nbytes


def moe_block(rec: Recorder, ctx: Ctx, x: Sym, i: int, pre: str | None = None, router_name: str = "gate",
              residual: Sym | None = None) -> Sym:
    """`pre`: the block's module path (Jamba: `model.layers.{i}.feed_forward`, whose router
    is `router`, JambaTopKRouter: the same fp32 softmax and unnormalized top-k). `residual`:
    the decoder layer's residual, alive across the block (its forward moments)."""
    moe = ctx.desc.moe
    pre = pre or f"model.layers.{i}.mlp"
    tokens = 1
    for dim in x.shape[:-1]:
        tokens *= dim
    h = x.shape[-1]
    router = ctx.p(f"{pre}.{router_name}.weight")
    if router.name in ctx.lora:  # PEFT's ParamWrapper on the router (components/moe_lora.py)
        router = lora_folded(rec, ctx, router, x, 1, "moe/lora_folded_router")
    logits = rec.linear(x, router, name="moe/router_logits")
    probs = rec.unary_saving_output(rec.to(logits, "fp32"), "moe/router_softmax", "fp32")
    weights = rec.new("moe/topk_weights", (tokens, moe.top_k), "fp32", probs.requires_grad)
    if moe.norm_topk_prob:
        rec.save(weights)  # w / w.sum(): the division keeps its inputs
    # the weights the experts get: Mixtral keeps the router's fp32 softmax (MixtralTopKRouter),
    # Qwen2/3-MoE cast them to the router logits' dtype, Jamba to the hidden states'
    w_dtype = {"mixtral": "fp32", "jamba": x.dtype}.get(ctx.desc.model_type, rec.autocast or x.dtype)
    weights = rec.to(weights, w_dtype, name="moe/topk_weights_cast")
    rows = tokens * moe.top_k
    gate_up = Param(f"{pre}.experts.gate_up_proj", (2 * moe.expert_intermediate_size, h),
                    ctx.p(f"{pre}.experts.gate_up_proj").dtype, ctx.p(f"{pre}.experts.gate_up_proj").trainable)
    down = Param(f"{pre}.experts.down_proj", (h, moe.expert_intermediate_size),
                 ctx.p(f"{pre}.experts.down_proj").dtype, ctx.p(f"{pre}.experts.down_proj").trainable)
    rec.save(rec.new("moe/token_index", (rows,), "int64", False))
    gathered = rec.new("moe/expert_in", (rows, h), x.dtype, x.requires_grad)
    amp = without_autocast(rec)
    if gate_up.name in ctx.lora:
        gate_up = lora_folded(rec, ctx, gate_up, gathered, moe.num_experts, "moe/lora_folded_gate_up")
    gu = rec.linear(gathered, gate_up, name="moe/expert_gate_up")
    half = (rows, moe.expert_intermediate_size)
    act = activation(rec, rec.view(gu, half, "moe/expert_gate"), ctx.desc.hidden_act, "moe/expert_act")
    prod = rec.mul(act, rec.view(gu, half, "moe/expert_up"), name="moe/expert_act_times_up")
    if down.name in ctx.lora:
        down = lora_folded(rec, ctx, down, prod, moe.num_experts, "moe/lora_folded_down")
    out = rec.linear(prod, down, name="moe/expert_down")
    rec.autocast = amp
    routed = rec.mul(out, rec.view(weights, (rows, 1), "moe/expert_weight"), name="moe/expert_weighted")
    # The block's forward moments (transformers/integrations/moe.py grouped_mm_experts_forward):
    # the gathered rows `hidden_states[perm // num_top_k]` stay a local to its return; at the
    # gate, gate_up's output, the activation and the product are alive with them; at
    # `weighted_out[inv_perm]`, the down projection, its routing-weighted product and the
    # re-ordered copy. Beside them the decoder layer's residual and the block's input.
    frame = (residual,) if residual is not None else ()
    rec.forward_moment(*frame, x, gathered, gu, act, prod)
    reordered = rec.new("moe/expert_reordered", (rows, h), routed.dtype, False)
    rec.forward_moment(*frame, x, gathered, out, routed, reordered)
    combined = rec.new("moe/combined", x.shape, x.dtype, routed.requires_grad or x.requires_grad)
    if moe.num_shared_experts:
        # Qwen2MoeSparseMoeBlock.forward runs the shared expert before the routed ones, and its
        # gate linear (which reads x too) after them: its saves are alive at the combine's backward
        shared = mlp_shared(rec, ctx, x, f"{pre}.shared_expert")
        combine_moment(rec, out, w_dtype, probs.requires_grad, x, True)
        gate = rec.linear(x, ctx.p(f"{pre}.shared_expert_gate.weight"), name="moe/shared_gate")
        sig = rec.unary_saving_output(gate, "moe/shared_gate_sigmoid")
        combined = rec.add(combined, rec.mul(sig, shared, name="moe/shared_weighted"), name="moe/out")
    else:
        combine_moment(rec, out, w_dtype, probs.requires_grad, x)
    return combined


def without_autocast(rec: Recorder) -> str | None:
    """The experts' grouped matmuls run outside autocast: torch._grouped_mm and
    F.grouped_mm have no autocast rule, so transformers casts the input to the weights' dtype
    (integrations/moe.py `_grouped_mm`, pytorch issue 174763) and under amp the experts compute
    in fp32 on their fp32 weights, no low-precision copies (CPU meter: Mixtral amp-bf16). Returns
    the autocast dtype to restore after them."""
    amp, rec.autocast = rec.autocast, None
    return amp


def combine_moment(rec: Recorder, out: Sym, w_dtype: str, w_grad: bool, x: Sym, waiting: bool = False) -> None:
    """The backward moment of the routing-weight product (transformers/integrations/moe.py
    grouped_mm_experts_forward: `weighted_out = proj_out * sample_weights_g.unsqueeze(-1)`, then
    `weighted_out[inv_perm]` and a sum over top_k): its MulBackward holds the reordered gradient
    (IndexBackward's, S x h), g * w and g * proj_out, at the product's dtype (fp32 when the
    weights are), and the first's cast to proj_out's dtype, which the engine makes before it
    reduces the second to (S, 1). Seen with the exact CPU meter: DeepSeek-V2 bf16 LoRA, a
    classifier (no large logits), whose step peaks there. A GradMoment (grad_moments.py);
    `waiting`: a later reader of x has made its gradient by then (Qwen2-MoE's shared gate)."""
    rows, h = out.numel // out.shape[-1], out.shape[-1]
    p = "fp32" if "fp32" in (out.dtype, w_dtype) else out.dtype
    grads = nbytes(rows * h, p) * (1 + out.requires_grad + w_grad)
    if out.requires_grad and p != out.dtype:
        grads += nbytes(rows * h, out.dtype)
    last = next(reversed(rec.saved.values()))[0] if rec.saved else ""
    rec.grad_moments.append(GradMoment(last, "backward/moe_combine_grads", grads, id(x.storage), x.storage.nbytes,
                                       waiting))


def lora_folded(rec: Recorder, ctx: Ctx, w: Param, x: Sym, experts: int, name: str) -> Param:
    """A parameter under PEFT's lora.ParamWrapper (components/moe_lora.py): its forward folds
    the update into a new weight, `baddbmm(W, lhs, rhs)` for the experts (`_LoraFactorsProxy`),
    `W + delta` for the router (`_LoraParameterProxy`), which needs a gradient, so the matmuls
    that use it save their input and, when the input needs a gradient too, the folded weight
    (a whole expert stack). baddbmm saves its two factors: the adapters cast to the weight's
    dtype (`get_delta_factors`: `.to(param.dtype)`), copies where the dtypes differ."""
    a, b = ctx.lora[w.name]
    if experts > 1 and a.dtype != w.dtype:
        rec.save(rec.new(f"{name}/factors", (a.shape[0] * (a.shape[1] + b.shape[0]),), w.dtype, False))
    if x.requires_grad:
        rec.save(rec.new(name, (experts * w.shape[0], w.shape[1]), w.dtype, True))
    return Param(w.name, w.shape, w.dtype, True)
