"""Grouped-query attention on every path: query head h reads key/value head h // group.

Each path runs with group sizes 1, 3, 4 and 8 (two KV heads, so 2 to 16 query heads) and head
dims 64 and 128 against `kernels.reference`, whose own mapping is checked first against
per-head attention written out by hand. The Triton kernels run in the interpreter (conftest.py).
"""

from __future__ import annotations

from functools import partial

import gptserve.kernels.cpu.cascade as cascade
import pytest
import torch
import torch.nn.functional as F
from gptserve.kernels import flash_attention
from gptserve.kernels.backends import CpuPagedBackend, KVSpec, SdpaGatherBackend, TritonBackend
from gptserve.kernels.cpu.cascade import plan_cascade, prefill_attention_cpu
from gptserve.kernels.cpu.decode import decode_attention_cpu, plan_decode
from gptserve.kernels.gqa import kv_group
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.kernels.reference import attention_reference, paged_attention_reference
from gptserve.kernels.sdpa_paged import paged_attention_sdpa
from gptserve.kernels.triton import available as triton_available
from gptserve.model import GPT, ModelConfig
from gptserve.model import gpt as gpt_module

from tests.kernels.kernel_testing import TOLERANCE, paged_batch, rel_error

GROUPS = [1, 3, 4, 8]
HEAD_DIMS = [64, 128]
N_KV = 2
BY_GROUP_AND_DIM = pytest.mark.parametrize(
    "group, head_dim", [(g, d) for g in GROUPS for d in HEAD_DIMS], ids=lambda x: str(x)
)
# decode (1 new token), prefill and extend in one batch, contexts from 1 to 70 tokens
MIXED = dict(ctx_lens=[1, 70, 9, 33], q_lens=[1, 1, 9, 12])


