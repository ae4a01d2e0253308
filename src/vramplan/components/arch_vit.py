"""ViT-style vision encoders and multimodal projectors on the symbolic recorder.

Mirrors transformers 5.x `models/clip/modeling_clip.py` (CLIPVisionEmbeddings,
CLIPEncoderLayer, CLIPAttention, CLIPMLP; SigLIP's SiglipEncoderLayer has the same shape
without the class token and pre-norm) and `models/llava/modeling_llava.py`
(LlavaModel.get_image_features, LlavaMultiModalProjector).
Legend: n images in the batch, t tokens per image (patches, + 1 class token), e vision
hidden, a heads, d = e / a, f MLP width, g = image side / patch.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.components.graph import Param, Recorder, Sym


@dataclass(frozen=True, slots=True)
class VisionDesc:
    """A vision tower and its projector, from the VLM's `vision_config` and projector fields."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int | None
    """Fixed input side (CLIP, SigLIP); None: native resolution (Qwen2-VL)."""
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "quick_gelu"
    class_token: bool = True
    pre_norm: bool = True
    """CLIP's pre_layrnorm after the embeddings."""
    patch_bias: bool = False
    """SigLIP's patch Conv2d has a bias (SiglipVisionEmbeddings); CLIP's has none."""
    fused_qkv: bool = False
    spatial_merge: int = 1
    feature_layer: int = -2
    select_strategy: str = "default"
    """default: drop the class token before the projector; full: keep it."""
    projector: tuple[tuple[int, int], ...] = ()
    """(in, out) of each projector linear; an activation sits between consecutive ones."""
    projector_bias: bool = True
    projector_act: str = "gelu"

    def tokens_per_image(self, image_size: int) -> int:
        """Tokens through the encoder layers for one image (patches + class token)."""
        side = (self.image_size or image_size) // self.patch_size
        return side * side + (1 if self.class_token else 0)

    def visual_tokens(self, image_size: int) -> int:
        """Tokens one image adds to the language model's sequence."""
        side = (self.image_size or image_size) // self.patch_size
        n = side * side // (self.spatial_merge ** 2)
        return n + (1 if self.class_token and self.select_strategy == "full" else 0)

    @property
    def used_layers(self) -> int:
        """Layers whose output reaches the projector: hidden_states[feature_layer], with
        hidden_states[0] the embeddings (so -2 skips the last layer)."""
        fl = self.feature_layer
        return self.num_layers + 1 + fl if fl < 0 else fl

    def params(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(name, shape, layer) of every vision-tower parameter (CLIPVisionModel layout)."""
        e, f, c, p = self.hidden_size, self.intermediate_size, self.num_channels, self.patch_size
        out: list[tuple[str, tuple[int, ...], int | None]] = [("embeddings.patch_embedding.weight", (e, c, p, p), None)]
        if self.patch_bias:
            out.append(("embeddings.patch_embedding.bias", (e,), None))
        side = (self.image_size or 0) // p
        if self.class_token:
            out.append(("embeddings.class_embedding", (e,), None))
        if self.image_size:
            out.append(("embeddings.position_embedding.weight", (side * side + int(self.class_token), e), None))
        if self.pre_norm:
            out += [("pre_layrnorm.weight", (e,), None), ("pre_layrnorm.bias", (e,), None)]
        for i in range(self.num_layers):
            pre = f"encoder.layers.{i}"
            out += [(f"{pre}.layer_norm1.weight", (e,), i), (f"{pre}.layer_norm1.bias", (e,), i)]
            for proj in (("qkv",) if self.fused_qkv else ("q_proj", "k_proj", "v_proj")):
                width = 3 * e if proj == "qkv" else e
                out += [(f"{pre}.self_attn.{proj}.weight", (width, e), i), (f"{pre}.self_attn.{proj}.bias", (width,), i)]
            out += [(f"{pre}.self_attn.out_proj.weight", (e, e), i), (f"{pre}.self_attn.out_proj.bias", (e,), i),
                    (f"{pre}.layer_norm2.weight", (e,), i), (f"{pre}.layer_norm2.bias", (e,), i),
                    (f"{pre}.mlp.fc1.weight", (f, e), i), (f"{pre}.mlp.fc1.bias", (f,), i),
                    (f"{pre}.mlp.fc2.weight", (e, f), i), (f"{pre}.mlp.fc2.bias", (e,), i)]
        out += [("post_layernorm.weight", (e,), None), ("post_layernorm.bias", (e,), None)]
        return out

    def projector_params(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        for j, (fan_in, fan_out) in enumerate(self.projector, start=1):
            out.append((f"linear_{j}.weight", (fan_out, fan_in)))
            if self.projector_bias:
                out.append((f"linear_{j}.bias", (fan_out,)))
        return out


@dataclass(slots=True)
class VitCtx:
    vis: VisionDesc
    params: dict[str, Param]
    lora: dict[str, tuple[Param, Param]]
    """module path -> (lora_A, lora_B) for adapted linears."""


def vit_linear(rec: Recorder, ctx: VitCtx, x: Sym, module: str, name: str) -> Sym:
    """nn.Linear with its PEFT LoRA branch when wrapped (peft/tuners/lora/layer.py Linear.forward)."""
    out = rec.linear(x, ctx.params[module + ".weight"], ctx.params.get(module + ".bias"), name=name)
    if module not in ctx.lora:
        return out
    a, b = ctx.lora[module]
    xa = rec.to(x, a.dtype, name=f"{name}.lora_in")
    yb = rec.scale(rec.linear(rec.linear(xa, a, name=f"{name}.lora_A"), b, name=f"{name}.lora_B"), f"{name}.lora_scaled")
    return rec.to(rec.add(out, yb, name=f"{name}.lora_sum"), out.dtype, name=name)


def vit_activation(rec: Recorder, x: Sym, kind: str, name: str) -> Sym:
    """transformers activations.py: QuickGELUActivation is `x * torch.sigmoid(1.702 * x)`
    (sigmoid saves its output, the product saves both factors); exact GELU and
    gelu_pytorch_tanh (F.gelu(approximate='tanh')) save their input."""
    if kind == "quick_gelu":
        sig = rec.unary_saving_output(rec.scale(x, f"{name}.scaled"), f"{name}.sigmoid")
        return rec.mul(x, sig, name=name)
    return rec.unary_saving_input(x, name)


def vit_embed(rec: Recorder, ctx: VitCtx, pixels: Sym) -> Sym:
    """CLIPVisionEmbeddings.forward: conv patch embedding (saves the pixels when its weight
    trains; they are the batch's own tensor), flatten + transpose (a view), cat with the
    class token (a new tensor), + position embedding, then pre_layrnorm."""
    vis = ctx.vis
    n = pixels.shape[0]
    t = vis.tokens_per_image(pixels.shape[-1])
    w = ctx.params["embeddings.patch_embedding.weight"]
    rg = w.trainable
    x = rec.new("vision/patch_embeds", (n, vis.hidden_size, t - int(vis.class_token)), w.dtype, rg)
    if vis.class_token:
        x = rec.new("vision/cat_class", (n, t, vis.hidden_size), w.dtype, rg)
    x = rec.new("vision/pos_added", (n, t, vis.hidden_size), w.dtype, rg)
    if vis.pre_norm:
        x = rec.layer_norm(x, ctx.params["pre_layrnorm.weight"], "vision/pre_layrnorm")
    return x


def vit_layer(rec: Recorder, ctx: VitCtx, x: Sym, i: int) -> Sym:
    """CLIPEncoderLayer: x + attn(ln1(x)); x + fc2(act(fc1(ln2(x)))). q, k, v are
    (n, a, t, d) transposed views of the projections; SDPA saves them, its output and the
    log-sum-exp (see graph.Recorder.sdpa); the output reshape is a view."""
    vis = ctx.vis
    n, t, e = x.shape
    a = vis.num_heads
    pre = f"encoder.layers.{i}"
    h = rec.layer_norm(x, ctx.params[f"{pre}.layer_norm1.weight"], "vision/ln1")
    if vis.fused_qkv:
        qkv = vit_linear(rec, ctx, h, f"{pre}.self_attn.qkv", "vision/qkv")
        q, k, v = (rec.view(qkv, (n, a, t, e // a), f"vision/{c}") for c in "qkv")
    else:
        q, k, v = (rec.view(vit_linear(rec, ctx, h, f"{pre}.self_attn.{c}_proj", f"vision/{c}"), (n, a, t, e // a))
                   for c in "qkv")
    o = rec.sdpa(q, k, v, (n, t, a, e // a), "vision/attn")
    o = vit_linear(rec, ctx, rec.view(o, (n, t, e)), f"{pre}.self_attn.out_proj", "vision/out_proj")
    x = rec.add(x, o, name="vision/attn_residual")
    h = rec.layer_norm(x, ctx.params[f"{pre}.layer_norm2.weight"], "vision/ln2")
    h = vit_linear(rec, ctx, h, f"{pre}.mlp.fc1", "vision/fc1")
    h = vit_activation(rec, h, vis.hidden_act, "vision/act")
    h = vit_linear(rec, ctx, h, f"{pre}.mlp.fc2", "vision/fc2")
    return rec.add(x, h, name="vision/mlp_residual")


def projector(rec: Recorder, ctx: VitCtx, feats: Sym, image_size: int) -> Sym:
    """LlavaModel.get_image_features: `hidden_states[feature_layer][:, 1:]` (default
    strategy) is a strided view; F.linear on it makes a contiguous copy first (aten
    matmul's reshape), which linear_1 saves. Then linear_1, act, linear_2
    (LlavaMultiModalProjector.forward)."""
    vis = ctx.vis
    n, t, e = feats.shape
    x = feats
    if vis.class_token and vis.select_strategy == "default":
        x = rec.new("projector/selected_contiguous", (n, t - 1, e), feats.dtype, feats.requires_grad)
    for j in range(1, len(vis.projector) + 1):
        if j > 1:
            x = vit_activation(rec, x, vis.projector_act, f"projector/act_{j - 1}")
        x = vit_linear(rec, ctx, x, f"linear_{j}", f"projector/linear_{j}")
    return x


__all__ = ["VisionDesc", "VitCtx", "projector", "vit_activation", "vit_embed", "vit_layer", "vit_linear"]
