"""GPTQ rounding (Frantar et al. 2022): quantize a weight's columns in order, and move each column's
rounding error onto the columns not yet quantized, weighted by the layer's input statistics.

Round to nearest minimizes the error of each weight on its own; what matters is the layer's output
error ||X W^T - X Wq^T||, whose quadratic form is the Hessian H = 2 X^T X of the calibration inputs X.
With the upper Cholesky factor U of H^-1, quantizing column j and updating the later columns by
-err_j / U[j, j] * U[j, j:] is the optimal correction for that column (the OBS update). Updates within a
block of columns are done at once; the later columns get the block's errors in one matmul ("lazy batch").

The result uses the same conventions as round to nearest (QuantizedTensor.quantize): int8 keeps one scale
per row, from the original weights; int4 computes each group's scale (and zero point) when quantization
reaches the group's first column, from the weights as the earlier columns' errors have updated them.
"""

import torch

from kvyard.quant.qtensor import QuantizedTensor, _quantize_groups, zero_point_as_stored
from kvyard.quant.scheme import WeightScheme

BLOCK = 128  # columns per lazy update; a multiple of every int4 group size (32, 64, 128)
DAMP = 0.01  # damping added to H's diagonal, as a share of its mean diagonal


def inverse_hessian_factor(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, so that H^-1 = U^T U."""
    h = h.float().clone()
    diag = h.diagonal()
    diag[diag == 0] = 1.0  # an input that is always zero: its column is just rounded, nothing moves
    k = h.shape[0]
    eye = torch.eye(k, dtype=h.dtype)
    bump = damp * float(diag.mean())
    for _ in range(6):  # rank-deficient H (fewer tokens than inputs): damp harder until it factors
        lower, info = torch.linalg.cholesky_ex(h + bump * eye)
        if int(info) == 0:
            break
        bump *= 10
    else:
        raise ValueError("Hessian is not positive definite even with heavy damping")
    hinv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(hinv, upper=True)


def _round(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, scheme: WeightScheme) -> torch.Tensor:
    """One column [n] -> its integer values [n] (as float), with the column's scale and zero point."""
    if scheme.float_zero:  # a float zero point: round after the offset, as QuantizedTensor.quantize does
        return torch.round(w / scale + zp).clamp(scheme.qmin, scheme.qmax)
    q = torch.round(w / scale)
    if zp is not None:
        q = q + zp
    return q.clamp(scheme.qmin, scheme.qmax)


def _dequant(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None) -> torch.Tensor:
    return (q if zp is None else q - zp) * scale


def _group_params(w: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale [n] and zero point [n] (or None) of one group's columns w [n, g], as round to nearest sets them."""
    _, scale, zp = _quantize_groups(w.unsqueeze(1), scheme)
    return scale[:, 0], None if zp is None else zp[:, 0]


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, scheme: WeightScheme,
                  damp: float = DAMP) -> QuantizedTensor:
    """Quantize w [N, K] with GPTQ, given the Hessian [K, K] (any positive multiple of X^T X)."""
    n, k = w.shape
    group = scheme.group_size or k
    if scheme.group_size is not None and BLOCK % group:
        raise ValueError(f"group size {group} must divide the GPTQ block size {BLOCK}")
    u = inverse_hessian_factor(hessian, damp)
    w = w.float().clone()
    groups = -(-k // group)
    q = torch.zeros(n, k)
    scales = torch.ones(n, groups)
    zps = torch.zeros(n, groups) if not scheme.symmetric else None
    scale, zp = _group_params(w, scheme) if scheme.group_size is None else (scales[:, 0], None)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        wb, ub = w[:, b0:b1].clone(), u[b0:b1, b0:b1]
        errs = torch.zeros_like(wb)
        for i in range(b1 - b0):
            col = b0 + i
            if scheme.group_size is not None and col % group == 0:
                # The group lies inside this block (group divides BLOCK): its columns are up to date.
                scale, zp = _group_params(wb[:, i:i + group], scheme)
                scales[:, col // group] = scale
                if zps is not None:
                    zps[:, col // group] = zp  # type: ignore[assignment]
            qc = _round(wb[:, i], scale, zp, scheme)
            q[:, col] = qc
            err = (wb[:, i] - _dequant(qc, scale, zp)) / ub[i, i]
            wb[:, i:] -= err.unsqueeze(1) * ub[i, i:].unsqueeze(0)
            errs[:, i] = err
        w[:, b1:] -= errs @ u[b0:b1, b1:]
    if scheme.group_size is None:
        scales[:, 0] = scale
    return QuantizedTensor(scheme, q.to(torch.int8).contiguous(), scales,
                           None if zps is None else zero_point_as_stored(zps, scheme))
