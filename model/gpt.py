"""A GPT-2 style decoder-only Transformer with GPT-2 parameter names.

Three ways to run it:
- `model(idx)`: full causal forward, logits (B, T, V); no cache.
- `model.loss(idx, targets)`: the training loss (cross-entropy, ignore_index -1).
- `model.forward_cached(tokens, cache, meta)`: inference over the paged KV cache for a packed batch
  of sequences, each with one (decode) or many (prefill) new tokens, described by the step's
  `AttentionMetadata`.

CPU inference layouts are applied from outside, to a loaded model (`model.cpu.optimize_for_cpu`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.kernels import flash_attention
from gptserve.kernels.metadata import AttentionMetadata, AttentionPlan, PagedKV
from gptserve.model.chunked_loss import head_loss
from gptserve.model.config import ModelConfig
from gptserve.model.rmsnorm import GemmaRMSNorm, RMSNorm
from gptserve.model.rotary import (
    apply_rotary,
    rotary_attention_factor,
    rotary_cos_sin,
    rotary_inv_freq,
)


def sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """(n_pos, dim) fixed encodings: sin on even channels, cos on odd, geometric wavelengths."""
    pos = torch.arange(n_pos, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


Rope = (
    tuple[torch.Tensor, torch.Tensor] | None
)  # cos, signed sin (N, 1, rope_dim) of each token (model.rotary); None: no rotary


def _norm(config: ModelConfig, dim: int, scale: float = 1.0) -> nn.Module:
    """The config's norm over `dim` channels; `scale` (a query norm's) only for Gemma's."""
    if config.norm == "gemma_rmsnorm":
        return GemmaRMSNorm(dim, eps=config.layer_norm_eps, scale=scale)
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=config.bias)


