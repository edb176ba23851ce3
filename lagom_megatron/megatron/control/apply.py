"""Applying capabilities, pool entries, the plan table and first use on every rank or none (a failure reverts all)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.control.observed import ObservedCheck, describe
from lagom_megatron.megatron.hooks.profiler import enable_comm_timing
from lagom_megatron.megatron.outputs.run_files import say
from lagom_megatron.nccl import capabilities as caps_mod
from lagom_megatron.nccl.engine import engine_lines
from lagom_megatron.nccl.export import export_plan
from lagom_megatron.nccl.pool import NcclPoolBackend

log = logging.getLogger("lagom")


class Applier:
    """The collective apply path of one rank."""

    def __init__(self, *, pool: Any, router: Any, files: Any, cluster: Any) -> None:
        self.pool = pool
        self.router = router
        self.files = files
        self.cluster = cluster
        self.capabilities: Any = None
        self.error: str | None = None
        self.table_plan: Any = None
        """The plan whose tuner table the plugin loaded, sites reverted since included (hits count against it)."""
        self.observed = ObservedCheck(pool.backend.name, cluster=cluster)
        self.observed.attach(router)

    def agree_capabilities(self, *, on_gpu: bool, gather: Callable[[], Any] | None = None) -> Any:
        """Gathers, agrees and returns the capabilities (None after a disagreement, logged)."""
        if on_gpu:
            import torch
            import torch.distributed as dist

            # NCCL creates a communicator (and loads the plugin, or not) before its status is read
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
        try:
            # a rank where gathering (files, driver, plugin) fails must not leave the others in the all-gather
            local = consensus.collective_step("capabilities", gather or caps_mod.gather_local)
            agreed, hosts = consensus.agree_capabilities(
                local,
                from_dict=caps_mod.Capabilities.from_dict,
                differences=caps_mod.differences,
                perturb=caps_mod.perturb,
            )
            self._check_nodes(hosts)
        except (consensus.CapabilityDisagreement, consensus.ApplyFailed, ValueError) as exc:
            self.error = str(exc)
            say(f"lagom: ERROR: {exc}")
            return None
        self.capabilities = agreed
        if on_gpu:
            for line in engine_lines():
                say(line)
            enable_comm_timing(self.pool.groups.objects())
        if isinstance(self.pool.backend, NcclPoolBackend):
            self.pool.backend.configure(agreed)
            self.pool.invalidate_keys()
        return agreed

    def _check_nodes(self, hosts: list[str]) -> None:
        groups = self.pool.groups
        for name in groups.names():
            info = groups.by_name(name)
            nccl_nodes = len({hosts[r] for r in info.ranks if r < len(hosts)})
            if info.ranks and nccl_nodes != info.n_nodes:
                raise ValueError(
                    f"group {name!r} spans {nccl_nodes} node(s) as NCCL counts hosts but {info.n_nodes} "
                    f"from LOCAL_WORLD_SIZE={groups.local_world_size} (ranks not placed in blocks per node?); "
                    "tuning off, defaults kept"
                )

    def fingerprint_part(self) -> dict[str, Any]:
        """The agreed capabilities as recorded in the plan's fingerprint (without the host)."""
        if self.capabilities is None:
            return {}
        d = self.capabilities.to_dict()
        d.pop("host", None)
        return {"capabilities": json.loads(json.dumps(d))}  # as a saved plan holds it (lists, not tuples)

    def _check_env_unchanged(self) -> None:
        if self.capabilities is None:
            return
        now = dict(caps_mod.knob_overrides(os.environ))
        then = dict(self.capabilities.overrides)
        changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
        if changed:
            detail = ", ".join(f"{k}={now.get(k)!r} (was {then.get(k)!r})" for k in changed)
            raise ValueError(
                f"NCCL variables changed since the capabilities were agreed: {detail}; the plan's "
                "domain no longer holds"
            )

    def apply(
        self,
        needs: dict[str, set[CommConfig]],
        *,
        what: str,
        plan: Any = None,
        ops: dict[CommConfig, str] | None = None,
    ) -> bool:
        """Creates the pool entries ``needs`` calls for (and a plan's table); False after a revert (logged)."""
        backend = self.pool.backend
        try:
            consensus.collective_step("env", self._check_env_unchanged)
            if plan is not None:
                # unused probe entries are destroyed in this step: entry_key may refuse a key, a destroy can fail
                consensus.collective_step(
                    "table",
                    lambda: (self._check_mechanism(plan), self._load_table(plan), self.pool.destroy(keep=needs)),
                )
            self.pool.prepare(needs, step=consensus.collective_step, ops=ops)
        except consensus.ApplyFailed as exc:
            self.revert(f"applying {what} failed: {exc}")
            return False
        if backend.name == "nccl":
            enable_comm_timing(self.pool.entries())
        guard = getattr(self.router, "first_use", None)
        if guard is not None:
            guard.arm()
        if plan is not None:
            note = self.observed.arm()
            if note:
                say(note)
        say(f"lagom: communicator pool for {what}: {self.pool.describe()} on this rank ({backend.name})")
        return True

    def check_first_use(self) -> bool:
        """Reverts every rank when NCCL refused a first call on any rank (``first_use``); False then."""
        guard = getattr(self.router, "first_use", None)
        if guard is None or not guard.armed:
            return True
        disarm = bool(getattr(self.router, "assignment", None))
        try:
            consensus.collective_step("first-call", lambda: guard.check(disarm=disarm))
        except consensus.ApplyFailed as exc:
            self.revert(f"the first calls on the pool entries failed: {exc}")
            return False
        return True

    def check_observed(self, plan: Any) -> set[str]:
        """Sites that ran other than ``plan`` on any rank (one all-gather, none before it was routed), now defaults."""
        check = self.observed
        if not check.armed or not getattr(self.router, "assignment", None):
            return set()
        bad = check.check(plan, self.pool)
        for line in check.errors:
            say(f"lagom: WARNING: the observed check failed on {line}; its sites count as unobserved")
        applied = sum(r["status"] == "applied" for r in check.results.values())
        unobserved = sum(r["status"] == "unobserved" for r in check.results.values())
        if bad:
            self.router.set_assignment({k: v for k, v in self.router.assignment.items() if k not in bad})
            say(
                f"lagom: WARNING: {len(bad)} site(s) did not run as planned and keep the defaults on every rank: "
                f"{describe(check.results, bad)}"
            )
        say(
            f"lagom: observed: {applied} site(s) ran as planned, {len(bad)} differed, {unobserved} unobserved "
            f"({self.pool.backend.name})"
        )
        return bad

    def apply_probes(self, assignments: list[dict[str, CommConfig]], sites: list[Any]) -> bool:
        """``apply`` for the warm-up probes (``assignments``: site id -> config, one per probe)."""
        group_of = {s.site_id: s.group for s in sites}
        op_of = {s.site_id: s.op for s in sites}
        needs: dict[str, set[CommConfig]] = {}
        ops: dict[CommConfig, str] = {}
        for assignment in assignments:
            for sid, cfg in assignment.items():
                needs.setdefault(group_of[sid], set()).add(cfg)
                ops.setdefault(cfg, op_of[sid])
        return self.apply(needs, what="the probe configs", ops=ops)

    def apply_plan(self, plan: Any) -> bool:
        """``apply`` for an agreed plan: its non-default configs, its table in plugin mode."""
        needs: dict[str, set[CommConfig]] = {}
        ops: dict[CommConfig, str] = {}
        for e in plan.entries.values():
            if not e.config.is_default():
                needs.setdefault(e.group, set()).add(e.config)
                ops.setdefault(e.config, e.op)
        return self.apply(needs, what=f"plan {plan.digest()[:12]}", plan=plan, ops=ops)

    def summary_part(self) -> dict[str, Any]:
        """The report's summary part; after a failure ``phase = fell_back`` with the reason."""
        out: dict[str, Any] = {"pool": self.pool_summary()}
        if self.observed.results:
            out["observed"] = {sid: dict(r) for sid, r in sorted(self.observed.results.items())}
        if self.capabilities is not None:
            out["capabilities"] = self.fingerprint_part()["capabilities"]
        if self.error:
            out.update(phase="fell_back", reason=self.error)
        return out

    def _check_mechanism(self, plan: Any) -> None:
        backend = self.pool.backend
        if backend.name != "nccl" or self.capabilities is None:
            return
        agreed = self.capabilities.mechanism()
        if plan.mechanism != agreed:
            raise ValueError(
                f"plan {plan.digest()[:12]} was searched for mechanism {plan.mechanism!r} but this run "
                f"applies {agreed!r} (agreed capabilities: plugin loaded {self.capabilities.plugin_loaded})"
            )

    def _load_table(self, plan: Any) -> None:
        backend = self.pool.backend
        if isinstance(backend, NcclPoolBackend) and backend.use_tuner_plugin:
            table = export_plan(plan, "nccl-tuner-csv", extended=True, cluster=self.cluster)
            backend.load_table(plan, self.files.tuner_table, table)
            self.pool.invalidate_keys()
            self.table_plan = plan

    def revert(self, reason: str) -> None:
        """Every rank: NCCL's defaults for every site, every pool entry destroyed, one error logged."""
        self.error = reason
        self.router.set_assignment({})
        live = self.pool.live
        try:
            destroyed = self.pool.destroy()
        except Exception as exc:  # noqa: BLE001 - the defaults are routed already; say so and go on
            destroyed = live - self.pool.live
            reason = f"{reason}; destroying the pool entries failed too ({type(exc).__name__}: {exc})"
        say(
            f"lagom: ERROR: {reason}; NCCL defaults kept on every rank, {destroyed}/{live} pool entries destroyed, "
            "training continues"
        )

    def pool_summary(self) -> dict[str, Any]:
        """Counts for the report: entries created and destroyed, live now, estimated MiB."""
        return {
            **self.pool.stats,
            "live": self.pool.live,
            "estimated_mib": round(self.pool.estimated_bytes / 2**20, 1),
            "budget_mib": None if self.pool.budget_bytes is None else round(self.pool.budget_bytes / 2**20, 1),
        }

    def fit_plan_to_budget(self, plan: Any) -> Any:
        """``plan`` with the entries of least predicted gain set to the defaults until the pool fits its budget."""
        budget, backend = self.pool.budget_bytes, self.pool.backend
        if budget is None or not isinstance(backend, NcclPoolBackend):
            return plan
        if backend.set_cta_bounds(plan):
            self.pool.invalidate_keys()
        by_key: dict[tuple[str, Any], list[str]] = {}
        cost: dict[tuple[str, Any], int] = {}
        for sid, e in plan.entries.items():
            if e.config.is_default():
                continue
            key = (e.group, self.pool.key(e.config, e.group))
            if key[1] is None:
                continue
            by_key.setdefault(key, []).append(sid)
            cost[key] = int(self.pool.estimate(e.config, e.group))
        if sum(cost.values()) <= budget:
            return plan

        def gain(k: tuple[str, Any]) -> float:
            return sum(
                plan.entries[s].predicted_default_t_region_us - plan.entries[s].predicted_t_region_us for s in by_key[k]
            )

        kept, total, dropped = [], 0, []
        for k in sorted(by_key, key=lambda k: (-gain(k), repr(k))):
            if total + cost[k] <= budget:
                kept.append(k)
                total += cost[k]
            else:
                dropped.extend(by_key[k])
        entries = dict(plan.entries)
        for sid in dropped:
            e = entries[sid]
            entries[sid] = dataclasses.replace(
                e, config=CommConfig(), predicted_t_region_us=e.predicted_default_t_region_us
            )
        say(
            f"lagom: WARNING: {len(dropped)} site(s) keep NCCL's defaults: their communicator-pool entries would pass "
            f"the budget of {budget / 2**20:.0f} MiB per rank (--lagom-pool-budget-mib)"
        )
        return dataclasses.replace(
            plan, entries=entries, stats={**plan.stats, "sites_dropped_for_budget": len(dropped)}
        )
