"""Prefill attention on the CPU where several sequences continue one cached prefix (cascade).

When sequences of a step continue the same cached blocks (a shared system prompt, earlier turns
of conversations that began alike), their new tokens all attend to those blocks. Gathering the
blocks per sequence and running one attention per sequence reads them once per holder, with
short, inefficient products (19-58 queries against 1.1k keys). Here the blocks that a group of
sequences shares ahead of all their new tokens are read once, and every member's queries are
scored against them in one matrix product per head; each sequence's own keys (the rest of its
context, causally masked) are scored separately, and the two parts are merged by their rows'
log-sum-exps, as a split softmax is (FlashInfer's "cascade" attention does this on GPUs).

A group is made of sequences whose tables start with the same block; its shared prefix is their
common leading blocks, cut to the full blocks every member has cached before its first new
token, so no causal mask or stale slot is ever needed there (a sequence that agrees with the
others for only a few blocks is left out of the group rather than cutting it short). Sequences
in no group attend to their whole context in one SDPA call. A step's `CascadePlan` with no group
(`plan_cascade`) plans nothing more: the backend then keeps the batched gather + SDPA path
(`kernels.sdpa_paged`).

The pools may hold fewer key/value heads than the queries have heads (grouped-query attention,
`kernels.gqa`): the G query heads that read one KV head are folded into the rows of its products,
(G * L, D) x (D, Lk), so keys are gathered and read once per KV head. With G = 1 the fold is a
view and the products are those of plain multi-head attention.

Pools are head-major, as the CPU backend lays them out (`kernels.cpu.decode.is_head_major`). The
arithmetic is float32 whatever the pools hold. Slots past a sequence's end in its last block may
hold anything (even NaN): their scores are masked and the gathered copies of their keys and
values are zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gptserve.kernels.cpu.products import onednn_products, product_nt
from gptserve.kernels.gqa import kv_group
from gptserve.kernels.metadata import AttentionMetadata

SCORE_BYTES = 16 << 20  # float32 scores held at once: longer query runs are taken in slices


@dataclass
class _Group:
    """Sequences whose new tokens all follow the same cached blocks."""

    blocks: torch.Tensor  # (P,) the shared pool blocks, in table order
    rows: torch.Tensor  # (Ng,) packed query rows of every member, member after member


@dataclass
class _Seq:
    """One sequence's own part: its queries against its keys past the group's shared blocks."""

    start: int  # packed query rows [start, stop)
    stop: int
    blocks: torch.Tensor  # (nb,) its pool blocks from the first one not shared with its group
    n_keys: int  # its own keys: context length less the shared ones
    masked: torch.Tensor  # (L, nb * bs) True where a query may not see a slot
    group: int | None  # its group's index; None: all of its context is its own
    group_rows: slice  # its rows within the group's rows


@dataclass
class CascadePlan:
    """A prefill step's groups and each sequence's own part; no group: nothing to share."""

    groups: list[_Group]
    seqs: list[_Seq]


def _common_blocks(tables: list[list[int]]) -> int:
    """How many leading blocks all `tables` have in common."""
    n = 0
    for column in zip(*tables):
        if any(b != column[0] for b in column):
            break
        n += 1
    return n


def _choose_members(
    bucket: list[int], tables: list[list[int]], cached: list[int]
) -> tuple[list[int], int]:
    """Of sequences whose tables start alike, the members of their group and how many blocks they
    share: the depth that saves the most block reads ((members - 1) x depth), each sequence's
    depth being its blocks in common with the one with the most cached, at most its own cached
    ones. A sequence that agrees with the others only briefly is left out rather than cutting
    the shared part short for all."""
    ref = tables[max(bucket, key=lambda i: cached[i])]
    depth = {i: min(cached[i], _common_blocks([ref, tables[i]])) for i in bucket}
    best = max(
        set(depth.values()), key=lambda d: ((sum(v >= d for v in depth.values()) - 1) * d, d)
    )
    return [i for i in bucket if depth[i] >= best], best


def plan_cascade(meta: AttentionMetadata, bs: int) -> CascadePlan:
    """The groups of sequences that continue the same cached blocks of `bs` slots, and each
    sequence's own keys; when no two sequences share a prefix, only the (empty) groups."""
    device = meta.block_tables.device
    tables = meta.block_tables.tolist()
    starts = meta.query_start.tolist()
    # full blocks each sequence has cached ahead of its first new token: the most it may share
    cached = [(n - q) // bs for n, q in zip(meta.seq_lens, meta.query_lens)]
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if cached[i] > 0:
            by_first.setdefault(table[0], []).append(i)
    groups: list[_Group] = []
    member: dict[int, tuple[int, int]] = {}  # sequence -> (group, shared blocks)
    for bucket in by_first.values():
        if len(bucket) < 2:
            continue
        seqs, shared = _choose_members(bucket, tables, cached)
        if len(seqs) < 2:
            continue
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
        groups.append(
            _Group(torch.tensor(tables[seqs[0]][:shared], device=device), rows.to(device))
        )
        for i in seqs:
            member[i] = (len(groups) - 1, shared)
    if not groups:  # the step goes to gather + SDPA: nothing more to plan
        return CascadePlan([], [])
    offsets: dict[int, int] = {}  # each group's rows filled so far
    parts = []
    for i, (n, q) in enumerate(zip(meta.seq_lens, meta.query_lens)):
        group, shared = member.get(i, (None, 0))
        first_key = shared * bs
        own = tables[i][shared : -(-n // bs)]
        slot = first_key + torch.arange(len(own) * bs, device=device)  # (nb * bs,) positions
        qpos = n - q + torch.arange(q, device=device)  # (L,)
        at = offsets.get(group, 0)
        if group is not None:
            offsets[group] = at + q
        parts.append(
            _Seq(
                start=starts[i],
                stop=starts[i + 1],
                blocks=torch.tensor(own, device=device),
                n_keys=n - first_key,
                masked=slot[None, :] > qpos[:, None],  # also every slot past the context
                group=group,
                group_rows=slice(at, at + q),
            )
        )
    return CascadePlan(groups, parts)


def _gather(tiles: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(NB, H_kv, bs, D) head-major tiles -> (H_kv, len(blocks) * bs, D) float32, in table
    order."""
    picked = tiles.index_select(0, blocks)  # (nb, H, bs, D)
    return picked.transpose(0, 1).reshape(tiles.shape[1], -1, tiles.shape[3]).float()


def _softmax_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax of (..., Lk) scores and each row's log-sum-exp (..., 1). PyTorch's fused
    softmax beats a separate exp here; a row's sum of exponentials (after subtracting its
    maximum) is the inverse of its largest probability."""
    top = scores.amax(-1, keepdim=True)
    probs = torch.softmax(scores, -1)
    return probs, top - probs.amax(-1, keepdim=True).log_()


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled queries (H_kv, G, L, D), G query heads per KV head, against keys and values
    (H_kv, Lk, D): the attention output over these keys alone (H_kv, G, L, D) and each row's
    log-sum-exp of scores (H_kv, G, L, 1). `masked` (L, Lk) is the same for every head."""
    n_kv, group, n_q, head_dim = q.shape
    n_keys = k.shape[1]
    step = max(1, SCORE_BYTES // (4 * n_kv * group * n_keys))
    outs, lses = [], []
    for i in range(0, n_q, step):
        rows = q[:, :, i : i + step]  # (H_kv, G, l, D): one product's rows per KV head
        scores = torch.matmul(rows.reshape(n_kv, -1, head_dim), k.transpose(1, 2))
        scores = scores.view(rows.shape[:3] + (n_keys,))  # (H_kv, G, l, Lk)
        if masked is not None:
            scores.masked_fill_(masked[i : i + step], float("-inf"))
        probs, lse = _softmax_lse(scores)
        out = torch.matmul(probs.view(n_kv, -1, n_keys), v)  # (H_kv, G * l, D)
        outs.append(out.view(rows.shape))
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _partial_unmasked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_partial` without a mask, a KV head at a time, through oneDNN's products where it runs
    (about twice MKL's rate on the development box for these shapes). The G query heads of a
    KV head are rows of its products: its G * L rows of `q` are contiguous, so no copy."""
    if not onednn_products():
        return _partial(q, k, v, None)
    n_kv, group, n_q, head_dim = q.shape
    q = q.reshape(n_kv, group * n_q, head_dim)  # (H_kv, G * L, D)
    out, lse = q.new_empty(q.shape), q.new_empty(n_kv, group * n_q, 1)
    step = max(1, SCORE_BYTES // (4 * k.shape[1]))
    for h in range(n_kv):
        for i in range(0, group * n_q, step):
            rows = slice(i, i + step)
            probs, lse[h, rows] = _softmax_lse(product_nt(q[h, rows], k[h]))  # (l, Lk)
            out[h, rows] = product_nt(probs, v[h].t())
    return out.view(n_kv, group, n_q, head_dim), lse.view(n_kv, group, n_q, 1)


def prefill_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    sm_scale: float | None = None, plan: CascadePlan | None = None,
) -> torch.Tensor:  # fmt: skip
    """(N, H, D) new tokens against head-major paged K/V of H_kv heads (H a multiple); see
    `paged_attention_reference`.

    `plan` is the step's `plan_cascade(meta, ...)`, which every layer shares; without it, one is
    built for this call.
    """
    k_tiles, v_tiles = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (NB, H_kv, bs, D)
    n_kv, bs, head_dim = k_tiles.shape[1:]
    n_head = q.shape[1]
    group = kv_group(n_head, n_kv)
    scale = sm_scale if sm_scale is not None else head_dim**-0.5
    if plan is None:
        plan = plan_cascade(meta, bs)
    qh = (q.float() * scale).transpose(0, 1)  # (H, N, D)
    q_grouped = qh.view(n_kv, group, -1, head_dim)  # (H_kv, G, N, D): head h = (h // G, h % G)
    shared = []  # per group: the output over the shared keys alone, and its log-sum-exp
    for members in plan.groups:
        shared.append(
            _partial_unmasked(
                q_grouped.index_select(2, members.rows),
                _gather(k_tiles, members.blocks),
                _gather(v_tiles, members.blocks),
            )
        )
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for seq in plan.seqs:
        keys, values = _gather(k_tiles, seq.blocks), _gather(v_tiles, seq.blocks)
        keys[:, seq.n_keys :] = 0  # past the context: masked scores and 0 weights must
        values[:, seq.n_keys :] = 0  # not meet garbage (NaN + -inf and 0 * NaN are NaN)
        if seq.group is None:
            part = F.scaled_dot_product_attention(
                qh[None, :, seq.start : seq.stop],
                keys[None],
                values[None],
                attn_mask=~seq.masked[None, None],
                scale=1.0,
                enable_gqa=group > 1,
            )[0]  # (H, L, D)
        else:
            o1, lse1 = (t[:, :, seq.group_rows] for t in shared[seq.group])
            o2, lse2 = _partial(q_grouped[:, :, seq.start : seq.stop], keys, values, seq.masked)
            w1 = torch.sigmoid(lse1 - lse2)  # the shared keys' share of each row's softmax
            part = torch.lerp(o2, o1, w1).view(n_head, -1, head_dim)  # (H, L, D)
        out[seq.start : seq.stop] = part.transpose(0, 1)
    return out.to(q.dtype)
