"""The KV cache's memory and the attention over it: `KVPools`, what a model's cached forward takes.

The pools are indexed (n_layer, num_blocks, block_size, n_kv_head, head_dim) whatever their layout
in memory, which is the attention backend's (`kernels.backends`), chosen once here from the
device and dtype unless one is given. Which block holds which tokens is not known here: that
bookkeeping is the engine's (`engine.block_manager`), which hands each step its
`AttentionMetadata` and the block copies to make first (`copy_blocks`). A step's attention is
`plan(meta)` once, then `attend(layer, ...)` per layer, or, where the step and the backend suit
it, one of the declared one-call paths (`has_qkv_path` -> `attend_qkv`, `has_one_call_step` ->
`one_call_step`; a step with LoRA adapter rows is the one-call layer's to judge, since it reads
the products' weights itself: `model.cpu.one_call_block`). The pools hold the model's key/value
heads only: with grouped-query attention, `group` query heads read each of them (`kernels.gqa`).

Each layer may have a sliding window (`windows`, `kernels.window`): `plan(meta)` then also plans
each distinct window once, from the step's metadata trimmed to the blocks that window reaches,
and every per-layer call reads its layer's plan (`AttentionPlan.for_window`), so no windowed
layer reads a block before its window.
"""

from __future__ import annotations

import torch
from gptserve.kernels.backends import (
    NARROWER_POOLS,
    AttentionBackend,
    KVSpec,
    select_attention_backend,
)
from gptserve.kernels.metadata import AttentionMetadata, AttentionPlan, KVWrite
from gptserve.kernels.window import check_window, trim_to_window

Rope = tuple[torch.Tensor, torch.Tensor] | None  # cos, signed sin (N, 1, D); None: no rotary


def cache_dtype(model_dtype: torch.dtype, asked: torch.dtype | None) -> torch.dtype:
    """The KV cache's dtype for a model computing in `model_dtype`: `asked`, or the model's own
    where None. A cache is the model's dtype or, under a float32 model, float16 or bfloat16;
    raises ValueError for any other (a cache wider than its model, or of another 16-bit kind)."""
    if asked is None or asked == model_dtype:
        return model_dtype
    if model_dtype == torch.float32 and asked in NARROWER_POOLS:
        return asked
    name = str(model_dtype).removeprefix("torch.")
    raise ValueError(
        f"--kv-cache-dtype {str(asked).removeprefix('torch.')} does not go with a {name} model: "
        f"the cache is the model's dtype ({name}) or, under a float32 model, float16 or bfloat16"
    )


