"""The kernel distance (KID) between two feature sets, on a fixed random low-dimensional projection.

- ``kernel_distance(x, y)``: the unbiased estimate of MMD^2 with KID's cubic polynomial kernel
  ``k(a, b) = (a . b / d + 1) ** 3`` (Bińkowski et al. 2018). Unbiased: its expectation is the
  population MMD^2, which is 0 for one distribution, so draws of the same distribution give values
  scattered around 0, negative ones included.
- ``projection(width, dim, seed)``: a fixed orthonormal ``[width, dim]`` matrix, the same for the
  same (width, dim, seed) in every process (numpy's PCG64 normals, QR with the signs fixed).
- ``standardised_projection(reference, samples)``: both sets projected, then standardised with the
  reference set's per-coordinate mean and std (the kernel's ``a . b / d + 1`` assumes unit-order
  coordinates; the samples must not move the yardstick they are measured with).
- Row-paired sets (the teacher's and the student's sample i sharing prompt i and noise i): with
  equal sizes the estimator leaves the pairs (i, i) out of its cross term and stays unbiased, and
  the shared noise cancels much of the spread (common random numbers).
- ``projected_kid(reference, samples)``: the two together, the figure a run reports.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np
import torch

STD_FLOOR = 1e-6  # a reference coordinate with no spread is divided by this, not by 0


def kernel_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """Unbiased MMD^2 between ``x`` [n, d] and ``y`` [m, d] (n, m >= 2) with the kernel
    ``(a . b / d + 1) ** 3``: the mean kernel within x and within y, each without its diagonal,
    minus twice the mean across. Computed in float64; unitless (the features' squared scale).

    With n == m the cross mean also leaves out the pairs (x_i, y_i) (Gretton et al. 2012's
    U-statistic): it stays unbiased when row i of x and row i of y are dependent, as the teacher's
    and the student's sample i are when they share a prompt and ``teacher_features``' noise (the
    full cross mean is then biased low, below 0 for one distribution), and it is unbiased for
    independent sets too. With n != m the sets must be independent."""
    x = torch.as_tensor(x).detach().to("cpu", torch.float64)
    y = torch.as_tensor(y).detach().to("cpu", torch.float64)
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"kernel_distance needs [n, d] and [m, d] features, got {tuple(x.shape)} and {tuple(y.shape)}")
    n, m, d = x.shape[0], y.shape[0], x.shape[1]
    if n < 2 or m < 2:
        raise ValueError(f"kernel_distance needs at least 2 samples per set, got {n} and {m}")

    def k(a, b):
        return (a @ b.T / d + 1.0) ** 3

    kxx, kyy, kxy = k(x, x), k(y, y), k(x, y)
    within_x = (kxx.sum() - kxx.diagonal().sum()) / (n * (n - 1))
    within_y = (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1))
    across = (kxy.sum() - kxy.diagonal().sum()) / (n * (n - 1)) if n == m else kxy.mean()
    return float(within_x + within_y - 2.0 * across)


@lru_cache(maxsize=32)
def _projection(width: int, dim: int, seed: int) -> np.ndarray:
    gaussian = np.random.Generator(np.random.PCG64(seed)).standard_normal((width, dim))
    q, r = np.linalg.qr(gaussian)
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)  # QR's signs fixed: unique given the draws
    q.setflags(write=False)
    return q


def projection(width: int, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """A fixed orthonormal projection ``[width, min(dim, width)]`` (float32; orthonormal columns),
    a function of (width, dim, seed) alone: the same matrix in every process and on every rank."""
    width, dim = int(width), min(int(dim), int(width))
    if width < 1 or dim < 1:
        raise ValueError(f"projection needs a positive width and dim, got {width} and {dim}")
    return torch.from_numpy(_projection(width, dim, int(seed)).astype(np.float32))


def standardised_projection(reference: torch.Tensor, samples: torch.Tensor, *, dim: int = 64, seed: int = 0,
                            stats: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference`` [n, width] and ``samples`` [m, width] projected by ``projection(width, dim,
    seed)`` and standardised with the per-coordinate mean and std (ddof 1) of the reference (or of
    ``stats`` [k, width], k >= 2, a set of the reference's kind to take them from): float64
    [n, dim'] and [m, dim'], dim' = min(dim, width). The samples never move their own yardstick."""
    reference = torch.as_tensor(reference).detach().to("cpu", torch.float64)
    samples = torch.as_tensor(samples).detach().to("cpu", torch.float64)
    stats = reference if stats is None else torch.as_tensor(stats).detach().to("cpu", torch.float64)
    if reference.dim() != 2 or samples.dim() != 2 or stats.dim() != 2 or \
            not reference.shape[1] == samples.shape[1] == stats.shape[1]:
        raise ValueError(f"standardised_projection needs [n, width] and [m, width] features, got "
                         f"{tuple(reference.shape)} and {tuple(samples.shape)} (stats {tuple(stats.shape)})")
    if stats.shape[0] < 2:
        raise ValueError(f"standardised_projection needs at least 2 rows to standardise with, got {stats.shape[0]}")
    p = projection(reference.shape[1], dim, seed).double()
    basis = stats @ p
    mean, std = basis.mean(0), basis.std(0).clamp_min(STD_FLOOR)
    return (reference @ p - mean) / std, (samples @ p - mean) / std


def projected_kid(reference: torch.Tensor, samples: torch.Tensor, *, dim: int = 64, seed: int = 0,
                  stats: Optional[torch.Tensor] = None) -> float:
    """KID of ``samples`` [m, width] against ``reference`` [n, width] (e.g. the student's and the
    teacher's samples' teacher features, row i of each from prompt i and noise i: pass them row for
    row, n == m, see ``kernel_distance``), on ``standardised_projection``: ~0 (either sign) for one
    distribution, positive and growing as the samples move away from the reference.

    The estimator is unbiased for a fixed map; standardising with the reference's own statistics
    makes the map depend on the reference and adds a small positive offset (measured: ~0.017 at
    n = m = 32 for independent Gaussian sets in 64 coordinates, next to ~0.09 for a 1.3x scale
    change and ~0.34 for a 0.3 shift; less when the rows share noise), the same for every night
    with the same n. ``stats``: an independent set of the reference's kind (e.g. more teacher
    samples) to standardise with instead, which removes it."""
    ref, out = standardised_projection(reference, samples, dim=dim, seed=seed, stats=stats)
    return kernel_distance(ref, out)


# the fewest samples a side whose kernel distance has a standard error (the jackknife leaves one out)
SE_MIN_SAMPLES = 3


def kernel_distance_sample_se(x: torch.Tensor, y: torch.Tensor) -> float:
    """The standard error of ``kernel_distance(x, y)`` over draws of the samples ``y`` alone (the
    delete-one jackknife, in closed form from the kernel's row sums): what the figure would move by
    if the student's samples were drawn again against the same reference. The reference ``x`` is cached and shared by every
    eval and night a figure is compared with, so its own sampling error is common to both sides of
    any comparison and is left out: with n != m only the rows of ``y`` are left out in turn. With
    n == m the rows are pairs (sample i made from reference i's prompt and noise: see
    ``kernel_distance``) and pair i is left out whole. NaN below 3 samples."""
    x = torch.as_tensor(x).detach().to("cpu", torch.float64)
    y = torch.as_tensor(y).detach().to("cpu", torch.float64)
    n, m, d = x.shape[0], y.shape[0], x.shape[1]
    if min(n, m) < SE_MIN_SAMPLES:
        return float("nan")

    def k(a, b):
        return (a @ b.T / d + 1.0) ** 3

    kyy, kxy = k(y, y), k(x, y)  # only the samples' terms move when a sample is left out
    kyy_rows = kyy.sum(1) - kyy.diagonal()  # each y_j's kernel sum with the other y's
    within_y = kyy_rows.sum()
    if n == m:
        kxx = k(x, x)
        kxx_rows = kxx.sum(1) - kxx.diagonal()
        cross_rows = kxy.sum(1) + kxy.sum(0) - 2 * kxy.diagonal()  # pair i's terms of the off-diagonal cross sum
        cross = kxy.sum() - kxy.diagonal().sum()
        within_x = kxx_rows.sum()
        pairs = (m - 1) * (m - 2)
        left_out = ((within_x - 2 * kxx_rows) + (within_y - 2 * kyy_rows) - 2 * (cross - cross_rows)) / pairs
    else:  # the reference's own term is the same in every left-out figure: it drops out of their spread
        left_out = (within_y - 2 * kyy_rows) / ((m - 1) * (m - 2)) - 2 * (kxy.sum() - kxy.sum(0)) / (n * (m - 1))
    return float(((m - 1) / m * (left_out - left_out.mean()).pow(2).sum()).sqrt())


def projected_kid_se(reference: torch.Tensor, samples: torch.Tensor, *, dim: int = 64, seed: int = 0,
                     stats: Optional[torch.Tensor] = None) -> float:
    """``kernel_distance_sample_se`` of ``projected_kid``'s figure, on the same standardised projection:
    the standard error a night's figure is compared with others' by (``evaluation.criterion``)."""
    ref, out = standardised_projection(reference, samples, dim=dim, seed=seed, stats=stats)
    return kernel_distance_sample_se(ref, out)
