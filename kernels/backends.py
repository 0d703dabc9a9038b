"""Attention backends: how a KV cache lays out its pools, what a step plans, how a layer attends.

A backend is chosen once, when a KV cache is built (`select_attention_backend(device, dtype)`,
called by `kernels.paged_kv.KVPools`), and the pools ask it for everything that depends on the
choice: the pools (`allocate`), each step's plan (`plan`: a dataclass of the backend's own, built
once from the step's `AttentionMetadata` and read by every layer) and each layer's write of the
new keys and values and attention over the cache (`forward`). No layer inspects tensor layouts
to find its path, and no module-level switch routes calls.

- `TritonBackend`: the Triton paged kernel (`kernels.triton.paged`), on CUDA; tests run it on
  CPU tensors under the interpreter (TRITON_INTERPRET=1). Head-major pools, read through their
  strides.
- `CpuPagedBackend`: a CPU. Head-major pools; the step's leading decodes read them in place,
  with the step's writes, in one compiled call per layer (`kernels.cpu.native`) where it could
  be built, else in PyTorch operations (`kernels.cpu.decode`); the sequences after them (prefills, chunks) score a prefix that
  several of them continue once (`kernels.cpu.cascade`), or else gather + SDPA
  (`kernels.sdpa_paged`).
- `SdpaGatherBackend`: any other device. Token-major pools, each sequence's blocks gathered for
  `scaled_dot_product_attention` (`kernels.sdpa_paged`).

Sliding windows (`kernels.window`): a step's windowed layers read plans of their own, one per
window, each built by `plan(meta, spec, window)` from the step's metadata trimmed to the blocks
the window reaches (`KVPools.plan` builds them and picks a layer's); every path masks the keys
before each query's window within the blocks it reads.

Every pool, whatever its layout, is indexed (n_layer, num_blocks, block_size, n_kv_head,
head_dim), so the cache copies blocks and writes slots the same way for all of them. A pool holds
the model's key/value heads only; with grouped-query attention the queries have more heads, and
every backend maps query head h to KV head h // group (`kernels.gqa`).
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from gptserve.kernels.cpu.cascade import CascadePlan, plan_cascade, prefill_attention_cpu
from gptserve.kernels.cpu.decode import (
    UPCAST_ELEMENTS,
    DecodePlan,
    decode_attention_cpu,
    plan_decode,
)
from gptserve.kernels.cpu.native import native_ops, paged_decode_op
from gptserve.kernels.metadata import AttentionMetadata, AttentionPlan, KVWrite
from gptserve.kernels.sdpa_paged import GatherPlan, paged_attention_sdpa, plan_gather
from gptserve.kernels.triton import available as triton_available

PlanT = TypeVar("PlanT", bound=AttentionPlan)

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the pools narrower than a float32 model that the compiled decodes read with float32 queries
# (the KV cache dtypes a float32 model may take: kernels.paged_kv.cache_dtype)
NARROWER_POOLS = (torch.float16, torch.bfloat16)
# the pools the compiled one-call decode (`paged_decode_qkv`) reads
ONE_CALL_POOLS = (torch.float32, *NARROWER_POOLS)


@dataclass(frozen=True)
class KVSpec:
    """The pools of one KV cache: n_layer layers of num_blocks blocks of block_size slots, each
    slot n_kv_head key/value heads of head_dim elements of dtype, on device; `group` query heads
    read each KV head (grouped-query attention; 1: as many query heads as KV heads)."""

    n_layer: int
    num_blocks: int
    block_size: int
    n_kv_head: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    group: int = 1
    # each layer's sliding window in tokens, None for a global layer (`kernels.window`); empty:
    # every layer global
    windows: tuple[int | None, ...] = ()

    @property
    def distinct_windows(self) -> tuple[int | None, ...]:
        """The layers' windows, each once, in layer order (None for global layers)."""
        return tuple(dict.fromkeys(self.windows or (None,)))

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """How every pool is indexed, whatever its layout in memory."""
        return (self.n_layer, self.num_blocks, self.block_size, self.n_kv_head, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes one token takes over all layers."""
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * self.dtype.itemsize


class AttentionBackend(ABC, Generic[PlanT]):
    """One way to run paged attention: a pool layout, a plan type and the attention itself."""

    def allocate(self, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value pools, `spec.shape` each; token-major unless a backend says
        otherwise (each slot's heads contiguous, then the block's slots, then the blocks)."""
        return tuple(zeroed_pool(spec.shape, spec.dtype, spec.device) for _ in range(2))

    @abstractmethod
    def plan(self, meta: AttentionMetadata, spec: KVSpec, window: int | None = None) -> PlanT:
        """What every layer of the step with this sliding `window` reads (None: the global
        layers), derived from its metadata once; for a window, `meta` is the step's trimmed to
        the blocks the window reaches (`kernels.window.trim_to_window`)."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: PlanT,
        sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """New tokens' queries (N, H, D) against one layer's pools (num_blocks, block_size,
        H_kv, D); the contract of `kernels.reference.paged_attention_reference`, with the
        plan's `window`."""

    def write(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        at: KVWrite,
    ) -> None:  # fmt: skip
        """Store the new tokens' keys and values (N, H_kv, D) in one layer's pools."""
        where = (at.block, at.offset)
        if k.dtype != k_pool.dtype:
            k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)
        k_pool.index_put_(where, k)
        v_pool.index_put_(where, v)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
        v_pool: torch.Tensor, plan: PlanT, sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One layer of a step: write k, v (N, H_kv, D), then attend q (N, H, D) -> (N, H, D).
        Pools of another dtype than q's (a KV cache dtype of its own) take q in theirs and give
        the result back in q's."""
        self.write(k_pool, v_pool, k, v, plan.write)
        if q.dtype == k_pool.dtype:
            return self.attend(q, k_pool, v_pool, plan, sm_scale)
        return self.attend(q.to(k_pool.dtype), k_pool, v_pool, plan, sm_scale).to(q.dtype)

    # ---- optional one-call paths: declared here, taken only where has_... says so ----------

    def has_qkv_path(
        self, pool_dtype: torch.dtype, plan: PlanT, qkv_dtype: torch.dtype,
        rope_dtype: torch.dtype | None,
    ) -> bool:  # fmt: skip
        """Whether `forward_qkv` takes this step (pools of `pool_dtype`, a q/k/v product of
        `qkv_dtype`, rotary tables of `rope_dtype` or None); no backend does by default."""
        return False

    def forward_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
        k_pool: torch.Tensor, v_pool: torch.Tensor, plan: PlanT, n_head: int,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One layer of a step from its q/k/v product (N, (H + 2 H_kv) * D) and rotary cos,
        sin (N, 1, D) (None: a model without rotary positions), rotation included, in one call:
        (N, H, D) in `out_dtype`. Only where `has_qkv_path` says so."""
        raise NotImplementedError(f"{type(self).__name__} has no q/k/v path")

    def has_one_call_step(self, pool_dtype: torch.dtype, plan: PlanT) -> bool:
        """Whether this step suits the compiled one-call decode of a whole layer; no backend
        does by default."""
        return False

    def one_call_step(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: PlanT
    ) -> tuple[torch.Tensor, ...]:
        """What the compiled one-call decode of a layer takes besides q/k/v (the pools, the
        slots' blocks and offsets, the tables and context lengths). Only where
        `has_one_call_step` says so."""
        raise NotImplementedError(f"{type(self).__name__} has no one-call decode")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _head_major(spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed pools whose every (block, head) is one contiguous (block_size, head_dim) tile,
    seen through the (n_layer, num_blocks, block_size, n_kv_head, head_dim) shape."""
    stored = (spec.n_layer, spec.num_blocks, spec.n_kv_head, spec.block_size, spec.head_dim)
    return tuple(zeroed_pool(stored, spec.dtype, spec.device).transpose(2, 3) for _ in range(2))


def zeroed_pool(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed tensor of `shape`. On a CPU its memory is an anonymous mapping, whose pages the
    system hands out zeroed when they are first written: a KV pool then takes resident memory as
    its blocks fill, not all of it at start (torch.zeros would write every page). Elsewhere
    torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class TritonPlan(AttentionPlan):
    """The kernel reads the metadata's tables and lengths itself; the split-K choice is the
    step's."""

    split_size: int  # keys per split


class TritonBackend(AttentionBackend[TritonPlan]):
    """The Triton paged kernel over head-major pools (its strides take any layout)."""

    def allocate(self, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return _head_major(spec)

    def plan(self, meta: AttentionMetadata, spec: KVSpec, window: int | None = None) -> TritonPlan:
        from gptserve.kernels.triton.paged import default_split_size

        n_head = spec.n_kv_head * spec.group  # a program per query head
        split = default_split_size(meta, n_head, spec.block_size, spec.device)
        return TritonPlan(meta, KVWrite.of(meta, spec.block_size), split, window=window)

    def attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: TritonPlan,
        sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        from gptserve.kernels.triton import paged

        return paged.triton_paged_attention(
            q, k_pool, v_pool, plan.meta, sm_scale, split_size=plan.split_size, window=plan.window
        )


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class CpuPagedPlan(AttentionPlan):
    """A step cut after its leading decodes: they read the pools in place, the rest (prefills
    and chunks) take the cascade when several continue one cached prefix, else gather + SDPA."""

    decodes: AttentionMetadata | None  # the leading sequences with one new token each
    decode: DecodePlan | None  # None where the compiled kernel takes the decodes
    rest: AttentionMetadata | None  # the sequences after them
    rest_plan: CascadePlan | GatherPlan | None


@dataclass
class CpuPagedBackend(AttentionBackend[CpuPagedPlan]):
    """Head-major pools on a CPU. `cascade=False` leaves every prefill to gather + SDPA (what
    the cascade is measured against). `batch_invariant`: the decode attention multiplies
    bfloat16 and float16 keys in their dtype whatever the step's size (by default a small step
    is upcast to float32, which is faster there but makes a sequence's result depend on its
    batch). `native=False` keeps the decodes on PyTorch operations where the compiled kernel
    (`kernels.cpu.native`, batch-invariant in every dtype) is built."""

    cascade: bool = True
    batch_invariant: bool = False
    native: bool = True

    def allocate(self, spec: KVSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return _head_major(spec)

    def plan(
        self, meta: AttentionMetadata, spec: KVSpec, window: int | None = None
    ) -> CpuPagedPlan:
        """A windowed layer's prefills take gather + SDPA (the cascade's shared blocks are
        scored unmasked)."""
        n = meta.num_decodes
        if n == meta.num_seqs:
            decodes, rest = meta, None
        elif n == 0:
            decodes, rest = None, meta
        else:
            decodes, rest = meta.split(n)
        decode = None  # None with decodes: the compiled kernel takes them
        if decodes is not None and self._native() is None:
            decode = plan_decode(decodes, spec.block_size, spec.n_kv_head, window)
        rest_plan = None
        if rest is not None:
            if self.cascade and window is None:
                rest_plan = plan_cascade(rest, spec.block_size)
            if rest_plan is None or not rest_plan.groups:
                rest_plan = plan_gather(
                    rest, spec.block_size, spec.n_kv_head, spec.head_dim, spec.dtype.itemsize,
                    window,
                )  # fmt: skip
        write = KVWrite.of(meta, spec.block_size)
        return CpuPagedPlan(meta, write, decodes, decode, rest, rest_plan, window=window)

    def _native(self):
        """The compiled decode kernel, or None: not wanted or not built."""
        return paged_decode_op() if self.native else None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
        v_pool: torch.Tensor, plan: CpuPagedPlan, sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if plan.decodes is None or plan.decode is not None:
            return super().forward(q, k, v, k_pool, v_pool, plan, sm_scale)
        # the compiled kernel: every write, then the leading decodes' attention, in one call
        out_dtype = q.dtype
        # float32 q, k, v over float16/bfloat16 pools go in as they are (the one-call path's
        # arithmetic, `forward_qkv`); any other mix in the pools' dtype
        same = out_dtype == k.dtype == v.dtype
        narrower = same and out_dtype == torch.float32 and k_pool.dtype in NARROWER_POOLS
        if not narrower and not (same and out_dtype == k_pool.dtype):
            q, k, v = (t.to(k_pool.dtype) for t in (q, k, v))
        meta, n = plan.decodes, plan.decodes.num_seqs  # one token each
        scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
        out = self._native()(  # (n, H, D)
            q, k, v, k_pool, v_pool, plan.write.block, plan.write.offset, meta.block_tables,
            meta.context_lens, n, scale, plan.window or 0,
        )  # fmt: skip
        if plan.rest is not None:
            rest = self._rest(q[n:].to(k_pool.dtype), k_pool, v_pool, plan, sm_scale)
            out = torch.cat([out, rest.to(out.dtype)])
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def has_qkv_path(
        self, pool_dtype: torch.dtype, plan: CpuPagedPlan, qkv_dtype: torch.dtype,
        rope_dtype: torch.dtype | None,
    ) -> bool:  # fmt: skip
        """The compiled `paged_decode_qkv` takes a one-call step (`has_one_call_step`) with
        float32 rotary or none, over float32 pools (as `forward` computes them, to the bit in
        the attention's inputs) or, for a float32 model, float16 or bfloat16 pools (its query
        stays float32); a bfloat16/float16 model over its own cache takes `forward`."""
        if not self.has_one_call_step(pool_dtype, plan):
            return False
        if rope_dtype is not None and rope_dtype != torch.float32:
            return False
        return pool_dtype == torch.float32 or qkv_dtype == torch.float32

    def forward_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
        k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CpuPagedPlan, n_head: int,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        step = self.one_call_step(k_pool, v_pool, plan)
        n, scale = qkv.shape[0], k_pool.shape[-1] ** -0.5
        if cos is not None:
            cos, sin = cos.view(n, -1), sin.view(n, -1)  # (N, R): R < D rotates part of a head
        return native_ops().paged_decode_qkv(
            qkv, cos, sin, *step, n_head, scale, out_dtype or torch.float32, plan.window or 0
        )

    def has_one_call_step(self, pool_dtype: torch.dtype, plan: CpuPagedPlan) -> bool:
        """A step of decodes only that the plan gave the compiled kernel, over float32, float16
        or bfloat16 pools."""
        if plan.rest is not None or plan.decodes is None or plan.decode is not None:
            return False
        return pool_dtype in ONE_CALL_POOLS

    def one_call_step(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CpuPagedPlan
    ) -> tuple[torch.Tensor, ...]:
        meta = plan.decodes  # trimmed to the window in a windowed layer's plan
        return (k_pool, v_pool, plan.write.block, plan.write.offset, meta.block_tables,
                meta.context_lens)  # fmt: skip

    def attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CpuPagedPlan,
        sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        upcast = 0 if self.batch_invariant else UPCAST_ELEMENTS
        if plan.rest is None:
            return decode_attention_cpu(
                q, k_pool, v_pool, plan.decodes, sm_scale, plan.decode, upcast, plan.window
            )
        if plan.decodes is None:
            return self._rest(q, k_pool, v_pool, plan, sm_scale)
        n = plan.decodes.num_seqs  # one token each
        first = decode_attention_cpu(
            q[:n], k_pool, v_pool, plan.decodes, sm_scale, plan.decode, upcast, plan.window
        )
        return torch.cat([first, self._rest(q[n:], k_pool, v_pool, plan, sm_scale)])

    @staticmethod
    def _rest(
        q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CpuPagedPlan,
        sm_scale: float | None,
    ) -> torch.Tensor:  # fmt: skip
        if isinstance(plan.rest_plan, CascadePlan):
            return prefill_attention_cpu(q, k_pool, v_pool, plan.rest, sm_scale, plan.rest_plan)
        return paged_attention_sdpa(q, k_pool, v_pool, plan.rest, sm_scale, plan.rest_plan)


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class SdpaGatherPlan(AttentionPlan):
    gather: GatherPlan


class SdpaGatherBackend(AttentionBackend[SdpaGatherPlan]):
    """Token-major pools; each sequence's blocks are copied out for SDPA, on any device."""

    def plan(
        self, meta: AttentionMetadata, spec: KVSpec, window: int | None = None
    ) -> SdpaGatherPlan:
        kv_bytes = spec.dtype.itemsize
        gather = plan_gather(meta, spec.block_size, spec.n_kv_head, spec.head_dim, kv_bytes, window)
        return SdpaGatherPlan(meta, KVWrite.of(meta, spec.block_size), gather, window=window)

    def attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: SdpaGatherPlan,
        sm_scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return paged_attention_sdpa(q, k_pool, v_pool, plan.meta, sm_scale, plan.gather)


def select_attention_backend(
    device: torch.device | str, dtype: torch.dtype, batch_invariant: bool = False
) -> AttentionBackend:
    """The backend for pools of `dtype` on `device`: the CPU paths on a CPU, Triton on CUDA
    (where triton is installed and has the dtype), gather + SDPA anywhere else.
    `batch_invariant` is for the CPU paths (`kernels.cpu.row_invariant`: every new token attends
    as a decode does); elsewhere nothing promises it."""
    device = torch.device(device)
    if device.type == "cpu" and batch_invariant:
        from gptserve.kernels.cpu.row_invariant import RowInvariantCpuBackend  # imports this

        return RowInvariantCpuBackend()
    if device.type == "cpu":
        return CpuPagedBackend()
    if device.type == "cuda" and dtype in TRITON_DTYPES and triton_available():
        return TritonBackend()
    return SdpaGatherBackend()
