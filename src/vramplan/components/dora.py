"""DoRA (Liu et al. 2024, arXiv 2402.09353) as PEFT 0.21 runs it (`LoraConfig(use_dora=True)`).

PEFT wraps each adapted linear as LoRA does and adds, per linear, a trained magnitude vector
m of `out` elements (peft/tuners/lora/dora.py DoraLinearLayer.update_layer: an nn.Parameter,
cast with the adapters: it gets a gradient and optimizer states). Its forward
(peft/tuners/lora/variants.py DoraLinearVariant.forward, then DoraLinearLayer.forward) is

    lora_weight = lora_B(lora_A(eye(in))).T                   # get_lora_weight: (out, in)
    weight      = dequantize_module_weight(base).to(x.dtype)  # a copy when the dtype differs
    norm        = ||weight + scaling * lora_weight.detach()||  # get_weight_norm, per row
    s           = (m / norm.detach()).view(1, -1)              # DivBackward keeps norm
    y_lora      = lora_B(lora_A(x))                            # saves x and lora_A's output
    base_result = result (- bias)   |  F.linear(dropout(x), weight) with lora_dropout > 0
    out         = result + (s - 1) * base_result + s * y_lora * scaling

so autograd keeps, beyond LoRA's, `base_result` and `y_lora` ((s - 1) * base_result and
s * y_lora each keep the other operand, T x out), s - 1, s and the norm (out each); with
dropout, F.linear with the frozen weight keeps that weight: the x-dtype copy of the base
weight (out x in) when the base is 16-bit or quantized and the adapters fp32.
The weight norm is computed at every forward and detached, so its out x in temporaries are
held only while the DoRA forward runs: eye(in), lora_A(eye) (in x r), lora_weight (in x out;
its graph keeps the first two until the forward returns), the base weight's copy, and in
get_weight_norm `scaling * lora_weight` and the sum (out x in each). Under gradient
checkpointing the layer's forward runs again in backward, and so do they.

Legend: T tokens, i in_features, o out_features, r rank.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.grad_moments import GradMoment
from vramplan.components.graph import Param, Recorder, Sym
from vramplan.units import nbytes


def dora_linear(rec: Recorder, x: Sym, xa: Sym, out: Sym, w: Param, bias: Param | None,
                a: Param, b: Param, dropout: float, name: str, dropout_module: bool | None = None) -> Sym:
    """One adapted linear under DoRA: `out` is the base layer's result, `xa` its input cast to
    the adapters' dtype (lora.Linear.forward `_cast_input_dtype`). Records what autograd saves
    and appends (saved before, alive locals, transient) to `rec.linear_transients`.
    `dropout`: the p lora_dropout runs with; `dropout_module`: whether it is an nn.Dropout
    (PEFT makes one when lora_dropout > 0, nn.Identity otherwise; TRL's disable_dropout sets
    its p to 0 but keeps the module, so DoRA still takes its dropout path). None: p > 0."""
    fan_in, fan_out, r = x.shape[-1], out.shape[-1], a.shape[0]
    ad = a.dtype
    before = rec.saved_bytes()
    # dequantize_module_weight(base).to(x.dtype): a new tensor unless the weight is already
    # a plain tensor of the adapters' dtype; alive from here to the end of the forward
    # (saved too with dropout; `before` does not count it, the transient does)
    w_copy = nbytes(fan_in * fan_out, ad) if w.dtype != ad else 0
    if dropout > 0 if dropout_module is None else dropout_module:
        # variants.py: x = dropout(x); base_result = None, so DoraLinearLayer.forward computes
        # F.linear(x, weight) itself, which keeps the (copied) frozen weight for grad_input
        xd = rec.dropout(xa, dropout, name=f"{name}.lora_dropout")
        if w_copy and xd.requires_grad:
            rec.save(rec.new(f"{name}.dora_weight", (fan_out, fan_in), ad, False))
        base = rec.linear(xd, Param(w.name, (fan_out, fan_in), ad, False), name=f"{name}.dora_base")
    else:
        xd = xa
        # result, or result - bias: saved by `(s - 1) * base_result` under a name of its own (the
        # linear's output, the same name, is saved after it by whatever reads it)
        base = (Sym(f"{name}.dora_base", out.shape, out.dtype, out.requires_grad, out.storage) if bias is None
                else rec.add(out, out, name=f"{name}.dora_base"))
    ya = rec.linear(xd, a, name=f"{name}.lora_A")
    yb = rec.linear(ya, b, name=f"{name}.lora_B")
    # mag_norm_scale = magnitude / weight_norm: DivBackward keeps the (detached) norm
    norm = rec.new(f"{name}.dora_norm", (fan_out,), ad, False)
    rec.save(norm)
    s = rec.new(f"{name}.dora_scale", (1, fan_out), ad, True)
    t1 = rec.new(f"{name}.dora_scale_m1", (1, fan_out), ad, True)  # mag_norm_scale - 1
    t2 = rec.mul(t1, base, name=f"{name}.dora_base_scaled")
    t3 = rec.mul(s, yb, name=f"{name}.dora_lora_scaled")
    t4 = rec.scale(t3, name=f"{name}.dora_lora_scaling")
    result_dora = rec.add(t2, t4, name=f"{name}.dora_out")
    summed = rec.add(out, result_dora, name=f"{name}.lora_sum")
    # alive as locals while the norm is computed: the base result, the input and its cast to
    # the adapters' dtype, and what the caller holds (rec.held: LlamaMLP's activated gate
    # during up_proj)
    local = sum(t.storage.nbytes for t in {id(out.storage): out, id(x.storage): x, id(xa.storage): xa}.values())
    local += sum(t.storage.nbytes for t in rec.held)
    products = yb.storage.nbytes + t2.storage.nbytes + 2 * t3.storage.nbytes  # y_lora, t2, t3, t4
    # the gradients of the backward moment (backward_moment): the output's (g, in the DoRA
    # sum's dtype: the fp32 adapters' over a 16-bit base), the base result's own when its dtype
    # differs (AddBackward's cast), and in MulBackward of `s * y_lora` its input g * scaling and
    # both products, g' * s and g' * y_lora, at the product's dtype (mul_tensor_backward makes
    # them so; the engine casts and sum_to-reduces them only after the node returns)
    tokens = out.storage.nbytes // nbytes(fan_out, out.dtype)
    grads = (nbytes(tokens * fan_out, result_dora.dtype) + 3 * nbytes(tokens * fan_out, t3.dtype)
             + (nbytes(tokens * fan_out, out.dtype) if out.dtype != result_dora.dtype else 0))
    rec.linear_transients.append((before, local, transient(fan_in, fan_out, r, ad, rec.autocast, w_copy, products)))
    rec.grad_moments.append(GradMoment(yb.name, "backward/dora_grads", grads, id(x.storage), x.storage.nbytes))
    return rec.to(summed, out.dtype, name=name)


def transient(fan_in: int, fan_out: int, r: int, ad: str, autocast: str | None, w_copy: int,
              products: int) -> int:
    """The most one DoRA forward holds beyond what it saves and its caller's locals.
    get_lora_weight's graph keeps eye(i) and lora_A(eye) (saved by the matmuls, as lora_A and
    lora_B train) while lora_weight lives, to the end of the forward. Then the norm
    (get_weight_norm's `scaling * lora_weight` and the sum, o x i each), or later the output's
    products (`products`: y_lora, (s - 1) * base_result, s * y_lora and its `* scaling`).
    Under autocast (aten/src/ATen/autocast_mode.cpp: linear in the lower precision) the
    matmuls take a low-precision copy of eye, and lora_weight comes out low-precision, then
    `.to(x.dtype)` copies it; the fp32 eye, a local of get_lora_weight, is freed on return."""
    low = autocast if autocast and autocast != ad else None
    eye, ii, io = fan_in * fan_in, fan_in * r, fan_in * fan_out
    if low is None:
        held, first = nbytes(eye, ad) + nbytes(ii, ad) + nbytes(io, ad) + w_copy, 0
    else:
        held = nbytes(eye, low) + nbytes(ii, low) + nbytes(io, ad) + w_copy
        first = nbytes(eye, ad) + nbytes(eye, low) + nbytes(ii, low) + nbytes(io, low)  # in get_lora_weight
    return max(first, held + 2 * nbytes(io, ad), held + products)


def forward_term(linears, saved_total: int | None) -> int:
    """A layer's DoRA forward transient beyond what the plan counts at its end: with the
    layer's saved tensors kept (`saved_total`), the worst linear's moment less them; in a
    checkpointed forward (None), which keeps nothing, its moment alone."""
    if saved_total is None:
        return max((local + t for _, local, t in linears), default=0)
    return max(0, max((before + local + t for before, local, t in linears), default=0) - saved_total)


TERMS = {"dora": ("dora/forward_weight_norm", "dora/recomputed_weight_norm"),
         "dequant": ("quant/forward_dequantize", "quant/recomputed_dequantize")}
"""(forward, recomputed forward) term names per kind of linear transient."""


def apply(plan, linears_at: dict, grad_hidden: int, kind: str = "dora") -> None:
    """Add linear transients (DoRA's weight norm; a kernel's dequantization, the recorder's
    `linear_transients`) to an ActivationPlan: `linears_at` maps a stage index to (its linears'
    moments, whether the stage is a checkpointed layer). The forward's per stage; under
    checkpointing the recomputed forward's in the layer's backward, with the incoming
    hidden-state gradient (`grad_hidden`) alive, beyond what the backward counts there."""
    fwd_term, bwd_term = TERMS[kind]
    before = plan.stage_forward_transient or [Breakdown() for _ in plan.stages]
    fwd = []
    for j, (st, prev) in enumerate(zip(plan.stages, before)):
        linears, wrapped = linears_at.get(j, ((), False))
        saved = None if wrapped else sum(v for _, v in st.saved)
        term = forward_term(linears, saved)
        # the stage's other forward moment (the layer's own, activations.py) is another
        # moment of the same forward, counted the same way: the larger of the two holds
        fwd.append(Breakdown({fwd_term: term}) if term > prev.total() else Breakdown(dict(prev.terms)))
    plan.stage_forward_transient = fwd
    extra = 0
    for j, (linears, wrapped) in linears_at.items():
        st = plan.stages[j]
        if wrapped and st.recompute:
            # what the backward counts at the layer's peak: the recomputed tensors less those
            # released before it (the MLP output projection's input), and its temporaries
            counted = (sum(v for n, v in st.recompute if n not in st.freed_before_peak)
                       + plan.layer_backward_transient.total())
            moment = max((before + local + t for before, local, t in linears), default=0) + grad_hidden
            extra = max(extra, moment - counted)
    if extra > 0:
        plan.layer_backward_transient.add(bwd_term, extra)

