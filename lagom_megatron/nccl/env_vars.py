"""NCCL environment variables that matter to lagom: which ones override per-communicator config.

Source: research on NCCL's ``src/init.cc`` (``envConfigOverride``): when one of these variables is
set, it overrides the matching ``ncclConfig_t`` field of every communicator, so lagom's
per-communicator choices would be silently ignored.
"""

from __future__ import annotations

PER_COMMUNICATOR_OVERRIDES: dict[str, str] = {
    "NCCL_MIN_CTAS": "ncclConfig_t.minCTAs",
    "NCCL_MAX_CTAS": "ncclConfig_t.maxCTAs",
    "NCCL_CGA_CLUSTER_SIZE": "ncclConfig_t.cgaClusterSize",
    "NCCL_CTA_POLICY": "ncclConfig_t.CTAPolicy",
    "NCCL_NVLS_NCHANNELS": "ncclConfig_t.nvlsCTAs",
    "NCCL_MIN_NCHANNELS": "ncclConfig_t.minCTAs (deprecated name)",
    "NCCL_MAX_NCHANNELS": "ncclConfig_t.maxCTAs (deprecated name)",
}
"""Variable -> the per-communicator field it overrides in every communicator."""

TUNER_OVERRIDES: dict[str, str] = {
    "NCCL_ALGO": "restricts the algorithms before the tuner plugin sees the cost table",
    "NCCL_PROTO": "restricts the protocols before the tuner plugin sees the cost table",
}
"""Variables that narrow what the tuner plugin can choose (set per communicator by the pool)."""
