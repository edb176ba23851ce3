"""Collectives of other groups in a site's window: the cost model's per-site offset.

A site's region is fitted on its own config (``cost_model``: ``max(T_comm, T_comp + T_run s /
(1 + s))``), which bounds what a collective adds to its window by its own run time. In an
overlapped iteration other groups' collectives run in the window too (the data-parallel
reduce-scatters of the last micro-batch beside the tensor-parallel gathers and reduce-scatters of
the backward pass) and take SMs and HBM from its compute, so a window can hold more than its own
collective could add: on Llama-2 7B over 32 A100 with one micro-batch a 90 us tensor-parallel
gather's window holds ~240 us more compute than its serialized compute and its own slowdown
explain, and the fit's MAPE was 6%. The region model has no place for it.

``window_offsets`` gives each site the mean of its region's residual (measured less the own-config
model; weights of a MAPE) where that mean is above ``OFFSET_SIGMAS`` standard errors of its
samples, 0 elsewhere (a residual within the timing noise is not a term); ``CostModel.evaluate``
adds it to the site's region. A constant per site, it changes no comparison the search makes; it
makes the predicted regions (and the plan's, and the MAPE) those of the window as measured.

How the window's extra compute moves with the other groups' configs is not in the model. A slope
per site over the other groups' load (their collectives' ``T_run s / (1 + s)`` summed per probe
iteration) was tried: it fits the probes, but the probes apply one config to every site at once, so
the slope is confounded with each site's own config, and in the search it credited cutting the
data-parallel channels with gains in the tensor-parallel windows that did not appear (Llama-2 7B on
A100, one micro-batch: predicted 1.108x, simulated 1.064x, against 1.069x without it). Our design.
"""

from __future__ import annotations

import numpy as np

OFFSET_SIGMAS = 2.0
"""A site's mean residual becomes its offset only above this many standard errors (else it is noise)."""


def window_offsets(n_sites: int, i_J: np.ndarray, residual_J: np.ndarray, y_J: np.ndarray) -> np.ndarray:
    """Per site, the offset (us) of its region over the own-config model (module docstring).

    Args:
        n_sites: S. i_J: shape (J,), each sample's site index. residual_J: shape (J,), measured
            region less the own-config model's (us). y_J: shape (J,), the measured region (us).

    Returns:
        Shape (S,): the weighted mean residual (weights 1 / y^2) of each site with at least 3
        samples whose mean is above ``OFFSET_SIGMAS`` standard errors; 0 elsewhere.
    """
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
