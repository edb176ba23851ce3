"""Per-site offset of the cost model: what other groups' collectives in a site's window add to its region.

Other groups' collectives (DP reduce-scatters beside TP gathers) slow its compute too; a constant per site, the
offset changes no comparison of the search; its change with their configs is not modelled. Our design."""

from __future__ import annotations

import numpy as np

OFFSET_SIGMAS = 2.0
"""Standard errors a site's mean residual must exceed to become its offset."""


def window_offsets(n_sites: int, i_J: np.ndarray, residual_J: np.ndarray, y_J: np.ndarray) -> np.ndarray:
    """Per site, the offset (us) of its region over the own-config model, shape (S,): the 1 / y^2-weighted mean
    ``residual_J`` (us, shape (J,)) where >= 3 samples and above ``OFFSET_SIGMAS`` standard errors; else 0."""
    out = np.zeros(n_sites)
    w = 1.0 / np.maximum(np.asarray(y_J, dtype=float), 1e-9) ** 2
    for i in range(n_sites):
        m = i_J == i
        n = int(m.sum())
        if n < 3:
            continue
        r = residual_J[m]
        mean = float(np.average(r, weights=w[m]))
        if abs(mean) > OFFSET_SIGMAS * float(np.std(r, ddof=1)) / np.sqrt(n):
            out[i] = mean
    return out