def _dense(batch, n_head, n_kv, t_q, t_k, head_dim, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_head, t_q, head_dim, generator=gen)
    k = torch.randn(batch, n_kv, t_k, head_dim, generator=gen)
    v = torch.randn(batch, n_kv, t_k, head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ---- the oracle ---------------------------------------------------------------------------


@pytest.mark.parametrize("group", GROUPS)
def test_the_reference_gives_query_head_h_the_kv_head_h_over_group(group):
    q, k, v = _dense(2, N_KV * group, N_KV, 7, 11, 16)
    out = attention_reference(q, k, v, causal=True)
    mask = torch.ones(7, 11, dtype=torch.bool).tril(diagonal=11 - 7)  # bottom-right causal
    for h in range(N_KV * group):
        one = F.scaled_dot_product_attention(
            q[:, h : h + 1], k[:, h // group : h // group + 1], v[:, h // group : h // group + 1],
            attn_mask=mask,
        )  # fmt: skip
        torch.testing.assert_close(out[:, h : h + 1], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", GROUPS)
def test_the_paged_reference_is_the_dense_one_per_sequence(group):
    q, k, v, meta = paged_batch(**MIXED, page_size=8, n_head=N_KV * group, head_dim=16,
                                dtype=torch.float32, device="cpu", n_kv_head=N_KV)  # fmt: skip
    out = paged_attention_reference(q, k, v, meta)
    for i, n in enumerate(meta.seq_lens):
        rows = slice(int(meta.query_start[i]), int(meta.query_start[i + 1]))
        blocks = meta.block_tables[i, : -(-n // 8)].long()
        keys, values = (pool[blocks].flatten(0, 1)[:n] for pool in (k, v))  # (n, H_kv, D)
        dense = attention_reference(
            q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
        )[0]  # fmt: skip
        torch.testing.assert_close(out[rows], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="cannot share"):
        kv_group(6, 4)
    q, k, v, meta = paged_batch([5], [1], 4, n_head=3, head_dim=8, dtype=torch.float32,
                                device="cpu", n_kv_head=2)  # fmt: skip
    with pytest.raises(ValueError, match="cannot share"):
        paged_attention_reference(q, k, v, meta)
    with pytest.raises(ValueError, match="cannot share"):
        paged_attention_sdpa(q, k, v, meta)


# ---- training: flash_attention and the Triton flash kernel --------------------------------


@pytest.mark.parametrize("group", GROUPS)
def test_flash_attention_takes_unexpanded_keys_and_values(group):
    q, k, v = (t.requires_grad_() for t in _dense(2, N_KV * group, N_KV, 9, 9, 16))
    out = flash_attention(q, k, v, causal=True)  # fewer KV heads: grouped by itself
    ref = attention_reference(q, k, v)
    assert rel_error(out, ref) < 1e-4
    grad = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    ):
        assert got.shape == want.shape and rel_error(got, want) < 1e-4


def _triton(module: str):
    """A module of kernels.triton, or a skip where triton is not installed."""
    return pytest.importorskip(
        f"gptserve.kernels.triton.{module}", reason="triton is not installed"
    )


@BY_GROUP_AND_DIM
def test_triton_flash_forward_and_backward(group, head_dim):
    """dK and dV of a KV head are the sums over its group's query heads, as autograd of the
    reference (which repeats the head) gives them."""
    flash = _triton("flash")
    q, k, v = (t.requires_grad_() for t in _dense(1, N_KV * group, N_KV, 37, 37, head_dim))
    out = flash.triton_flash_attention(q, k, v, enable_gqa=True, blocks=(16, 16))
    ref = attention_reference(q, k, v)
    assert out.shape == q.shape and rel_error(out, ref) < 1e-3
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert rel_error(g, w) < 2e-3, name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_triton_flash_groups_with_other_lengths_and_half_precision(causal, dtype):
    # 19 queries over 33 keys, tuned tiles, strided views as the model hands them in
    flash = _triton("flash")
    q, k, v = _dense(2, 8, 2, 19, 33, 64, seed=3, dtype=dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # (B, H, T, D) strided
    k, v = k.requires_grad_(), v.requires_grad_()
    out = flash.triton_flash_attention(q, k, v, causal=causal, enable_gqa=True)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q32, k32, v32, causal=causal)
    assert rel_error(out, ref) < TOLERANCE[dtype]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q32, k32, v32), grad.float())
    for g, w in zip(got, want):
        assert g.dtype == dtype and rel_error(g, w) < 2 * TOLERANCE[dtype]


def test_triton_flash_wants_enable_gqa_for_fewer_kv_heads():
    flash = _triton("flash")
    q, k, v = _dense(1, 4, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="incompatible shapes"):
        flash.triton_flash_attention(q, k, v)  # as SDPA without enable_gqa
    k3, v3 = (t[:, :1].expand(1, 3, 8, 16) for t in (k, v))  # 4 query heads over 3 KV heads
    with pytest.raises(ValueError, match="incompatible shapes"):
        flash.triton_flash_attention(q, k3, v3, enable_gqa=True)


def test_a_llama_trains_through_the_triton_kernel_as_through_sdpa(monkeypatch):
    """The model's full forward hands k and v of its 2 KV heads to attention unexpanded: its loss
    and every gradient through the Triton kernel equal those through SDPA's `enable_gqa`."""
    flash = _triton("flash")
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=101, block_size=32, n_layer=2, n_head=8, n_kv_head=2,
                         n_embd=64, pos_encoding="rotary", norm="rmsnorm", activation="swiglu",
                         bias=False)  # fmt: skip
    model = GPT(config)
    idx, targets = torch.randint(0, 101, (2, 2, 24), generator=torch.Generator().manual_seed(1))
    results = []
    for kernel in (None, flash.triton_flash_attention):
        if kernel is not None:  # what kernels.flash_attention does with CUDA tensors
            monkeypatch.setattr(gpt_module, "flash_attention", partial(kernel, enable_gqa=True))
        model.zero_grad(set_to_none=True)
        loss = model.loss(idx, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (sdpa_loss, sdpa_grads), (triton_loss, triton_grads) = results
    assert abs(float(triton_loss - sdpa_loss)) < 1e-5
    for name, grad in sdpa_grads.items():
        assert rel_error(triton_grads[name], grad) < 1e-3, name


# ---- inference: the paged paths -----------------------------------------------------------

BACKENDS = [CpuPagedBackend(), SdpaGatherBackend()] + (
    [TritonBackend()] if triton_available() else []
)


@BY_GROUP_AND_DIM
@pytest.mark.parametrize("split_size", [None, 16], ids=["one-split", "split16"])
def test_triton_paged_attention(group, head_dim, split_size):
    paged = _triton("paged")
    args = paged_batch(**MIXED, page_size=8, n_head=N_KV * group, head_dim=head_dim,
                       dtype=torch.float32, device="cpu", head_major=True, n_kv_head=N_KV)  # fmt: skip
    out = paged.triton_paged_attention(*args, split_size=split_size, block_n=16)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    assert rel_error(out, paged_attention_reference(*args)) < TOLERANCE[torch.float32]


@BY_GROUP_AND_DIM
@pytest.mark.parametrize("spare", [3, 200], ids=["one-run", "scattered"])
def test_cpu_decode_in_place(group, head_dim, spare, dtype):
    ctx = [1, 70, 9, 40, 16, 17]
    args = paged_batch(ctx, [1] * len(ctx), 16, n_head=N_KV * group, head_dim=head_dim,
                       dtype=dtype, device="cpu", spare=spare, head_major=True,
                       n_kv_head=N_KV)  # fmt: skip
    plan = plan_decode(args[3], 16, N_KV)
    assert (plan.run is None) == (spare == 200)
    out = decode_attention_cpu(*args, plan=plan)
    assert out.shape == args[0].shape and out.dtype == dtype and torch.isfinite(out).all()
    assert rel_error(out, paged_attention_reference(*args)) < TOLERANCE[dtype]


def _shared_blocks(tables, ctx, q_lens, n_pool, n_head, head_dim, block_size=4, seed=1):
    """Head-major pools of N_KV heads, random, NaN past each sequence's end in its last block
    (as a real pool may be), and the step's queries (n_head heads)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n_pool, N_KV, block_size, head_dim)
    k = torch.randn(shape, generator=gen).transpose(1, 2)
    v = torch.randn(shape, generator=gen).transpose(1, 2)
    for table, n in zip(tables, ctx):
        if n % block_size:
            k[table[-1], n % block_size :] = float("nan")
            v[table[-1], n % block_size :] = float("nan")
    meta = AttentionMetadata.build(tables, ctx, q_lens, block_size=block_size)
    return torch.randn(meta.num_tokens, n_head, head_dim, generator=gen), k, v, meta


@BY_GROUP_AND_DIM
def test_cpu_decode_of_sequences_sharing_blocks(group, head_dim):
    # blocks held by 4, 3 and 2 sequences, one sequence holding nothing shared, a hole (block 6):
    # the further holders' queries of each KV head are one product's rows, G of them per holder
    tables = [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5], [0, 7], [8, 9]]
    ctx = [14, 13, 9, 5, 6]
    q, k, v, meta = _shared_blocks(tables, ctx, [1] * 5, 10, N_KV * group, head_dim)
    plan = plan_decode(meta, 4, N_KV)
    assert plan.shared is not None and plan.shared.width == 3
    out = decode_attention_cpu(q, k, v, meta, plan=plan)
    assert torch.isfinite(out).all()
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < 1e-4


# two groups continuing cached prefixes, and a sequence that shares nothing (gather + SDPA)
CASCADE = ([[0, 1, 2], [0, 1, 3], [4, 5, 6, 7], [4, 5, 8], [9, 10]], [12, 11, 14, 10, 7],
           [3, 2, 6, 1, 7], 12)  # fmt: skip


@BY_GROUP_AND_DIM
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "matmul"])
def test_cpu_cascade_prefill(group, head_dim, onednn, monkeypatch):
    if not onednn:
        monkeypatch.setattr(cascade, "onednn_products", lambda: False)
    q, k, v, meta = _shared_blocks(*CASCADE, n_head=N_KV * group, head_dim=head_dim)
    plan = plan_cascade(meta, 4)
    assert len(plan.groups) == 2 and plan.seqs[-1].group is None
    out = prefill_attention_cpu(q, k, v, meta, plan=plan)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_error(out, paged_attention_reference(q, k, v, meta)) < 1e-4


@pytest.mark.parametrize("group", GROUPS)
def test_cpu_cascade_scores_long_query_runs_in_slices(group, monkeypatch):
    monkeypatch.setattr(cascade, "SCORE_BYTES", 256)  # a few rows at a time
    q, k, v, meta = _shared_blocks(*CASCADE, n_head=N_KV * group, head_dim=8)
    ref = paged_attention_reference(q, k, v, meta)
    for onednn in (True, False):
        monkeypatch.setattr(cascade, "onednn_products", lambda on=onednn: on)
        assert rel_error(prefill_attention_cpu(q, k, v, meta), ref) < 1e-4


@BY_GROUP_AND_DIM
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_gather_and_sdpa(group, head_dim, head_major, dtype):
    args = paged_batch(**MIXED, page_size=8, n_head=N_KV * group, head_dim=head_dim,
                       dtype=dtype, device="cpu", head_major=head_major, n_kv_head=N_KV)  # fmt: skip
    out = paged_attention_sdpa(*args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    assert rel_error(out, paged_attention_reference(*args)) < TOLERANCE[dtype]


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_backends_write_kv_heads_and_attend(group, backend):
    """A step through a backend, as the KV cache runs it: pools of N_KV heads, new keys and
    values of N_KV heads written at the step's slots, queries of N_KV * group heads."""
    n_head, head_dim, bs = N_KV * group, 16, 4
    tables, ctx, q_lens = [[1, 2], [3, 4, 5], [6, 7]], [5, 12, 8], [1, 1, 6]
    meta = AttentionMetadata.build(tables, ctx, q_lens, bs)
    spec = KVSpec(1, 8, bs, N_KV, head_dim, torch.float32, torch.device("cpu"), group)
    k_pool, v_pool = (p[0] for p in backend.allocate(spec))
    gen = torch.Generator().manual_seed(5)
    k_pool.copy_(torch.randn(k_pool.shape, generator=gen))
    v_pool.copy_(torch.randn(v_pool.shape, generator=gen))
    q = torch.randn(meta.num_tokens, n_head, head_dim, generator=gen)
    k_new, v_new = (torch.randn(meta.num_tokens, N_KV, head_dim, generator=gen) for _ in "kv")
    plan = backend.plan(meta, spec)
    out = backend.forward(q, k_new, v_new, k_pool, v_pool, plan)
    assert torch.equal(k_pool[plan.write.block, plan.write.offset], k_new)
    assert torch.equal(v_pool[plan.write.block, plan.write.offset], v_new)
    assert rel_error(out, paged_attention_reference(q, k_pool, v_pool, meta)) < 1e-4
