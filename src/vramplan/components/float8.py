"""torchao float8 training (`spec.float8`): what the casts of Float8Linear hold.

torchao/float8/float8_linear.py `matmul_with_hp_or_float8_args` saves its input and the
weight in high precision (`ctx.save_for_backward(input_hp, weight_hp_t)`), exactly what
F.linear saves, so the saved activations, the weights, the gradients and the optimizer
states do not change (the recorder only drops autocast's weight copy, components/graph.py).
What changes are transients: every operand of a matmul is cast to float8 on the fly, and
one cast (float8_training_tensor.py `_ToFloat8ConstrFunc.forward`:
`tensor.to(torch.float32) * scale`, then float8_utils.py `to_fp8_saturated`: `clamp`, then
`.to(float8_dtype)`) holds, for an operand of n elements, the fp32 scaled copy (4n), the
fp32 clamped copy (4n) and the float8 result (n): 9n bytes at its peak, the float8 result
(n) after it. (The fp32 copy `to(float32)` of a 16-bit operand is freed once the product
exists: 8n then; `abs` for the amax is at most 4n.)

Forward, per converted linear (input n_in = T*in, weight n_w = in*out): the input's cast
(9 n_in), then the weight's with the float8 input alive (n_in + 9 n_w).
Backward (the same function's backward), with the incoming gradient (n_go = T*out) alive:
  1. grad_output cast for grad_input:             9 n_go
  2. weight cast for grad_input:                   n_go + 9 n_w
  3. grad_input = mm(...) in the input's dtype:    n_go + n_w + n_in*c
  4. grad_output cast for grad_weight:             n_go + n_w + n_in*c + 9 n_go
  5. input cast for grad_weight:                   2 n_go + n_w + n_in*c + 9 n_in
The recipe rowwise-with-gw-hp computes grad_weight in high precision (its
`cast_config_input_for_grad_weight` / `..._grad_output_for_grad_weight` are DISABLED), so
steps 4 and 5 cast nothing.

FSDP2's float8 all-gather (`float8.fsdp_float8_all_gather`, Float8LinearConfig.
enable_fsdp_float8_all_gather): torchao/float8/float8_linear.py Float8Linear.from_float wraps
each converted weight in WeightWithDynamicFloat8CastTensor (torchao/float8/fsdp_utils.py),
whose `fsdp_pre_all_gather` casts the rank's shard to float8 (dynamic tensorwise scale, amax
all-reduced over the mesh, or torchtitan's precompute_float8_dynamic_scale_for_fsdp scale)
and hands FSDP2 its float8 `_data` to gather; `fsdp_post_all_gather` wraps the gathered bytes
(FSDP2's per-parameter all-gather output) in a Float8TrainingTensor, and that is the
unsharded weight. So FSDP's all-gather buffers and unsharded weights hold one byte per
element of a converted weight (parallel/fsdp.py gathered_bytes), and the matmuls find the
weight already in float8 (`tensor_already_casted_to_fp8` in matmul_with_hp_or_float8_args):
the weight's cast in forward and in backward (forward `n_in + 9 n_w`, step 2) is gone, and the
float8 weight the later steps hold (n_w) is FSDP's unsharded parameter, counted there.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.quant import QUANT_DTYPES
from vramplan.units import nbytes

_CAST = 9
"""Bytes per element at a cast's peak: fp32 scaled (4) + fp32 clamped (4) + float8 (1)."""


_HEADS = ("lm_head", "score", "classifier")
_EMBEDDINGS = ("embed_tokens", "wte", "wpe", "embeddings")


def gathered_in_float8(spec, model_type: str):
    """None without the float8 all-gather, else a predicate over the held parameters: the
    weights torchao converts (measure/build.py convert_float8 and graph.py Recorder._float8:
    an nn.Linear weight with both dimensions multiples of 16, the output head only with
    `convert_lm_head`; GPT-2's Conv1D (`c_*`, components/arch.py lin) and nn.Embedding are no
    nn.Linear), which FSDP2 all-gathers in float8."""
    f8 = spec.float8
    if f8 is None or not f8.fsdp_float8_all_gather:
        return None

    def converted(p) -> bool:
        module = p.name.split("#", 1)[0].removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        shape = p.full_shape or p.shape
        if p.kind != "base" or len(shape) != 2 or p.dtype in QUANT_DTYPES or shape[0] % 16 or shape[1] % 16:
            return False
        if any(w in module for w in _EMBEDDINGS) or (model_type == "gpt2" and leaf.startswith("c_")):
            return False
        return f8.convert_lm_head if p.layer is None and leaf in _HEADS else p.layer is not None
    return converted


