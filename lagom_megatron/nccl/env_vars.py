"""NCCL variables that matter to lagom; ``validate_env`` checks those lagom writes (``env_check``: the user's). A set
override replaces its ``ncclConfig_t`` field in every communicator (``src/init.cc`` ``envConfigOverride``)."""

from __future__ import annotations

from lagom_megatron.engine.knobs import ALGORITHMS, N_THREADS, PROTOCOLS, invalid_value

PER_COMMUNICATOR_OVERRIDES: dict[str, str] = {
    "NCCL_MIN_CTAS": "ncclConfig_t.minCTAs",
    "NCCL_MAX_CTAS": "ncclConfig_t.maxCTAs",
    "NCCL_CGA_CLUSTER_SIZE": "ncclConfig_t.cgaClusterSize",
    "NCCL_CTA_POLICY": "ncclConfig_t.CTAPolicy",
    "NCCL_NVLS_NCHANNELS": "ncclConfig_t.nvlsCTAs",
    "NCCL_MIN_NCHANNELS": "ncclConfig_t.minCTAs (deprecated name)",
    "NCCL_MAX_NCHANNELS": "ncclConfig_t.maxCTAs (deprecated name)",
    "NCCL_NCHANNELS_PER_NET_PEER": "ncclConfig_t.nChannelsPerNetPeer (src/init.cc:2038-2047)",
}
"""Variable -> the per-communicator field it overrides in every communicator."""

TUNER_OVERRIDES: dict[str, str] = {
    "NCCL_ALGO": "restricts the algorithms before the tuner plugin sees the cost table",
    "NCCL_PROTO": "restricts the protocols before the tuner plugin sees the cost table",
}
"""Variables that narrow what the tuner plugin can choose (set per communicator by the pool)."""


def launch_nthreads(env: dict[str, str]) -> int | None:
    """``NCCL_NTHREADS`` of a launch environment; None when unset or empty (NCCL reads it once per process)."""
    value = env.get("NCCL_NTHREADS")
    return int(value) if value else None


def _split_list(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def validate_env(env: dict[str, str]) -> None:
    """Checks NCCL variables against NCCL's and lagom's rules (no forced LL128, nccl#786; a global NCCL_ALGO keeps Ring,
    pytorch#163063); ValueError names the variable, value and allowed set."""
    for key, value in env.items():
        value = str(value)
        if key == "NCCL_PROTO":
            for entry in value.split(";"):
                body = entry.split(":", 1)[-1]
                if body.startswith("^"):
                    continue
                tokens = _split_list(body)
                bad = [t for t in tokens if t.lower() not in {p.lower() for p in PROTOCOLS}]
                if bad:
                    raise invalid_value("NCCL_PROTO", value, list(PROTOCOLS), f"unknown token {bad[0]!r}")
                if any(t.lower() == "ll128" for t in tokens):
                    raise invalid_value("NCCL_PROTO", value, "exclusions such as '^LL128' or lists without LL128",
                                "forcing LL128 can corrupt data silently (nccl#786)")
        elif key == "NCCL_ALGO":
            for entry in value.split(";"):
                prefixed = ":" in entry
                body = entry.split(":", 1)[-1]
                if body.startswith("^"):
                    continue
                tokens = _split_list(body)
                bad = [t for t in tokens if t.lower() not in {a.lower() for a in ALGORITHMS}]
                if bad:
                    raise invalid_value("NCCL_ALGO", value, list(ALGORITHMS), f"unknown token {bad[0]!r}")
                if not prefixed and "ring" not in {t.lower() for t in tokens}:
                    raise invalid_value("NCCL_ALGO", value, "a global list that includes Ring, or per-function entries ('allreduce:nvls,ring')",
                                "collectives with no allowed algorithm fail (pytorch#163063)")
        elif key == "NCCL_NTHREADS":
            if not value.isdigit() or int(value) not in N_THREADS:
                raise invalid_value("NCCL_NTHREADS", value, list(N_THREADS))
        elif key == "NCCL_NCHANNELS_PER_NET_PEER":
            if not value.isdigit() or not 1 <= int(value) <= 64 or int(value) & (int(value) - 1):
                raise invalid_value("NCCL_NCHANNELS_PER_NET_PEER", value, "powers of two 1..64 (NCCL rounds up to one)")
        elif key == "NCCL_BUFFSIZE":
            if not value.isdigit() or int(value) <= 0 or int(value) & (int(value) - 1):
                raise invalid_value("NCCL_BUFFSIZE", value, "powers of two (bytes)")
