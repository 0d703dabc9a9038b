"""Attention backends: chosen once per KV cache, each with its pool layout and a plan per step."""

from __future__ import annotations

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.kernels.backends import (
    CpuPagedBackend,
    CpuPagedPlan,
    SdpaGatherBackend,
    TritonBackend,
    select_attention_backend,
)
from gptserve.kernels.cpu.cascade import CascadePlan
from gptserve.kernels.cpu.native import paged_decode_op
from gptserve.kernels.metadata import KVWrite
from gptserve.kernels.paged_kv import KVPools
from gptserve.kernels.triton import available as triton_available
from gptserve.model import GPT, ModelConfig, get_tokenizer

from tests.conftest import PagedCache
from tests.kernels.kernel_testing import DEVICE


def _model(n_layer: int = 3) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, block_size=96, n_layer=n_layer, n_head=2, n_embd=32)
    return GPT(cfg).eval()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_gets_the_cpu_paths_whatever_the_dtype(pool_dtype):
    assert isinstance(select_attention_backend("cpu", pool_dtype), CpuPagedBackend)


def test_other_devices_get_triton_where_it_runs_and_sdpa_elsewhere():
    # choosing allocates nothing, so no GPU is needed to ask for one
    cuda = select_attention_backend(torch.device("cuda"), torch.float16)
    assert isinstance(cuda, TritonBackend if triton_available() else SdpaGatherBackend)
    assert isinstance(select_attention_backend("cuda", torch.float64), SdpaGatherBackend)
    assert isinstance(select_attention_backend("meta", torch.float32), SdpaGatherBackend)


def test_the_engine_chooses_once_and_its_cache_keeps_the_choice():
    model = _model()
    engine = Engine(model, get_tokenizer(), EngineConfig(kv_block_size=8, num_blocks=32))
    backend = engine.pools.backend
    assert isinstance(backend, CpuPagedBackend) and backend.cascade
    k = engine.pools.k  # (layers, blocks, block_size, heads, head_dim), head-major in memory
    assert k.shape == (3, 32, 8, 2, 16) and k.transpose(2, 3).is_contiguous()
    assert not k.is_contiguous()


def test_a_backend_given_to_the_cache_lays_out_its_pools():
    pools = KVPools.for_model(_model(), num_blocks=6, block_size=4, backend=SdpaGatherBackend())
    assert isinstance(pools.backend, SdpaGatherBackend)
    assert pools.k.shape == (3, 6, 4, 2, 16) and pools.k.is_contiguous()  # token-major


def _run_steps(model: GPT, cache: PagedCache) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Four steps through the cache: a 16-token prompt beside a 5-token one; then the first's
    prefix forked to two sequences that continue it (6 and 9 new tokens) beside a decode; then
    two decode steps. Returns each step's logits (every new token's in the first two steps, each
    sequence's last after) and every sequence's tokens."""
    gen = torch.Generator().manual_seed(1)
    seqs = {0: torch.randint(0, 97, (16,), generator=gen).tolist(), 3: []}
    out = []

    def step(batch: list[tuple[int, int]], every: bool) -> None:
        new = []
        for seq_id, n in batch:
            tokens = torch.randint(0, 97, (n,), generator=gen).tolist()
            seqs[seq_id] = seqs[seq_id][: cache.blocks.seq_len(seq_id)] + tokens
            new += tokens
        meta = cache.prepare(batch)
        device = cache.pools.device
        index = torch.arange(meta.num_tokens, device=device) if every else None
        out.append(model.forward_cached(torch.tensor(new, device=device), cache.pools, meta, index))

    with torch.no_grad():
        seqs[0] = []
        step([(0, 16), (3, 5)], every=True)
        for child in (1, 2):
            cache.blocks.fork(0, child)
            seqs[child] = list(seqs[0])
        step([(3, 1), (1, 6), (2, 9)], every=True)  # a decode, then two over one cached prefix
        for _ in range(2):
            step([(3, 1), (1, 1), (2, 1)], every=False)
    return out, [seqs[i] for i in (3, 1, 2)]


BACKENDS = {
    "cpu": CpuPagedBackend,
    "cpu-no-cascade": lambda: CpuPagedBackend(cascade=False),
    "sdpa": SdpaGatherBackend,
    "triton": TritonBackend,
}


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_gives_the_full_forward_logits(name):
    if name == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    # Triton and SDPA on the kernel tests' device: CUDA where they run compiled, else the CPU
    model = _model(n_layer=2).to(DEVICE if name in ("triton", "sdpa") else "cpu")
    cache = PagedCache(model, 24, 8, backend=BACKENDS[name]())
    cache.pools.k.fill_(float("nan"))  # unused slots hold garbage
    cache.pools.v.fill_(float("nan"))
    out, (decoding, first, second) = _run_steps(model, cache)
    with torch.no_grad():
        seqs = (decoding, first, second)
        full = {
            i: model(torch.tensor([s], device=cache.pools.device))[0] for i, s in enumerate(seqs)
        }
    # step 2's rows: the decode's token, then the new tokens of the two over the shared prefix
    torch.testing.assert_close(out[1][0], full[0][5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][1:7], full[1][16:22], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1][7:], full[2][16:25], atol=1e-4, rtol=1e-4)
    for k, logits in enumerate(out[2:]):  # the decode steps: each sequence's last token
        for row, i in enumerate((0, 1, 2)):
            torch.testing.assert_close(logits[row], full[i][-2 + k], atol=1e-4, rtol=1e-4)


def test_one_plan_per_step_read_by_every_layer(monkeypatch):
    model = _model(n_layer=3)
    cache = PagedCache(model, 24, 8)
    backend = cache.pools.backend
    plans: list[CpuPagedPlan] = []
    attended: list[CpuPagedPlan] = []
    plan, forward = backend.plan, backend.forward

    def planning(meta, spec):
        plans.append(plan(meta, spec))
        return plans[-1]

    def layer(q, k, v, k_pool, v_pool, step, sm_scale=None):
        attended.append(step)
        return forward(q, k, v, k_pool, v_pool, step, sm_scale)

    forward_qkv = backend.forward_qkv

    def layer_qkv(qkv, cos, sin, k_pool, v_pool, step, n_head, out_dtype=None):
        attended.append(step)  # a step of decodes in one call (where the compiled kernels run)
        return forward_qkv(qkv, cos, sin, k_pool, v_pool, step, n_head, out_dtype)

    monkeypatch.setattr(backend, "plan", planning)
    monkeypatch.setattr(backend, "forward", layer)
    monkeypatch.setattr(backend, "forward_qkv", layer_qkv)
    _run_steps(model, cache)
    assert len(plans) == 4  # one per step
    assert [id(p) for p in attended] == [id(p) for p in plans for _ in range(3)]  # every layer
    mixed = plans[1]  # the decode beside two prefills over one cached prefix: split in two
    assert mixed.decodes.num_seqs == 1 and mixed.rest.num_seqs == 2
    assert isinstance(mixed.rest_plan, CascadePlan) and len(mixed.rest_plan.groups) == 1
    assert all(p.rest is None for p in plans[2:])  # decode steps
    # the compiled kernel, where built, needs no plan of the decodes; the PyTorch path does
    native = paged_decode_op() is not None
    assert all((p.decode is None) == native for p in plans[1:])
    assert isinstance(mixed.write, KVWrite) and mixed.write.block.shape == (16,)
