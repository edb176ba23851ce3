"""Applied = observed: a planned site that ran otherwise on any rank reverts to NCCL's defaults everywhere. Plugin hits
say a row matched, not what NCCL ran (it may clamp channels or switch protocol). A changed site with no record of its
calls while lagom's profiler recorded did not run as planned: it differs. ``unobserved``, never reverted: nothing could
be seen (another ``NCCL_PROFILER_PLUGIN``, NCCL < 2.23, its communicator's name unknown; gloo without a routed call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.outputs.run_files import say
from lagom_megatron.nccl.observed import (
    SiteObservation,
    matching_ops,
    not_run,
    observe_site,
    p2p_task_channels,
    unread_rule_note,
)


def observe_gloo_site(
    site_id: str, planned: CommConfig, *, op: str, nbytes: int, group_size: int, record: list | None
) -> SiteObservation:
    """``planned`` vs the gloo record ``[calls, threads seen, largest pieces seen]`` (piece 0: issued whole)."""
    if not record or not record[0]:
        return SiteObservation(site_id, "unobserved", note="no routed call of it was recorded")
    calls, threads, pieces = record
    want: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    bad: list[str] = []
    if planned.n_channels is not None:
        want["n_channels"] = planned.n_channels
        seen["n_channels"] = min(threads) if len(threads) == 1 else tuple(sorted(threads))
        bad += ["n_channels"] if threads != {planned.n_channels} else []
    if planned.chunk_size is not None:
        split = nbytes if op == "all_reduce" else nbytes // max(group_size, 1)
        expect = planned.chunk_size if split > planned.chunk_size else 0
        want["chunk_size"] = planned.chunk_size
        seen["chunk_size"] = min(pieces) if len(pieces) == 1 else tuple(sorted(pieces))
        bad += ["chunk_size"] if pieces != {expect} else []
    return SiteObservation(
        site_id,
        "differs" if bad else "applied",
        want,
        seen,
        tuple(bad),
        int(calls),
        "chunk_size 0: issued whole" if 0 in pieces and "chunk_size" in want else "",
    )


class ObservedCheck:
    """The applied = observed check of one rank; ``armed`` is the same on every rank."""

    def __init__(
        self,
        backend: str,
        *,
        reader: Callable[[], Any] | None = None,
        recorder: Callable[..., bool] | None = None,
        state_reader: Callable[[], Any] | None = None,
        version_reader: Callable[[], tuple[int, int, int] | None] | None = None,
        cluster: Any = None,
    ) -> None:
        self.backend = backend
        self.cluster = cluster
        """The ``ClusterSpec`` the plan was searched for: its topology gives a P2P task's expected channels."""
        self.recording = False
        """lagom's profiler half records on this rank since ``arm`` (NCCL only)."""
        self.reader = reader
        self.recorder = recorder
        self.state_reader = state_reader
        self.version_reader = version_reader
        """The NCCL version that runs (default: ``torch.cuda.nccl.version()``), which picks the channel rule."""
        self.rule_noted = False
        self.gloo = None
        self.armed = False
        self.results: dict[str, dict[str, Any]] = {}
        """Site id -> ``SiteObservation.to_dict`` plus ``rank``, the first rank that differed (or None)."""
        self.errors: list[str] = []

    def attach(self, router: Any) -> None:
        """Reads the gloo calls ``router`` notes (gloo only)."""
        if self.backend == "gloo":
            self.gloo = router.observe

    def _record(self, on: bool) -> bool:
        if self.backend == "gloo":
            if self.gloo is not None:
                self.gloo.start() if on else self.gloo.stop()
            return self.gloo is not None
        from lagom_megatron.nccl import plugin_status

        switched = bool((self.recorder or plugin_status.set_recording)(on, reset=on))
        state = (self.state_reader or plugin_status.profiler_state)()[0] if switched else "not loaded"
        return switched and state == "lagom"

    def arm(self) -> str | None:
        """Records what runs from now on; returns a note when lagom's profiler will record nothing."""
        self.armed = True
        on = self.recording = self._record(True)
        if self.backend == "gloo" or on:
            return None
        from lagom_megatron.nccl import plugin_status

        return plugin_status.not_recording_note(*(self.state_reader or plugin_status.profiler_state)())

    def local(self, plan: Any, pool: Any) -> list[SiteObservation]:
        """This rank's verdict on every planned site it belongs to (not collective)."""
        from lagom_megatron.nccl import plugin_status

        comms = None
        version = None
        if self.backend != "gloo":
            from lagom_megatron.nccl.options import runtime_nccl_version

            comms = (self.reader or plugin_status.read_observed)() or []
            version = (self.version_reader or runtime_nccl_version)()
            note = unread_rule_note(version)
            if note and comms and not self.rule_noted:
                self.rule_noted = True
                say(note)
        out = []
        for sid, e in sorted(plan.entries.items()):
            if e.config.is_default():
                continue
            info = pool.groups.by_name(e.group)
            if info is None:
                continue  # not a group of this rank: another pipeline stage's site
            group = pool.group_for(info, e.config)
            key = (pool.comm_key(group) or "") if group is not None else ""
            if self.backend == "gloo":
                rec = self.gloo.calls.get((e.group, key, e.op, e.nbytes)) if self.gloo is not None else None
                obs = observe_gloo_site(sid, e.config, op=e.op, nbytes=e.nbytes, group_size=e.group_size, record=rec)
            else:
                ops = matching_ops(comms, key, e.op, e.nbytes, e.group_size, e.parts) if key else []
                obs = observe_site(
                    sid,
                    e.config,
                    op=e.op,
                    nbytes=e.nbytes,
                    group_size=e.group_size,
                    ops=ops,
                    nccl_version=version,
                    p2p_expected=self._p2p_expected(e),
                )
                if obs.status == "unobserved" and self.recording and key:
                    obs = not_run(sid)
            out.append(obs)
        if consensus.fault_injected("observed"):
            out = _perturbed(out)
        return out

    def _p2p_expected(self, e: Any) -> Callable[[Any], int | None] | None:
        if self.cluster is None or e.config.n_channels is None:
            return None
        return lambda op: p2p_task_channels(
            self.cluster, op, bound=e.config.n_channels, group_size=e.group_size, n_nodes=e.n_nodes
        )

    def check(self, plan: Any, pool: Any) -> set[str]:
        """Collective (one all-gather): sites that differ on any rank; stops recording; a failed rank: unobserved."""
        try:
            mine: Any = [o.to_dict() for o in self.local(plan, pool)]
        except Exception as exc:  # noqa: BLE001 - still join the all-gather below
            mine = f"{type(exc).__name__}: {exc}"
        reports = consensus.all_gather(mine)
        self.armed = self.recording = False
        self._record(False)
        results: dict[str, dict[str, Any]] = {}
        for rank, report in enumerate(reports):
            if isinstance(report, str):
                continue
            for obs in report:
                have = results.get(obs["site_id"])
                if (
                    have is None
                    or (obs["status"] == "differs" and have["status"] != "differs")
                    or (have["status"] == "unobserved" and obs["status"] == "applied")
                ):
                    results[obs["site_id"]] = {**obs, "rank": rank}
        self.results = results
        failed = [f"rank {r}: {rep}" for r, rep in enumerate(reports) if isinstance(rep, str)]
        self.errors = failed
        bad = {sid for sid, r in results.items() if r["status"] == "differs"}
        return bad


