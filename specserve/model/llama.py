"""Our forward pass for Llama-family checkpoints: Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral.

One flattened batch of tokens from many sequences goes through the model at once. Each
token carries its own position (for RoPE) and its own KV slot (where its K/V land in the
paged pool); which keys each token may see is described by `AttentionMetadata`, so
prefill chunks, plain decode and the tree-verify pass are all the same `forward` call.

What differs between the four families is small and lives in `ModelArgs`:
  - Qwen2: biases on the q/k/v projections (`qkv_bias`).
  - Qwen3: RMSNorm over each head of q and k before RoPE (`qk_norm`), and a head_dim that
    need not equal hidden_size / num_heads.
  - Llama 3.x: RoPE frequencies rescaled by the "llama3" rule (`rope_scaling`).
  - Mistral: nothing beyond Llama (sliding-window attention is NOT implemented; it only
    matters past `sliding_window` tokens of context).

Precision notes. Norms are computed in float32 (float64 for a float64 model), like
transformers, then multiplied by the weight in the model dtype. The RoPE tables are computed
once in float64 and stored in float32 (float64 for a float64 model), so a float64 model is
float64 all the way through: that is what the bit-exact greedy tests rely on.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ModelLoadError
from specserve.kernels import ops
from specserve.model.attention import AttentionMetadata

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}; None = default
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (or any config with attention_bias=True)
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    architecture: str = "LlamaForCausalLM"
    torch_dtype: str | None = None  # the checkpoint's dtype as named in config.json, if any

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        """Read a transformers PretrainedConfig (4.x or 5.x field names)."""
        archs = getattr(cfg, "architectures", None) or []
        arch = archs[0] if archs else _arch_from_model_type(getattr(cfg, "model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        rope_theta, rope_scaling = _rope_settings(cfg)
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        tie = getattr(cfg, "tie_word_embeddings", None)
        sizes = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                 "num_attention_heads": num_heads, "num_key_value_heads": getattr(cfg, "num_key_value_heads", None)
                 or num_heads, "head_dim": head_dim, "intermediate_size": cfg.intermediate_size,
                 "max_position_embeddings": cfg.max_position_embeddings}
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 2**31 - 1:
                raise ModelLoadError(f"config.json: {name} = {value!r} is invalid: it must be a positive integer")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"config.json: hidden_act = {act!r} is not supported: the MLP is SwiGLU ('silu')")
        if num_heads % sizes["num_key_value_heads"]:
            raise ModelLoadError(f"config.json: num_attention_heads = {num_heads} is not a multiple of "
                                 f"num_key_value_heads = {sizes['num_key_value_heads']}")
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(tie) if tie is not None else False,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=cfg.max_position_embeddings,
            architecture=arch,
            torch_dtype=dtype,
        )

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one block of this model."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
    }.get(model_type, model_type or "<none>")


def _rope_settings(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config style:
    transformers 5 `rope_parameters` = {"rope_type", "rope_theta", ...}, or the
    config.json style `rope_theta` + `rope_scaling` = {"type"|"rope_type", "factor", ...}."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = dict(params)
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if getattr(cfg, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ModelLoadError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:  # [head_dim // 2] float64
    """RoPE inverse frequencies theta^(-2i/D), rescaled as rope_scaling says."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        # Position interpolation (Chen et al. 2023): positions / factor == inv_freq / factor.
        return inv_freq / scaling["factor"]
    # llama3: high frequencies (short wavelengths) kept, low frequencies divided by `factor`,
    # a smooth ramp between low_freq_wavelen and high_freq_wavelen.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, D // 2], or [T, 1, D] from rope_full_tables
    sin: torch.Tensor,  # [T, D // 2], or [T, 1, D] from rope_full_tables
) -> torch.Tensor:  # [T, H, D]
    """Rotate pairs (x[i], x[i + D/2]) by angle position * inv_freq[i] (the HF "rotate_half"
    layout, not the interleaved one of the original Meta checkpoints):
        out[:D/2] = x1 * cos - x2 * sin,  out[D/2:] = x2 * cos + x1 * sin.
    With full-width tables, cos = [cos, cos] and sin = [-sin, sin], this is
    x * cos + roll(x, D/2) * sin: 4 ops instead of 8 in every layer, and the same bits
    (a - b == a + (-b) in IEEE arithmetic)."""
    if cos.dim() == 2:
        cos, sin = rope_full_tables(cos, sin, x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rope_full_tables(
    cos: torch.Tensor,  # [T, D // 2]
    sin: torch.Tensor,  # [T, D // 2]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [T, 1, D] in dtype
    """The [cos, cos] and [-sin, sin] tables apply_rope rotates with, built once per forward."""
    cos, sin = cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def onednn_linear_available() -> bool:
    """Whether this torch build can run float32 linears through oneDNN with packed weights
    (CPU builds with mkldnn; the ops are the ones torch's own CPU compiler emits)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


# Batch size oneDNN is told to pack for (the fastest choice over 1-256 rows: RESULTS.md).
_ONEDNN_PACK_ROWS = 8


# oneDNN primitives a process keeps (its LRU cache; oneDNN's default holds 1024). A packed linear
# builds a primitive per row count it meets (about 1 ms and half a MiB each): five weight shapes
# at every row count a server's passes run exceed 1024 within one load, and evicting them makes
# the passes whose row counts vary the most (per-request speculation) the dearest.
ONEDNN_PRIMITIVE_CACHE = 4096
ONEDNN_DEFAULT_PRIMITIVE_CACHE = 1024   # what oneDNN keeps when the variable is unset or not a number


def keep_onednn_primitives(capacity: int = ONEDNN_PRIMITIVE_CACHE) -> int:
    """Size oneDNN's primitive cache for this process, unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is
    set already (the operator's choice stands). oneDNN reads it when it creates its first
    primitive: called before anything runs through oneDNN (pack_for_onednn calls it), or it does
    nothing. Returns the capacity in force from then on (oneDNN's default where the variable is
    not a number, which oneDNN ignores)."""
    value = os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    return int(value) if value.strip().isdigit() else ONEDNN_DEFAULT_PRIMITIVE_CACHE


def pack_onednn(layer: nn.Linear) -> None:
    """Give `layer` a copy of its weight in oneDNN's blocked layout; `linear` then uses it. The
    plain weight stays (state_dict, tied embeddings); the packed copy must be made again if the
    weight changes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().contiguous(), _ONEDNN_PACK_ROWS)
    bias = None if layer.bias is None else layer.bias.detach()
    layer.__dict__["onednn"] = (packed, bias)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:  # [..., in] -> [..., out]
    """layer(x): through oneDNN when the weight was packed for it (`pack_onednn`), else F.linear.
    Not through the module's __call__: at batch 1 call overheads are a visible share of a step."""
    d = layer.__dict__
    wt = d.get("wt")
    if wt is not None:   # 2-D x (every forward here); one mm, not linear -> matmul -> t -> mm
        return torch.mm(x, wt) if layer.bias is None else torch.addmm(layer.bias, x, wt)
    packed = d.get("onednn")
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed[0], packed[1], "none", [], "")
    return F.linear(x, layer.weight, layer.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if x.dtype in (torch.float32, torch.float64):  # in the input's precision
            # x * rsqrt(mean(x^2) + eps) * w, the mean taken as |x|^2 / dim and the scalar
            # steps done in place on the [..., 1] column (fewer ops than F.rms_norm; the same
            # result up to rounding).
            inv = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().mul_(1.0 / x.shape[-1])
            return torch.mul(x, inv.add_(self.eps).rsqrt_()).mul_(self.weight)
        # 16-bit: normalise in float32, scale in the model dtype (as the HF models do)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.wq = nn.Linear(args.hidden_size, q_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(q_dim, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    @torch.no_grad()
    def fuse(self) -> None:
        """One [q; k; v] projection instead of three: fewer, larger matmuls per token."""
        wqkv = nn.Linear(self.wq.in_features, self.wq.out_features + 2 * self.wk.out_features,
                         bias=self.wq.bias is not None, dtype=self.wq.weight.dtype, device=self.wq.weight.device)
        wqkv.weight.copy_(torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]))
        if self.wq.bias is not None:
            wqkv.bias.copy_(torch.cat([self.wq.bias, self.wk.bias, self.wv.bias]))
        self.wqkv = wqkv
        del self.wq, self.wk, self.wv

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D] (rope_full_tables)
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [NB, BS, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        T = x.shape[0]
        if hasattr(self, "wqkv"):
            q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            # split_with_sizes rather than Tensor.split (a Python wrapper): at batch 1 such call
            # overheads are a noticeable share of a small model's step.
            qkv = linear(x, self.wqkv)
            q, k, v = qkv.split_with_sizes([q_dim, kv_dim, kv_dim], dim=-1)
        else:
            q, k, v = linear(x, self.wq), linear(x, self.wk), linear(x, self.wv)
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim).contiguous()  # [T, Hkv, D]
        if self.q_norm is not None:  # Qwen3: per-head norm, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k rotate together: one RoPE over [T, Hq + Hkv, D].
        q, k = apply_rope(torch.cat([q, k], dim=1), cos, sin).split_with_sizes(
            [self.num_heads, self.num_kv_heads], dim=1)
        k = k.contiguous()
        k_cache, v_cache = kv_cache
        # This step's K/V go into the pool first; attention then reads every visible key
        # (context and this step's own tokens) from the pool.
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_skipped_slots)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return linear(out.reshape(T, self.num_heads * self.head_dim), self.wo)

    def forward_fused(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:  # [T, H] -> [T, H]
        """forward on the GPU kernels (CausalLM.fusable): RoPE and the pool write in one kernel."""
        k_cache, v_cache = kv_cache
        q = ops.rope_write_kv(linear(x, self.wqkv), cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return linear(out.reshape(x.shape[0], self.num_heads * self.head_dim), self.wo)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate_proj, w3 = up_proj, w2 = down_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    @torch.no_grad()
    def fuse(self) -> None:
        """One [gate; up] projection instead of two."""
        w13 = nn.Linear(self.w1.in_features, 2 * self.w1.out_features, bias=False,
                        dtype=self.w1.weight.dtype, device=self.w1.weight.device)
        w13.weight.copy_(torch.cat([self.w1.weight, self.w3.weight]))
        self.w13 = w13
        del self.w1, self.w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if hasattr(self, "w13"):
            gate, up = linear(x, self.w13).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, self.w2)
        return linear(F.silu(linear(x, self.w1)) * linear(x, self.w3), self.w2)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H], on the GPU kernels
        return linear(ops.silu_mul(linear(x, self.w13)), self.w2)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:  # [T, H] -> [T, H]
        # Submodules' forward called directly: no hooks are used, and the call overhead counts.
        h = x + self.attention.forward(self.attention_norm.forward(x), cos, sin, kv_cache, meta)
        return h + self.feed_forward.forward(self.ffn_norm.forward(h))


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.to(dtype)
        self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # [max_pos, D/2]
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)  # [max_pos, D/2]
        self.init_rope_tables()

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def fuse_projections(self) -> None:
        """After loading: fuse q/k/v and gate/up projections (the loader maps HF names onto
        the unfused modules first)."""
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()

    def keep_transposed_weights(self) -> int:
        """Give every linear layer a transposed view of its weight, so that `linear` is one
        torch.mm (the same cuBLAS call F.linear ends in) instead of four dispatched ops, which
        count where a step is host-bound. A view, no copy: call this again if a weight is
        replaced (nothing does after loading).
        Returns the number of layers given one."""
        count = 0
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.__dict__["wt"] = module.weight.detach().t()
                count += 1
        return count

    def linear_weight_bytes(self) -> int:
        return sum(m.weight.numel() * m.weight.element_size() for m in self.modules() if isinstance(m, nn.Linear))

    def pack_for_onednn(self, min_layer_bytes: int = 0) -> int:
        """On the CPU in float32: run the linear layers of at least `min_layer_bytes` through
        oneDNN, each weight packed once here. Where weights stream from memory this is faster
        than torch's default (MKL sgemm under F.linear); a oneDNN call costs more, so small
        layers that stay in the CPU's caches lose (benchmarks/RESULTS.md). oneDNN also gives
        each row the same bits whatever the batch, which MKL does not. Returns the number of
        layers packed: 0 (and nothing changed) where it does not apply, on another device or
        dtype, or with a torch without oneDNN."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not onednn_linear_available():
            return 0
        keep_onednn_primitives()
        packed = 0
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.numel() * module.weight.element_size() >= min_layer_bytes:
                pack_onednn(module)
                packed += 1
        return packed

    def unpack_onednn(self) -> None:
        """Back to F.linear for every layer (pack_for_onednn undone; the plain weights stayed)."""
        for module in self.modules():
            module.__dict__.pop("onednn", None)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_rope_tables(self) -> None:
        """cos/sin of position * inv_freq for every position up to max_position_embeddings.
        Computed in float64, stored in float32 (float64 for a float64 model). Call again
        after moving a model built on the meta device."""
        table_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        shape = (self.args.max_position_embeddings, self.args.head_dim // 2)
        if self.device.type == "meta":
            self.rope_cos = torch.empty(shape, dtype=table_dtype, device="meta")
            self.rope_sin = torch.empty(shape, dtype=table_dtype, device="meta")
            return
        positions = torch.arange(self.args.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(positions, rope_inv_freq(self.args))  # [max_pos, D/2]
        self.rope_cos = angles.cos().to(device=self.device, dtype=table_dtype)
        self.rope_sin = angles.sin().to(device=self.device, dtype=table_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (k, v) per layer, each [NB, BS, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H], after the final norm
        x = self.tok_embeddings(input_ids)  # [T, H]
        # Gathered, cast and widened once per forward, not in every layer.
        cos, sin = rope_full_tables(self.rope_cos[positions], self.rope_sin[positions], x.dtype)  # [T, 1, D] each
        if ops.on_triton(x) and self.fusable():
            return self._forward_fused(x, cos, sin, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer.forward(x, cos, sin, kv_cache, meta)
        return self.norm.forward(x)

    def fusable(self) -> bool:
        """Whether the forward can run on the fused GPU kernels (kernels/fused.py): projections
        fused, no per-head q/k norm (Qwen3 keeps the op-by-op forward), 16- or 32-bit floats."""
        first = self.layers[0]
        return (hasattr(first.attention, "wqkv") and hasattr(first.feed_forward, "w13")
                and first.attention.q_norm is None and self.dtype in (torch.float16, torch.bfloat16, torch.float32))

    def _forward_fused(self, x, cos, sin, kv_caches, meta) -> torch.Tensor:
        """The layers with the residual stream carried beside the normalised row: each residual
        add is fused with the norm after it (the next layer's, or the final one), so a layer is
        four kernels beside its matmuls and attention. Same sums and norms as forward's loop."""
        layers = self.layers
        eps = self.norm.eps
        normed, residual = ops.add_rms_norm(x, None, layers[0].attention_norm.weight, eps)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            attn = layer.attention.forward_fused(normed, cos, sin, kv_cache, meta)
            normed, residual = ops.add_rms_norm(attn, residual, layer.ffn_norm.weight, eps)
            ffn = layer.feed_forward.forward_fused(normed)
            after = layers[i + 1].attention_norm if i + 1 < len(layers) else self.norm
            normed, residual = ops.add_rms_norm(ffn, residual, after.weight, eps)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32/float64
        logits = linear(hidden, self.output)  # the head has no bias
        return logits.double() if logits.dtype == torch.float64 else logits.float()

    def make_kv_caches(
        self, num_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K/V pool tensors, one (k, v) pair per layer, each [NB, BS, Hkv, D]: views of one
        [L, NB, BS, Hkv, D] tensor for K and one for V (`kv_pool` gives them back), so that one
        copy writes a row's keys of every layer."""
        device = self.device if device is None else device
        shape = (self.args.num_layers, num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        k, v = (torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(2))
        return list(zip(k.unbind(0), v.unbind(0)))


def kv_pool(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The [L, NB, BS, Hkv, D] K and V tensors whose views make_kv_caches returned."""
    k, v = kv_caches[0][0]._base, kv_caches[0][1]._base
    assert k is not None and v is not None and k.shape[0] == len(kv_caches), "not from make_kv_caches"
    return k, v