def forward_peak(linears, weight_gathered: bool = False) -> int:
    """The largest forward cast transient among the converted linears of one stage (with the
    float8 all-gather the weight arrives in float8: the input's cast only)."""
    best = 0
    for _, tokens, i, o, _, _, _ in linears:
        best = max(best, _CAST * tokens * i, 0 if weight_gathered else tokens * i + _CAST * i * o)
    return best


def backward_moment(tokens: int, i: int, o: int, c: str, recipe: str, weight_gathered: bool = False) -> int:
    """Bytes the backward of one converted linear holds at its peak beyond its incoming
    gradient (steps 1-5 of the module docstring); with the float8 all-gather the weight's
    cast (step 2) is gone and its float8 copy is FSDP's unsharded parameter."""
    n_go, n_in = tokens * o, tokens * i
    n_w = 0 if weight_gathered else i * o
    grad_in = nbytes(n_in, c)
    steps = [_CAST * n_go, n_go + _CAST * n_w, n_go + n_w + grad_in]
    if recipe != "rowwise-with-gw-hp":
        steps += [n_go + n_w + grad_in + _CAST * n_go, 2 * n_go + n_w + grad_in + _CAST * n_in]
    return max(steps)


def layer_backward_term(linears, spec, hidden: int, res: str, at_peak: int, mlp_out: tuple[str, ...],
                        grad: str) -> int:
    """What a layer's backward holds beyond `at_peak` (the layer's activations and the
    transient the plan counts at the layer's peak) at the worst converted linear's
    backward. Backward runs the layer in reverse, so at a linear's backward what its layer
    saved after it is gone: alive are what was saved up to it (its input included), the
    residual gradient (T x h), its own incoming gradient when that is not the residual one
    (out != h), and its casts. The timeline counts the MLP output projection's weight
    gradient at a layer's peak (components/weights.py gradient_stages_at_peak); during that
    projection's casts it does not exist yet (made after them), so it is taken off there."""
    recipe, gathered = spec.float8.recipe.value, spec.float8.fsdp_float8_all_gather
    worst = 0
    for name, tokens, i, o, c, head, upto in linears:
        if head:
            continue
        go = 0 if o == hidden else nbytes(tokens * o, c)
        moment = upto + nbytes(tokens * hidden, res) + go + backward_moment(tokens, i, o, c, recipe, gathered)
        if name.split(".")[0] in mlp_out:
            moment -= nbytes(i * o, grad)
        worst = max(worst, moment)
    return max(0, worst - at_peak)


def head_backward_term(linears, spec, grad_logits: int, current: int, grad: str) -> int:
    """The output head converted (`float8.convert_lm_head`): its backward holds the logits'
    gradient in the head's dtype (`grad_logits`) with its casts, where the plan counts
    `current`; the head's weight gradient, which the timeline counts at the head's peak, is
    made after the casts and is taken off."""
    worst = 0
    for _, tokens, i, o, c, head, _ in linears:
        if head:
            moment = grad_logits + backward_moment(tokens, i, o, c, spec.float8.recipe.value,
                                                   spec.float8.fsdp_float8_all_gather) - nbytes(i * o, grad)
            worst = max(worst, moment)
    return max(0, worst - current)


def apply(plan, spec, layer_linears, head_linears, hidden: int, res: str, mlp_out: tuple[str, ...],
          grad: str) -> None:
    """Add the float8 casts to an ActivationPlan: per stage forward transients, and what the
    layer's and the head's backward hold beyond what the plan counts already."""
    gathered = spec.float8.fsdp_float8_all_gather
    layer_fwd, head_fwd = forward_peak(layer_linears, gathered), forward_peak(head_linears, gathered)
    # beside a family's checkpointed-forward peak (Jamba's scan), counted as both at once
    before = plan.stage_forward_transient or [Breakdown() for _ in plan.stages]
    plan.stage_forward_transient = [
        Breakdown(dict(prev.terms)).add("float8/forward_casts", layer_fwd if st.label.startswith("layer") else
                                        head_fwd if st.label == "head" else 0)
        for st, prev in zip(plan.stages, before)]
    layer = next((st for st in reversed(plan.stages) if st.label.startswith("layer")), None)
    if layer is not None and not layer.recompute:
        kept = sum(v for n, v in layer.saved if n not in layer.freed_before_peak)
        extra = layer_backward_term(layer_linears, spec, hidden, res,
                                    kept + plan.layer_backward_transient.total(), mlp_out, grad)
        if extra:
            plan.layer_backward_transient.add("float8/backward_casts", extra)
    head = plan.head_backward_transient
    grad_logits = head.terms.get("logits/grad_logits", 0)
    extra = head_backward_term(head_linears, spec, grad_logits, head.total(), grad)
    if extra:
        head.add("float8/backward_casts", extra)