class KVPools:
    """Key and value pools of every layer and the attention backend that reads them."""

    def __init__(
        self,
        n_layer: int,
        n_kv_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: AttentionBackend | None = None,
        group: int = 1,
        batch_invariant: bool = False,
        windows: tuple[int | None, ...] | None = None,
    ) -> None:
        self.device = torch.device(device)
        windows = (None,) * n_layer if windows is None else tuple(windows)
        if len(windows) != n_layer:
            raise ValueError(f"windows names {len(windows)} layers, the pools have {n_layer}")
        for window in windows:
            check_window(window)
        self.windows = windows  # each layer's sliding window, None for a global layer
        self.spec = KVSpec(
            n_layer, num_blocks, block_size, n_kv_head, head_dim, dtype, self.device, group,
            windows,
        )  # fmt: skip
        self.backend = backend or select_attention_backend(self.device, dtype, batch_invariant)
        self.k, self.v = self.backend.allocate(self.spec)
        # each layer's pools as views made once: indexing self.k per layer and step costs more
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))
        self.block_size = block_size

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: AttentionBackend | None = None,
        batch_invariant: bool = False,
    ) -> KVPools:
        """Pools shaped for `model` (its config's layers, key/value heads and each layer's sliding
        window), on its device and dtype unless given."""
        p = next(model.parameters())
        c = model.config
        return cls(
            c.n_layer, c.kv_heads, c.head_dim, num_blocks, block_size,
            device=device or p.device, dtype=dtype or p.dtype, backend=backend,
            group=c.n_head // c.kv_heads, batch_invariant=batch_invariant,
            windows=c.layer_windows(),
        )  # fmt: skip

    @staticmethod
    def bytes_per_block(
        n_layer: int, n_kv_head: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Key and value bytes of one block over all layers, `n_kv_head` heads a slot."""
        return 2 * n_layer * block_size * n_kv_head * head_dim * dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes one cached token takes over all layers."""
        return self.spec.bytes_per_token

    @property
    def num_blocks(self) -> int:
        return self.spec.num_blocks

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block over every layer, in order: the copies on
        write and the prefix matches the block bookkeeping asked for before this step."""
        for src, dst in copies:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    # ---- a step's attention ----------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        """The backend's plan of the step `meta` describes, for every layer of the step: the
        global layers' plan, holding one per window of the windowed layers (`windows`); where
        every layer is windowed, the first window's (no plan reads the whole tables then: the
        engine may have freed the blocks before every window)."""
        plans = {}
        for window in self.spec.distinct_windows:
            if window is None:
                plans[None] = self.backend.plan(meta, self.spec)
            else:
                trimmed = trim_to_window(meta, window, self.block_size)
                plans[window] = self.backend.plan(trimmed, self.spec, window)
        main = plans[None] if None in plans else next(iter(plans.values()))
        main.windows.update((w, p) for w, p in plans.items() if w is not None)
        return main

    def window(self, layer: int) -> int | None:
        """`layer`'s sliding window in tokens, None for a global layer."""
        return self.windows[layer]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """Store one layer's new keys/values (N, H_kv, D) at the step's slots, then attend the
        new tokens' queries (N, H, D) over their sequences' cache: (N, H, D)."""
        step = plan.for_window(self.windows[layer])
        return self.backend.forward(q, k, v, *self._layers[layer], step)

    def has_qkv_path(
        self, plan: AttentionPlan, qkv_dtype: torch.dtype, rope_dtype: torch.dtype | None
    ) -> bool:
        """Whether `attend_qkv` takes this step: a q/k/v product of `qkv_dtype` and rotary
        tables of `rope_dtype` (None: no rotary positions). A step with LoRA adapter rows takes
        it too: the q/k/v product and the output product around it are still the model's own."""
        return self.backend.has_qkv_path(self.spec.dtype, plan, qkv_dtype, rope_dtype)

    def attend_qkv(
        self, layer: int, qkv: torch.Tensor, rope: Rope, plan: AttentionPlan, n_head: int,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """A whole decode step of one layer from its q/k/v product (N, (H + 2 H_kv) * D) and
        rotary cos, sin (N, 1, D): the rotation, the writes and the attention, (N, H, D) in
        `out_dtype` (None: float32). Only where `has_qkv_path` says so."""
        cos, sin = rope if rope is not None else (None, None)
        step = plan.for_window(self.windows[layer])
        return self.backend.forward_qkv(
            qkv, cos, sin, *self._layers[layer], step, n_head, out_dtype
        )

    def has_one_call_step(self, plan: AttentionPlan) -> bool:
        """Whether this step suits the compiled one-call decode of a whole layer (whose LoRA
        updates, if the step has adapter rows, are the layer's: `OneCallBlock.lora_updates`)."""
        return self.backend.has_one_call_step(self.spec.dtype, plan)

    def one_call_step(self, layer: int, plan: AttentionPlan) -> tuple[torch.Tensor, ...]:
        """One layer's pools and this step's slots, tables and context lengths, as the compiled
        one-call decode takes them (`model.cpu.decode_layer`), the tables and lengths trimmed to
        the layer's window where it has one (the call takes `window(layer)` too). Only where
        `has_one_call_step` says so."""
        step = plan.for_window(self.windows[layer])
        return self.backend.one_call_step(*self._layers[layer], step)

    def write(self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's new keys/values (N, H_kv, D) at the step's slots."""
        self.backend.write(*self._layers[layer], k, v, KVWrite.of(meta, self.block_size))