def _perturbed(observations: list[SiteObservation]) -> list[SiteObservation]:
    out = list(observations)
    for i, o in enumerate(out):
        knob = next((k for k in ("n_channels", "chunk_size") if k in o.planned), None)
        if knob is None:
            continue
        n = int(o.planned[knob])
        wrong = (n - 1 if n > 1 else n + 1) if knob == "n_channels" else n // 2
        out[i] = SiteObservation(
            o.site_id,
            "differs",
            o.planned,
            dict(o.observed, **{knob: wrong}),
            tuple(sorted({*o.knobs, knob})),
            o.calls,
            f"fault injected by {consensus.APPLY_FAULT_ENV}",
        )
        break
    return out


def describe(results: dict[str, dict[str, Any]], sites: set[str]) -> str:
    """One line naming each reverted site with planned vs observed and the rank that saw it."""
    parts = []
    for sid in sorted(sites):
        r = results[sid]
        diff = ", ".join(f"{k} planned {r['planned'].get(k)} observed {r['observed'].get(k)}" for k in r["knobs"])
        parts.append(f"{sid} ({diff}; rank {r['rank']}{'; ' + r['note'] if r['note'] else ''})")
    return "; ".join(parts)


def log_plan_hits(plan: Any, groups: Any, *, status_reader: Callable[[], Any] | None = None) -> list[str]:
    """Logs this rank's hit summary, then (collective) ``compare_shared_hits``; returns its warnings."""
    from lagom_megatron.nccl.export import plan_hit_summary

    try:
        say(plan_hit_summary(plan, status_reader=status_reader))
    except Exception as exc:  # noqa: BLE001 - a log line is not worth a training run
        say(f"lagom: WARNING: tuner plugin hit summary failed ({type(exc).__name__}: {exc})")
    return compare_shared_hits(plan, groups, status_reader=status_reader)


def compare_shared_hits(plan: Any, groups: Any, *, status_reader: Callable[[], Any] | None = None) -> list[str]:
    """Logs, returns warnings on rows whose hits differ among a communicator's ranks; one all-gather, never raises."""
    from lagom_megatron.nccl import plugin_status
    from lagom_megatron.nccl.export import tuner_rows

    rows: list[Any] = []
    try:
        rows = tuner_rows(plan, extended=True)
        status = (status_reader or plugin_status.read_plugin_status)()
        hits = tuple(status.row_hits) if status is not None and status.table_loaded else None
        if hits is not None and len(hits) != len(rows):
            hits = None  # another table than this plan's: nothing to compare (the summary says so)
        members = (
            {}
            if groups is None
            else {name: tuple(info.ranks) for name in groups.names() if (info := groups.by_name(name)) is not None}
        )
        local: tuple = (hits, members, None)
    except Exception as exc:  # noqa: BLE001 - still join the all-gather below
        local = (None, {}, f"{type(exc).__name__}: {exc}")
    warnings: list[str] = []
    try:
        reports = consensus.all_gather(local)
        mismatches = plugin_status.shared_hit_mismatches([r.cells[11] for r in rows], [(h, m) for h, m, _ in reports])
        line = plugin_status.describe_mismatches(mismatches, rows)
        if line:
            warnings.append(line)
        failed = [f"rank {r}: {err}" for r, (_, _, err) in enumerate(reports) if err]
        if failed:
            warnings.append(
                f"lagom: WARNING: tuner row hits not read, left out of the comparison across ranks: {'; '.join(failed)}"
            )
    except Exception as exc:  # noqa: BLE001 - a broken comparison must not end training
        warnings = [f"lagom: WARNING: comparing tuner row hits across ranks failed ({type(exc).__name__}: {exc})"]
    for line in warnings:
        say(line)
    return warnings
