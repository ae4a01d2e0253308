"""A symbolic autograd recorder: what a forward pass saves for backward, without torch.

Architectures write their forward with these ops on symbolic tensors (shape, dtype, requires_grad,
storage). Each op records the tensors autograd would save, following PyTorch's derivative formulas
(tools/autograd/derivatives.yaml): an input is saved only when a gradient that needs it will be
computed (the generated code guards each SavedVariable with `should_compute_output`), so a frozen
weight's input is not kept, and `a * b` keeps `a` only when `b` requires grad. Views share their
base's storage, and a storage is counted once however many ops save it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from vramplan.components.quant import BNB_4BIT, QUANT_DTYPES
from vramplan.units import nbytes


@dataclass(eq=False, slots=True)
class Storage:
    nbytes: int


@dataclass(eq=False, slots=True)
class Sym:
    """A symbolic tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    storage: Storage

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(eq=False, slots=True)
class Param:
    """A parameter as the forward sees it (storage dtype and whether it is trained)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool


@dataclass(slots=True)
class Recorder:
    """Records saved storages, in order, with the name of the tensor that first saved it."""

    autocast: str | None = None
    """Lower-precision dtype under torch.autocast (amp), else None."""
    backend: str = "cuda"
    """cuda | cpu: some ops save different tensors on each (dropout masks, CPU flash attention)."""
    saved: dict[int, tuple[str, Storage]] = field(default_factory=dict)
    cast_cache: dict[int, Sym] = field(default_factory=dict)
    """autocast caches the casts of leaf tensors that require grad (weights) for the region
    (aten/src/ATen/autocast_mode.cpp `cached_cast`); frozen weights are cast at each use."""
    dequant_saved: str | None = None
    """Compute dtype of weights a kernel dequantizes outside an autograd.Function, which MmBackward
    then keeps (GPTQModel TorchLinear); None: only the packed weight is kept."""
    quant_input_saved: bool = False
    """A quantized kernel whose autograd.Function saves its input whenever that input needs a
    gradient (hqq HQQMatmulNoCacheMul, components/quant.py kernel_saves_input)."""
    last_linear_input: Sym | None = None
    ops: list | None = None
    """When a list: (aten op, outputs) of matmuls and attention, in order (op_checkpoint.py)."""
    float8: tuple[bool, bool] | None = None
    """torchao float8 training: (on, output head converted); None when off."""
    float8_linears: list = field(default_factory=list)
    """The converted linears as (input name, tokens, in, out, input dtype, is head, bytes saved
    by then with the linear's input): components/float8.py makes the casts' transients."""
    linear_saves_input: bool = False
    """ZeRO-3 under zero.Init: F.linear is zero3_linear_wrap, whose Function saves (input,
    weight parameter, bias) whenever a gradient flows (deepspeed runtime/zero/linear.py)."""
    linear_transients: list = field(default_factory=list)
    """Linears whose call holds temporaries beyond what it saves, as (bytes saved by then, locals
    alive, transient): DoRA's weight norm (components/dora.py), a kernel's dequantization."""
    grad_moments: list = field(default_factory=list)
    """Backward moments of the layer's own ops (components/grad_moments.py GradMoment)."""
    dequant_peak: Callable[[int], int] | None = None
    """Bytes alive at a kernel's per-call dequantization of a weight of that many elements (quant.py)."""
    frame: list = field(default_factory=list)
    """Tensors enclosing module calls hold while an inner one runs (LlamaDecoderLayer's residual
    and LlamaMLP's input during the MLP): alive, saved or not; read by `_dequant_moment`."""
    held: list = field(default_factory=list)
    """Tensors the caller holds, unsaved, while a linear runs (LlamaMLP's act during up_proj)."""
    seen: set[int] = field(default_factory=set)
    """Storages already saved by an earlier stage (shared tensors are counted once)."""
    forward_peak: list = field(default_factory=list)
    """(name, bytes) at the forward's peak of a layer that keeps nothing (checkpointed)."""
    moments: list = field(default_factory=list)
    """Moments of the layer's own forward: (tensors alive then, bytes saved by then), for `unsaved_peak`."""
    recompute_stop: tuple | None = None
    """(saved count, unsaved alive, grads) at a recomputation's early stop (checkpoint_moments)."""

    # -- bookkeeping --------------------------------------------------------------------
    def forward_moment(self, *tensors: Sym, early: bool = False) -> None:
        """A moment of the layer's own forward with `tensors` alive (each storage once, a
        parameter operand has none, autocast's cached weight casts too): it becomes
        `forward_peak` (a checkpointed layer) when larger, and unless `early` (before the
        layer's later saves, which `unsaved_peak` would count beside it) is kept for it."""
        moment = self._distinct((*tensors, *self.cast_cache.values()))
        if not early:
            self.moments.append((moment, self.saved_bytes()))
        if sum(t.storage.nbytes for t in moment) > sum(n for _, n in self.forward_peak):
            self.forward_peak[:] = [(t.name, t.storage.nbytes) for t in moment]

    def unsaved_peak(self) -> list[tuple[str, int]]:
        """What a layer that keeps its saved tensors holds at its largest moment on top of all of
        them: what neither it nor an earlier stage saved, less what it saves only later (eager
        attention's moments precede the MLP's saves); the tensors up to that excess, the last cut."""
        total, best, top = self.saved_bytes(), [], 0
        for moment, saved_then in self.moments:
            alive = [(t.name, t.storage.nbytes) for t in moment if id(t.storage) not in self.seen]
            excess = sum(n for _, n in alive) - (total - saved_then)
            if excess > top:
                best, top = alive, excess
        cut = [(name, min(n, top - sum(m for _, m in best[:k]))) for k, (name, n) in enumerate(best)]
        return [(name, n) for name, n in cut if n > 0]

    @staticmethod
    def _distinct(tensors) -> list[Sym]:
        seen: set[int] = set()
        out = []
        for t in tensors:
            if id(t.storage) not in seen and t.storage.nbytes:
                seen.add(id(t.storage))
                out.append(t)
        return out

    def new(self, name: str, shape, dtype: str, requires_grad: bool) -> Sym:
        shape = tuple(map(int, shape))
        return Sym(name, shape, dtype, requires_grad, Storage(nbytes(math.prod(shape), dtype)))

    def save(self, *tensors: Sym) -> None:
        for t in tensors:
            key = id(t.storage)
            if key not in self.seen:
                self.seen.add(key)
                self.saved[key] = (t.name, t.storage)

    def log_op(self, op: str, *outputs: Sym) -> None:
        if self.ops is not None:
            self.ops.append((op, outputs))

    def saved_items(self) -> list[tuple[str, int]]:
        return [(name, st.nbytes) for name, st in self.saved.values()]

    def saved_bytes(self) -> int:
        return sum(st.nbytes for _, st in self.saved.values())

    # -- views and casts ------------------------------------------------------------------
    def view(self, x: Sym, shape, name: str | None = None) -> Sym:
        return Sym(name or x.name, tuple(shape), x.dtype, x.requires_grad, x.storage)

    def to(self, x: Sym, dtype: str, name: str | None = None) -> Sym:
        """x.to(dtype): a no-op when the dtype matches; a copy that saves nothing otherwise."""
        if x.dtype == dtype:
            return x
        return self.new(name or f"{x.name}.{dtype}", x.shape, dtype, x.requires_grad)

    def _cast_param(self, w: Param) -> Sym:
        sym = Sym(w.name, w.shape, w.dtype, w.trainable, Storage(nbytes(_numel(w.shape), w.dtype)))
        if self.autocast is None or w.dtype == self.autocast or w.dtype not in ("fp32", "bf16", "fp16"):
            return sym
        if w.trainable and (key := id(w)) in self.cast_cache:
            return self.cast_cache[key]
        cast = self.new(f"autocast_weight/{w.name}", w.shape, self.autocast, w.trainable)
        if w.trainable:
            self.cast_cache[id(w)] = cast
        return cast

    def _autocast_input(self, x: Sym) -> Sym:
        if self.autocast is None or x.dtype == self.autocast:
            return x
        return self.new(f"{x.name}.autocast", x.shape, self.autocast, x.requires_grad)

    # -- ops ------------------------------------------------------------------------------
    def linear(self, x: Sym, w: Param, bias: Param | None = None, name: str = "linear") -> Sym:
        """F.linear / Conv1D (addmm): saves the input when the weight is trained, and the
        weight (an autocast copy under amp) when the input needs a gradient."""
        self.last_linear_input = x
        if self.dequant_peak is not None and w.dtype in QUANT_DTYPES:
            self._dequant_moment(x, w)
        # bnb Linear4bit returns its input's dtype under autocast too (`.to(inp_dtype)`, nn/modules.py)
        xin = x if w.dtype in BNB_4BIT else self._autocast_input(x)
        converted = self._float8(x, xin, w, name)
        # torchao Float8Linear saves the weight parameter itself (`self.weight.t()`), no
        # autocast copy: it calls its own autograd.Function, not F.linear
        wc = self._cast_param(w) if not converted else Sym(w.name, w.shape, w.dtype, w.trainable, Storage(0))
        rg = x.requires_grad or w.trainable or bool(bias and bias.trainable)
        if self.linear_saves_input and w.dtype not in QUANT_DTYPES and not converted:
            if rg:
                self.save(x)
        elif w.trainable:
            self.save(xin)
        if xin.requires_grad and wc.name.startswith("autocast_weight/") and not self.linear_saves_input:
            self.save(wc)
        if xin.requires_grad and self.dequant_saved and w.dtype in QUANT_DTYPES:
            self.save(self.new(f"dequantized_weight/{w.name}", w.shape, self.dequant_saved, False))
        if x.requires_grad and self.quant_input_saved and w.dtype in QUANT_DTYPES:
            self.save(x)
        out_features = w.shape[0] if not name.startswith("conv1d") else w.shape[1]
        out = self.new(name, x.shape[:-1] + (out_features,), xin.dtype, rg)
        # aten::linear is CompositeImplicit: below autograd it is mm on the flattened input,
        # or addmm with a bias (aten/src/ATen/native/Linear.cpp `_flatten_nd_linear`)
        self.log_op("addmm" if bias is not None else "mm", out)
        return out

    def _dequant_moment(self, x: Sym, w: Param) -> None:
        """A kernel that dequantizes the whole weight at every call, before its matmul (GPTQModel
        torch_awq.py AwqTorchLinear.forward): alive then are what the layer saved so far, its
        input with `x_flat = x.reshape(-1, n).to(compute_dtype)` (a copy when x is wider), what
        the caller and the enclosing frames hold (`held`, `frame`; under checkpointing, where
        the layer keeps nothing, these are alive all the same), and the dequantization's own
        tensors. Recorded as (saved but not alive here, alive here, transient)."""
        c = self.dequant_saved
        cast = nbytes(x.numel, c) if c is not None and x.dtype != c else 0
        # tensors an earlier stage saved are that stage's
        alive = {id(t.storage): t.storage.nbytes for t in (x, *self.held, *self.frame)
                 if id(t.storage) not in self.seen or id(t.storage) in self.saved}
        kept = sum(n for k, n in alive.items() if k in self.saved)
        self.linear_transients.append((self.saved_bytes() - kept, cast + sum(alive.values()),
                                       self.dequant_peak(math.prod(w.shape))))

    def _float8(self, x: Sym, xin: Sym, w: Param, name: str) -> bool:
        """Whether torchao converts this nn.Linear (measure/build.py convert_float8: both
        dimensions multiples of 16, the output head only when asked; GPT-2's Conv1D is no
        nn.Linear); records it for components/float8.py."""
        if self.float8 is None or name.startswith("conv1d") or len(w.shape) != 2 or w.dtype in QUANT_DTYPES:
            return False
        head = name == "logits"
        if (head and not self.float8[1]) or w.shape[0] % 16 or w.shape[1] % 16:
            return False
        # what this stage has saved by now, the linear's own input included
        upto = self.saved_bytes() + (0 if id(xin.storage) in self.saved else xin.storage.nbytes)
        self.float8_linears.append((xin.name, _numel(x.shape[:-1]), w.shape[1], w.shape[0], xin.dtype, head, upto))
        return True

    def bmm(self, x: Sym, w: Param, out_features: int, name: str = "bmm") -> Sym:
        """torch.bmm of (E, T, in) with a whole (E, in, out) parameter: saves as linear does;
        under amp the autocast copy is of the whole parameter (Llama4TextExperts)."""
        xin, wc = self._autocast_input(x), self._cast_param(w)
        if w.trainable:
            self.save(xin)
        if xin.requires_grad and wc.name.startswith("autocast_weight/"):
            self.save(wc)
        out = self.new(name, x.shape[:-1] + (out_features,), xin.dtype, x.requires_grad or w.trainable)
        self.log_op("bmm", out)
        return out

    def mul(self, a: Sym, b: Sym | Param, name: str = "mul") -> Sym:
        bs = b if isinstance(b, Sym) else Sym(b.name, b.shape, b.dtype, b.trainable, Storage(0))
        if bs.requires_grad:
            self.save(a)
        if a.requires_grad and isinstance(b, Sym):
            self.save(b)
        shape = a.shape if _numel(a.shape) >= _numel(bs.shape) else bs.shape
        return self.new(name, shape, _promote(a.dtype, bs.dtype), a.requires_grad or bs.requires_grad)

    def add(self, a: Sym, b: Sym, name: str = "add") -> Sym:
        shape = a.shape if _numel(a.shape) >= _numel(b.shape) else b.shape
        return self.new(name, shape, _promote(a.dtype, b.dtype), a.requires_grad or b.requires_grad)

    def scale(self, x: Sym, name: str = "scale") -> Sym:
        """Multiplication by a Python scalar: a new tensor, nothing saved."""
        return self.new(name, x.shape, x.dtype, x.requires_grad)

    def unary_saving_input(self, x: Sym, name: str, out_dtype: str | None = None) -> Sym:
        """silu, gelu (erf), pow(x, 2), tanh-free activations: backward needs the input."""
        if x.requires_grad:
            self.save(x)
        return self.new(name, x.shape, out_dtype or x.dtype, x.requires_grad)

    def unary_saving_output(self, x: Sym, name: str, out_dtype: str | None = None) -> Sym:
        """rsqrt, tanh, softmax, log_softmax, exp: backward needs the result."""
        out = self.new(name, x.shape, out_dtype or x.dtype, x.requires_grad)
        if x.requires_grad:
            self.save(out)
        return out

    def reduce(self, x: Sym, shape, name: str) -> Sym:
        """mean/sum over a dim: nothing saved but sizes."""
        return self.new(name, shape, x.dtype, x.requires_grad)

    def dropout(self, x: Sym, p: float, name: str = "dropout") -> Sym:
        """F.dropout in training (aten/src/ATen/native/Dropout.cpp): p == 0 returns the input
        itself; on CUDA the fused native_dropout saves a bool mask; elsewhere `_dropout` makes
        `noise = empty_like(input).bernoulli_(1 - p)` in the input's dtype and returns
        `input * noise`, which saves the noise."""
        if p <= 0:
            return x
        if x.requires_grad:
            mask_dtype = "bool" if self.backend == "cuda" else x.dtype
            self.save(self.new(f"{name}.mask", x.shape, mask_dtype, False))
        return self.new(name, x.shape, x.dtype, x.requires_grad)

    def layer_norm(self, x: Sym, w: Param, name: str) -> Sym:
        """aten native_layer_norm saves input, mean and rstd (one fp32 value per row). CUDA
        autocast runs layer_norm in fp32 (autocast_mode.cpp: `layer_norm` in the CUDA fp32
        list); CPU autocast lists no layer_norm, so it runs in its input's dtype."""
        fp32_cast = self.autocast is not None and self.backend == "cuda"
        xin = self.to(x, "fp32") if fp32_cast else x
        rows = _numel(x.shape[:-1])
        rg = x.requires_grad or w.trainable
        if rg:
            self.save(xin)
            self.save(self.new(f"{name}.mean", (rows,), "fp32", False),
                      self.new(f"{name}.rstd", (rows,), "fp32", False))
        return self.new(name, x.shape, "fp32" if fp32_cast else _promote(xin.dtype, w.dtype), rg)

    def embedding(self, ids: Sym, w: Param, name: str) -> Sym:
        """aten embedding saves the indices (for the weight gradient)."""
        if w.trainable:
            self.save(ids)
        return self.new(name, ids.shape + (w.shape[1],), w.dtype, w.trainable)

    def sdpa(self, q: Sym, k: Sym, v: Sym, out_shape, name: str, lse_dtype: str = "fp32",
             dropout: float = 0.0, impl: str = "sdpa") -> Sym:
        """Fused attention (flash / memory-efficient / CPU flash): saves q, k, v, the output
        and the log-sum-exp, one fp32 value per (batch, head, query)
        (aten _scaled_dot_product_flash_attention[_for_cpu] derivative formula).
        `impl`: "sdpa" for torch's F.scaled_dot_product_attention and its kernel choice,
        "flash" for the flash-attn package (16-bit, grouped heads natively)."""
        dtype = self.autocast or q.dtype
        q, k, v = (self._autocast_input(t) if self.autocast else t for t in (q, k, v))
        rg = q.requires_grad or k.requires_grad or v.requires_grad
        if dropout > 0 and self.backend == "cpu":
            return self._sdpa_math(q, k, v, out_shape, name, dropout, dtype, rg)
        if impl == "sdpa" and self.backend == "cuda" and dtype == "fp32" and k.shape[1] != q.shape[1]:
            # fp32 with fewer k/v heads than query heads (enable_gqa): flash and cuDNN take
            # 16-bit inputs only, and memory-efficient attention refuses grouped heads in
            # PyTorch <= 2.13 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
            # can_use_mem_efficient_attention: check_batch_size_and_num_heads_dense<false
            # /*supports_grouped_query_attention*/>), so select_sdp_backend falls to the math
            # path. Measured on an H100 (bench/accuracy/results-cuda-*.json): the fp32 GQA/MQA
            # rows were 7-27% low with the fused kernel's saved set.
            return self._sdpa_math(q, k, v, out_shape, name, dropout, dtype, rg)
        out = self.new(name, out_shape, dtype, rg)
        b, a, s = q.shape[0], q.shape[1], q.shape[2]
        kernel = "flash_cpu" if self.backend == "cpu" else "efficient" if dtype == "fp32" else "flash"
        lse = self.new(f"{name}.lse", (b, a, -(-s // 32) * 32 if kernel == "efficient" else s), lse_dtype, False)
        self.log_op(f"sdpa_{kernel}", out, lse)
        if out.requires_grad:
            # CUDA picks memory-efficient attention for fp32 (flash takes 16-bit only); its
            # logsumexp is padded to kAlignLSE = 32 queries (aten/src/ATen/native/
            # transformers/cuda/attention.cu, _efficient_attention_forward)
            self.save(q, k, v, out, lse)
            if self.backend == "cuda" and dropout > 0 and dtype != "fp32":
                # flash attention keeps its Philox seed and offset for backward's dropout mask
                # as one 2 x int64 device tensor (flash_attn/flash_api.cpp mha_fwd, rng_state);
                # memory-efficient attention's seed and offset are CPU scalars
                self.save(self.new(f"{name}.rng_state", (2,), "int64", False))
        return out

    def _sdpa_math(self, q, k, v, out_shape, name, dropout, dtype, rg) -> Sym:
        """aten `_scaled_dot_product_attention_math` (CPU with dropout, which no fused CPU kernel
        takes; CUDA where no fused kernel accepts the call): scales q and k by sqrt(scale)
        (copies), softmaxes the (b, a, s, s) scores, applies dropout (a noise tensor and the
        dropped probabilities) when there is one, multiplies by v, and copies (b, a, s, d) to
        (b, s, a, d). On CPU it computes 16-bit inputs in fp32 (converting q, k and v first), so
        what it saves is fp32 and only the output returns to the input dtype; CUDA keeps it."""
        b, a, s, d = q.shape
        inner = "fp32" if dtype in ("bf16", "fp16") and self.backend == "cpu" else dtype
        # enable_gqa: k, v repeat_interleaved to q's heads first (CPU meter: GPTBigCode's one head)
        full = (b, a, k.shape[2], k.shape[3])
        qkv = [self.new(f"{name}.{n}", sh, inner, True) for n, sh in (("q_scaled", q.shape), ("k_scaled_t", full), ("v", full))]
        probs = [self.new(f"{name}.softmax", (b, a, s, s), inner, False)]
        if dropout > 0:
            # at::dropout: on CPU a noise tensor in the input's dtype (bernoulli_, then
            # input * noise); on CUDA the fused native_dropout and its bool mask
            # (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable)
            probs += [self.new(f"{name}.dropout.mask", (b, a, s, s), inner if self.backend == "cpu" else "bool", False),
                      self.new(f"{name}.dropped", (b, a, s, s), inner, False)]
        if rg:
            self.save(*qkv, *probs)
        # its largest moment: the fp32 copies of q and k (16-bit inputs on CPU), v's, the scaled
        # q, the probabilities, the dropout's noise and output (CPU meter: BERT, checkpointed)
        conv = [self.new(f"{name}.{t}_fp32", x.shape, inner, False) for t, x in (("q", q), ("k", k)) if inner != dtype]
        self.forward_moment(*self.frame, q, k, v, *conv, qkv[0], qkv[2], *probs)
        return self.new(f"{name}.out_t", out_shape, dtype, rg)


def _numel(shape) -> int:
    return math.prod(shape)


_RANK = {"bool": 0, "int64": 0, "int32": 0, "fp16": 1, "bf16": 1, "fp32": 2}


def _promote(a: str, b: str) -> str:
    """Type promotion between floating dtypes (fp32 wins; bf16 with fp16 is fp32)."""
    if a == b:
        return a
    if {a, b} == {"bf16", "fp16"}:
        return "fp32"
    return a if _RANK.get(a, 2) >= _RANK.get(b, 2) else b
