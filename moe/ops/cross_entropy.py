"""LM head + cross-entropy in chunks of rows, gradients computed on the way (never all logits at once).

    loss = linear_cross_entropy(h [N, H], weight [V, H], targets [N])   = mean_n CE(h[n] @ weight.T, targets[n])

Forward, per chunk of C rows: logits = h_c @ weight.T in h's dtype ([C, V]); the row kernel takes the
log-sum-exp in fp32 (one online pass), writes the row's loss, and overwrites the logits with their
gradient (softmax - onehot) / N in a second pass; then dh_c = grad @ weight and dW += grad.T @ h_c
(fp32 sum over chunks). The backward only scales dh and dW by the incoming gradient. Memory: one
[C, V] chunk of logits instead of [N, V] logits plus their fp32 copy, softmax and gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Kernel, check_2d, use_triton

BLOCK_V = 4096
CHUNK_ROWS = 8192


def _ce_rows_kernel(logits_ptr, target_ptr, loss_ptr, V, scale, BLOCK_V: tl.constexpr):
    """One row per program: loss[row] = lse - logits[target]; logits[row] <- (softmax - onehot) * scale."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    target = tl.load(target_ptr + row).to(tl.int64)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_target = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, lse - x_target)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < V)


_CE_ROWS = Kernel(_ce_rows_kernel)


def ce_rows_(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """logits [C, V] (overwritten with their gradient times scale), targets [C] -> per-row losses [C] fp32."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if use_triton(logits) and logits.is_contiguous():
        if logits.shape[0]:
            _CE_ROWS[(logits.shape[0],)](logits, targets, loss, logits.shape[1], scale, BLOCK_V=min(
                BLOCK_V, triton.next_power_of_2(logits.shape[1])))
        return loss
    return ce_rows_ref_(logits, targets, scale)


def ce_rows_ref_(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    logits_f = logits.float()
    lse = torch.logsumexp(logits_f, dim=-1)
    loss = lse - logits_f.gather(1, targets[:, None]).squeeze(1)
    grad = torch.exp(logits_f - lse[:, None])
    grad.scatter_add_(1, targets[:, None], grad.new_full((targets.shape[0], 1), -1.0))
    logits.copy_(grad * scale)
    return loss


class LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows):
        n = h.shape[0]
        dh = torch.empty_like(h)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk_rows):
            h_c = h[start:start + chunk_rows]
            logits = h_c @ weight.t()  # [C, V] -> its gradient, in place
            total += ce_rows_(logits, targets[start:start + chunk_rows], 1.0 / n).sum()
            dh[start:start + chunk_rows] = logits @ weight
            dw += logits.t() @ h_c
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total / max(n, 1)

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return dh * grad.to(dh.dtype), (dw * grad).to(ctx.weight_dtype), None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """h [N, H], weight [V, H], targets [N] int64 in [0, V) -> mean cross-entropy (fp32 scalar)."""
    check_2d("linear_cross_entropy: h", h)
    check_2d("linear_cross_entropy: weight", weight, h.shape[1])
    if targets.shape != (h.shape[0],):
        raise ValueError(f"linear_cross_entropy: targets must be [{h.shape[0]}], got {tuple(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows}; expected >= 1")
    if h.dtype != weight.dtype:
        h = h.to(weight.dtype)
    return LinearCrossEntropyFn.apply(h, weight, targets, chunk_rows)
