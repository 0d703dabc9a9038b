"""The training loss over the output head without the whole batch's logits: `head_loss`.

The head's logits of a batch are (B x T, vocab) floats: 2048 x 50257 of them are 411 MB, and
the plain `F.cross_entropy(lm_head(h))` keeps them, their log-softmax and both gradients. Here
the rows are taken `chunk_rows` at a time. For a plain `nn.Linear` head (every trained model's)
`_FusedHeadLoss` computes each chunk's loss and, in the same pass, its gradients with respect to
the hidden states and the head's weight (softmax - one-hot, through the head), then drops the
chunk's logits: backward only scales what forward summed, so the head's three products are done
once each, as before, and at most one chunk's logits are alive. Any other head (a quantized one,
one with a bias) is looped over in chunks too, each chunk recomputed in backward
(`torch.utils.checkpoint`) rather than kept.

The result equals `F.cross_entropy(model._logits(h).float(), targets, ignore_index=...)` (the
mean over the targets not ignored) within float32 rounding, with the same gradients; under
autocast the head's products run in autocast's dtype as `nn.Linear` would, the softmax in
float32, as the plain computation does (tests/model/test_chunked_loss.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from gptserve.model import dense_matmul
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 25  # logits per chunk: 667 rows of GPT-2's 50257 (128 MB in float32)


def chunk_rows_for(vocab_size: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk that keep one chunk's logits at about `elements` numbers."""
    return max(1, elements // max(1, vocab_size))


def head_loss(
    model: nn.Module,
    normed: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -1,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `model`'s head over final hidden states after the final norm
    (`normed`, (..., C)) against `targets` (...,); targets equal to ignore_index count for
    nothing (all ignored: NaN, as F.cross_entropy). `model` is a GPT (its `lm_head`, its
    `config.logit_softcap` and `_logits`)."""
    h = normed.reshape(-1, normed.size(-1))
    t = targets.reshape(-1)
    rows = chunk_rows or chunk_rows_for(model.config.vocab_size)
    rows = -(-h.size(0) // -(-h.size(0) // rows)) if h.size(0) else rows  # even chunks, <= rows
    head = model.lm_head
    cap = model.config.logit_softcap
    if type(head) is nn.Linear and head.bias is None:
        if torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad):
            return _FusedHeadLoss.apply(h, head.weight, t, ignore_index, cap, rows)
        total, _, _ = _fused(h, head.weight, t, ignore_index, cap, rows, False, False)
        return total / (t != ignore_index).sum()
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.size(0), rows):
        args = (model, h[start : start + rows], t[start : start + rows], ignore_index)
        if torch.is_grad_enabled():  # recomputed in backward rather than kept
            total = total + checkpoint(_chunk_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_sum(*args)
    return total / (t != ignore_index).sum()


def _chunk_sum(model: nn.Module, h: torch.Tensor, t: torch.Tensor, ignore: int) -> torch.Tensor:
    logits = model._logits(h).float()
    return F.cross_entropy(logits, t, ignore_index=ignore, reduction="sum")


def _fused(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    rows: int,
    want_h: bool,
    want_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss over the rows not ignored, and (where wanted) its float32 gradients with
    respect to h and weight, chunk by chunk through one (rows, V) float32 buffer."""
    device = h.device.type
    # the products' dtype: autocast's where it is on (as nn.Linear would run), else the inputs';
    # every product below runs with autocast off, on explicitly cast operands
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(h.dtype, weight.dtype)
    f32 = torch.float32
    if dtype == f32 and device == "cpu" and dense_matmul.available():
        return _fused_onednn(h, weight, targets, ignore_index, softcap, rows, want_h, want_w)
    with torch.autocast(device, enabled=False):
        w = weight.to(dtype)  # (V, C)
        grad_h = torch.empty(h.shape, dtype=f32, device=h.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=f32, device=h.device) if want_w else None
        total = torch.zeros((), dtype=f32, device=h.device)
        buf = torch.empty(min(rows, h.size(0)), w.size(0), dtype=f32, device=h.device)
        for start in range(0, h.size(0), rows):
            hc = h[start : start + rows].to(dtype)  # (n, C)
            tc = targets[start : start + rows]
            keep = (tc != ignore_index).unsqueeze(1)  # (n, 1)
            safe = torch.where(keep, tc.unsqueeze(1), 0)  # (n, 1)
            g = buf[: hc.size(0)]  # (n, V): the logits in float32, then their gradient
            capped = None
            if dtype == f32 and softcap is None:
                torch.mm(hc, w.t(), out=g)
            else:
                z = hc @ w.t()
                if softcap is not None:
                    capped = torch.tanh(z / softcap)
                    z = capped * softcap
                g.copy_(z)
                del z
            picked = g.gather(1, safe)  # (n, 1)
            top = g.amax(dim=1, keepdim=True)
            g.sub_(top).exp_()
            norm = g.sum(dim=1, keepdim=True)
            total += ((top + norm.log() - picked) * keep).sum()  # logsumexp - picked
            if not (want_h or want_w):
                continue
            g.div_(norm)  # softmax
            g.scatter_add_(1, safe, torch.full_like(picked, -1.0))  # - one-hot
            g.mul_(keep)  # ignored rows give nothing
            if capped is not None:  # d softcap * tanh(z / softcap) / dz = 1 - tanh^2
                g.mul_(1.0 - capped.float().square())
            gd = g if dtype == f32 else g.to(dtype)
            if grad_h is not None and dtype == f32:
                torch.mm(gd, w, out=grad_h[start : start + rows])
            elif grad_h is not None:
                grad_h[start : start + rows] = gd @ w
            if grad_w is not None:
                if dtype == f32:
                    grad_w.addmm_(gd.t(), hc)
                else:
                    grad_w += (gd.t() @ hc).float()
            del gd
    return total, grad_h, grad_w


def _fused_onednn(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    rows: int,
    want_h: bool,
    want_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_fused` in float32 on a CPU, its three products on oneDNN's kernels (about twice MKL's
    speed on AMD's AVX-512 processors, model.dense_matmul); the weight's gradient summed
    transposed, (C, V), so that each chunk's product reads its operands in place."""
    mm = dense_matmul.matmul
    with torch.autocast("cpu", enabled=False):
        w = weight.float()  # (V, C)
        grad_h = torch.empty(h.shape, dtype=torch.float32) if want_h else None
        grad_wt = None  # (C, V)
        total = torch.zeros((), dtype=torch.float32)
        for start in range(0, h.size(0), rows):
            hc = h[start : start + rows].float()  # (n, C)
            tc = targets[start : start + rows]
            keep = (tc != ignore_index).unsqueeze(1)  # (n, 1)
            safe = torch.where(keep, tc.unsqueeze(1), 0)  # (n, 1)
            g = mm(hc, w.t())  # (n, V): the logits, then their gradient
            capped = None
            if softcap is not None:
                capped = torch.tanh(g / softcap)
                g = capped * softcap
            picked = g.gather(1, safe)  # (n, 1)
            top = g.amax(dim=1, keepdim=True)
            g.sub_(top).exp_()
            norm = g.sum(dim=1, keepdim=True)
            total += ((top + norm.log() - picked) * keep).sum()  # logsumexp - picked
            if not (want_h or want_w):
                continue
            g.div_(norm)  # softmax
            g.scatter_add_(1, safe, torch.full_like(picked, -1.0))  # - one-hot
            g.mul_(keep)  # ignored rows give nothing
            if capped is not None:  # d softcap * tanh(z / softcap) / dz = 1 - tanh^2
                g.mul_(1.0 - capped.square())
            if grad_h is not None:
                grad_h[start : start + rows] = mm(g, w)  # (n, C)
            if want_w:
                part = mm(hc.t(), g)  # (C, V)
                grad_wt = part if grad_wt is None else grad_wt.add_(part)
            del g
        grad_w = None
        if want_w:
            grad_w = grad_wt.t().contiguous() if grad_wt is not None else torch.zeros_like(w)
    return total, grad_h, grad_w


class _FusedHeadLoss(torch.autograd.Function):
    """loss = mean over kept rows of cross_entropy(softcap(h @ W.T)); forward also computes
    d(sum of losses)/dh and /dW chunk by chunk, backward scales them by grad / count."""

    @staticmethod
    def forward(
        ctx,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        rows: int,
    ) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total, grad_h, grad_w = _fused(
            h, weight, targets, ignore_index, softcap, rows, want_h, want_w
        )
        count = (targets != ignore_index).sum()
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.input_dtypes = (h.dtype, weight.dtype)
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad.float() / count
        h_dtype, w_dtype = ctx.input_dtypes
        # in place: backward runs once (the weight's gradient is as large as the weight)
        dh = grad_h.mul_(scale).to(h_dtype) if grad_h is not None else None
        dw = grad_w.mul_(scale).to(w_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None