def _submodules(module: nn.Module, *names: str) -> tuple[nn.Module, ...]:
    """`module`'s children by name, read from its dict. The cached forward runs once a layer and
    step: `module.name` (Module.__getattr__) and calling a child (Module.__call__, for hooks,
    which inference does not use) cost about a microsecond each, half a millisecond a step of a
    30-layer model, so that path reads children here and calls their `forward`."""
    children = module._modules
    return tuple(children[name] for name in names)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with n_kv_head key/value heads (grouped-query when fewer); `window`:
    each query sees only itself and the window - 1 tokens before it (sliding-window attention,
    `kernels.window`). The cached forward takes each layer's window from the cache's pools."""

    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        q_width, kv_width = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, q_width + 2 * kv_width, bias=config.attn_bias)
        self.c_proj = nn.Linear(q_width, config.n_embd, bias=config.bias)
        self.qk_norm = config.qk_norm  # a plain flag: `hasattr` on a module raises inside
        if config.qk_norm:  # Qwen3: each head's query and key normalized before the rotation
            # Gemma 3's query norm also scales queries for its query_pre_attn_scalar
            self.q_norm = _norm(config, self.head_dim, scale=config.query_scale)
            self.k_norm = _norm(config, self.head_dim)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def _qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., T, C) -> q (..., T, nh, hs), k and v (..., T, n_kv, hs), normed and rotated."""
        return self._heads(self.c_attn(x), rope)

    def _heads(
        self, qkv: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """c_attn's (..., T, (nh + 2 n_kv) * hs) -> q, k, v as `_qkv` returns them."""
        qkv = qkv.unflatten(-1, (self.n_head + 2 * self.n_kv_head, self.head_dim))
        qk, v = qkv.split((self.n_head + self.n_kv_head, self.n_kv_head), dim=-2)
        if self.qk_norm:
            q, k = qk.split((self.n_head, self.n_kv_head), dim=-2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-2)
        if rope is not None:  # queries and keys rotated together: one position per token
            qk = apply_rotary(qk, *rope)
        q, k = qk.split((self.n_head, self.n_kv_head), dim=-2)  # (..., T, nh | n_kv, hs)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, rope))  # (B, heads, T, hs)
        # (B, nh, T, hs); KV head h // group for head h
        if self.window is None:  # (a global layer's call, as before windows)
            y = flash_attention(q, k, v, causal=True)
        else:
            y = flash_attention(q, k, v, causal=True, window=self.window)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))

    def forward_cached(
        self, x: torch.Tensor, cache: PagedKV, layer: int, plan: AttentionPlan,
        rope: Rope = None,
    ) -> torch.Tensor:  # fmt: skip
        N = x.shape[0]
        c_attn, c_proj = _submodules(self, "c_attn", "c_proj")
        qkv = c_attn.forward(x)  # (N, (nh + 2 n_kv) * hs)
        rope_dtype = None if rope is None else rope[0].dtype
        if not self.qk_norm and cache.has_qkv_path(plan, qkv.dtype, rope_dtype):
            # the rotation, the writes and the attention in one call, (N, nh, hs) in the dtype
            # c_proj takes (its `op_dtype` where it has one)
            y = cache.attend_qkv(layer, qkv, rope, plan, self.n_head, getattr(c_proj, "op_dtype", None))  # fmt: skip
        else:
            q, k, v = self._heads(qkv, rope)  # (N, nh, hs), (N, n_kv, hs), (N, n_kv, hs)
            y = cache.attend(layer, q, k, v, plan)  # (N, nh, hs); k and v are stored first
        return c_proj.forward(y.reshape(N, self.n_head * self.head_dim))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """GPT-2's MLP (gelu or relu), or Llama's SwiGLU and Gemma's GeGLU: c_fc holds the gate's
    rows, then up's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width = config.mlp_width
        self.gated = config.gated_mlp
        self.gelu_gate = config.activation == "geglu"  # gelu (tanh) of the gate, not silu
        self.gate_fn = _gelu_tanh if self.gelu_gate else F.silu
        self.c_fc = nn.Linear(config.n_embd, (2 if self.gated else 1) * width, bias=config.bias)
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.relu = config.activation == "relu"
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.gate_fn(gate) * up
        else:
            h = F.relu(h) if self.relu else F.gelu(h, approximate="tanh")
        h = self.c_proj(h)
        return self.dropout(h) if self.training else h


class Block(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.ln_1 = _norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, window)
        self.ln_2 = _norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        return self._residual(x, lambda h: self.attn(h, rope))

    def forward_cached(
        self, x: torch.Tensor, cache: PagedKV, layer: int, plan: AttentionPlan,
        rope: Rope = None,
    ) -> torch.Tensor:  # fmt: skip
        attn = self._modules["attn"]  # see `_submodules`
        return self._residual(x, lambda h: attn.forward_cached(h, cache, layer, plan, rope))

    def _residual(self, x: torch.Tensor, attend) -> torch.Tensor:
        ln_1, ln_2, mlp = _submodules(self, "ln_1", "ln_2", "mlp")
        if self.pre_norm:
            x = x + attend(ln_1.forward(x))
            return x + mlp.forward(ln_2.forward(x))
        x = ln_1.forward(x + attend(x))  # post-LN "Add & Norm"
        return ln_2.forward(x + mlp.forward(x))


class SandwichBlock(Block):
    """Gemma 3's layer: each branch normed on its way in (ln_1, ln_2) and on its way out
    (post_attn_norm, post_mlp_norm), before its residual add."""

    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__(config, window)
        self.post_attn_norm = _norm(config, config.n_embd)
        self.post_mlp_norm = _norm(config, config.n_embd)

    def _residual(self, x: torch.Tensor, attend) -> torch.Tensor:
        ln_1, ln_2, mlp, post_attn_norm, post_mlp_norm = _submodules(
            self, "ln_1", "ln_2", "mlp", "post_attn_norm", "post_mlp_norm"
        )
        x = x + post_attn_norm.forward(attend(ln_1.forward(x)))
        return x + post_mlp_norm.forward(mlp.forward(ln_2.forward(x)))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        block = SandwichBlock if config.sandwich_norm else Block
        layers = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(block(config, window) for window in config.layer_windows()),
        )
        if config.pos_encoding == "learned":
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        if config.norm_position == "pre":
            layers["ln_f"] = _norm(config, config.n_embd)
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.pos_encoding == "sinusoidal":
            table = sinusoidal_table(config.block_size, config.n_embd)
            self.register_buffer("pos_table", table, persistent=False)
        if config.pos_encoding == "rotary":
            inv_freq = rotary_inv_freq(config.rope_dim, config.rope_theta, config.rope_scaling)
            self.register_buffer("rope_inv_freq", inv_freq, persistent=False)  # float32 always
        self.rope_factor = rotary_attention_factor(config.rope_scaling)  # 1.0 but for longrope
        # Gemma 3: sliding-window layers rotate by another base (one more table per forward)
        self.local_rope_layers = config.local_rope_layers()
        if self.local_rope_layers is not None:
            local = rotary_inv_freq(config.rope_dim, config.rope_local_theta)
            self.register_buffer("rope_local_inv_freq", local, persistent=False)
        # Gemma: a float32 scalar cast with the model, as transformers rounds it; None: no scale
        scale = None if config.embed_scale is None else torch.tensor(float(config.embed_scale))
        self.register_buffer("embed_scale", scale, persistent=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        if self.config.embed_scale is not None:  # the config's: a plain read, not a buffer's
            x = x * self.embed_scale.to(x.dtype)
        if self.config.pos_encoding == "learned":
            x = x + self.transformer.wpe(pos)
        elif self.config.pos_encoding == "sinusoidal":
            x = x + self.pos_table[pos].to(x.dtype)
        return self.transformer.drop(x)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos, sin of every token's position, once per forward for all layers (rotary only)."""
        if self.config.pos_encoding != "rotary":
            return None
        return rotary_cos_sin(pos, self.rope_inv_freq.to(pos.device), dtype, self.rope_factor)

    def _local_rope(self, pos: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos, sin by `rope_local_inv_freq`, for the layers `local_rope_layers` marks."""
        return rotary_cos_sin(pos, self.rope_local_inv_freq.to(pos.device), dtype)

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final hidden states as the head reads them (after ln_f, where the model has one)."""
        if "ln_f" in self.transformer:
            x = self.transformer.ln_f(x)
        return x

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's logits of final hidden states after the final norm, soft-capped where the
        config says (Gemma's final_logit_softcapping)."""
        logits = self.lm_head(normed)
        cap = self.config.logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(self._final_norm(x))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) final hidden states before ln_f/lm_head."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self._embed(idx, pos)  # (B, T, C)
        rope = self._rope(pos, x.dtype)
        if self.local_rope_layers is None:
            for block in self.transformer.h:
                x = block(x, rope)
            return x
        local = self._local_rope(pos, x.dtype)
        for block, is_local in zip(self.transformer.h, self.local_rope_layers):
            x = block(x, local if is_local else rope)
        return x

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab_size) logits."""
        return self._head(self.hidden(idx))

    def loss(
        self, idx: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1
    ) -> torch.Tensor:
        """Mean cross-entropy of next-token predictions; targets equal to ignore_index count for
        nothing. The head runs over row chunks (model.chunked_loss): the batch's logits are never
        all held at once."""
        return head_loss(self, self._final_norm(self.hidden(idx)), targets, ignore_index)

    def forward_cached(
        self,
        tokens: torch.Tensor,
        cache: PagedKV,
        meta: AttentionMetadata,
        logits_index: torch.Tensor | None = None,
        hidden_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run packed new tokens (N,) through the model, reading and extending the paged cache.

        logits_index selects which of the N positions get logits (default: each sequence's last
        new token). Returns (len(logits_index), vocab_size); with hidden_index, also the final
        hidden states after the final norm (what the head reads) of those positions:
        (logits, (len(hidden_index), n_embd)), from the same forward (embeddings).
        """
        x = self._embed(tokens, meta.positions)  # (N, C)
        rope = self._rope(meta.positions, x.dtype)
        plan = cache.plan(meta)  # the attention backend's, built once for every layer
        if self.local_rope_layers is None:
            for layer, block in enumerate(self.transformer.h):
                x = block.forward_cached(x, cache, layer, plan, rope)
        else:
            local = self._local_rope(meta.positions, x.dtype)
            for layer, block in enumerate(self.transformer.h):
                layer_rope = local if self.local_rope_layers[layer] else rope
                x = block.forward_cached(x, cache, layer, plan, layer_rope)
        index = meta.last_token_index if logits_index is None else logits_index
        if hidden_index is None:
            return self._head(x[index])  # (M, V)
        normed = self._final_norm(x[torch.cat([index, hidden_index])])  # one norm for both
        return self._logits(normed[: len(index)]), normed[len(index) :]
