"""The files of one ``--lagom`` run, and lagom's log lines.

Files go to the run directory: the folder of ``--lagom-plan``, else ``./lagom_out/<preset>``
(``./lagom_out/run`` without a preset): ``plan.json`` (or ``--lagom-plan``) with ``plan.env``
beside it (the plan's process-scope knobs, which the launch scripts source on the next run),
``profile.json`` (``lagom search --profile`` re-searches it offline), ``report.md`` (or
``--lagom-report``) and the report's PNG, and on NCCL with the tuner plugin one plan table per
rank (``tuner_table.rank<r>.csv``). Rank 0 writes the shared files; every rank learns what rank 0
read through ``consensus``, so all ranks take the same branch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_RUN_DIR = "lagom_out"
"""Parent of the run directory when ``--lagom-plan`` is not given."""


def say(msg: str) -> None:
    """Prints a lagom log line on rank 0 (Megatron's style: one line, fields split by `` | ``)."""
    if int(os.environ.get("RANK", "0")) == 0:
        # one write per line: under `python -u` print() writes the text and the newline apart, and
        # another rank's line (the last rank logs iterations) can land in between
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()


def _file_sha(path: Path) -> str:
    """First 12 hex digits of the SHA-256 of a file's bytes ("unreadable" when it cannot be read)."""
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return "unreadable"


def plan_problem(plan: Any, cluster: Any) -> str | None:
    """Why ``lagom plan validate`` would reject ``plan`` for ``cluster``, or None when it accepts it.

    The same rules as ``lagom plan validate`` (``cli/plan.py``): a gloo plan is only for a gloo
    cluster; every entry's config passes ``rules_for(cluster.backend, cluster, plan.mechanism)
    .validate`` (NCCL's documented domains, or gloo's); the env passes
    ``nccl.env_vars.validate_env`` (NCCL_ALGO / NCCL_PROTO grammar and tokens, thread and
    buffer sizes).

    Returns:
        One line naming the entry or variable, its value and what is allowed; None when valid.
    """
    from lagom_megatron.megatron.backends import rules_for
    from lagom_megatron.nccl.env_vars import validate_env

    if plan.backend == "gloo" and cluster.backend != "gloo":
        return f"a gloo plan cannot be used on NCCL cluster {cluster.name!r}"
    try:
        rules = rules_for(cluster.backend, cluster, plan.mechanism)
    except ValueError as exc:
        return str(exc)
    for site_id, e in plan.entries.items():
        try:
            rules.validate(e.config, op=e.op, n_nodes=e.n_nodes, group_size=e.group_size or None)
        except ValueError as exc:
            return f"entry {site_id!r}: {exc}"
    try:
        validate_env(plan.env)
    except ValueError as exc:
        return f"env: {exc}"
    return None


class RunFiles:
    """Paths of one run's files (module docstring) and reading / writing them.

    Args:
        plan_path: ``--lagom-plan``; None = ``<run dir>/plan.json``.
        report_path: ``--lagom-report``; None = ``<run dir>/report.md``.
        preset_name: names the run directory when ``plan_path`` is None.
        rank: this process's rank (only rank 0 writes shared files).

    Attributes:
        keep_user_file: set when a plan that could not be reused could not be moved aside either;
            ``save_plan`` then writes nothing over it.
    """

    def __init__(self, *, plan_path: str | None = None, report_path: str | None = None,
                 preset_name: str | None = None, rank: int = 0) -> None:
        self.run_dir = Path(plan_path).parent if plan_path else Path(DEFAULT_RUN_DIR) / (preset_name or "run")
        self.plan_path = Path(plan_path) if plan_path else self.run_dir / "plan.json"
        self.profile_path = self.run_dir / "profile.json"
        self.report_path = Path(report_path) if report_path else self.run_dir / "report.md"
        self.rank = rank
        self.keep_user_file = False

    def saved_plan(self, fingerprint: dict[str, Any], cluster: Any = None) -> Any:
        """The plan saved at ``plan_path`` if this run can reuse it, the same on every rank. Collective.

        Returns None, after one warning line, when there is no plan or it cannot be reused; then
        rank 0 moves the file aside, never overwriting or deleting it, and the line names where:

        - it cannot be read, is not valid JSON or not a valid plan: ``plan.corrupt-<sha>.json``;
        - an entry or its env breaks the rules ``lagom plan validate`` applies (:func:`plan_problem`
          with ``cluster``): ``plan.invalid-<digest>.json``;
        - its fingerprint differs from ``fingerprint`` (another run's plan): ``plan.<digest>.json``.

        Raises:
            consensus.PlanDisagreement: the ranks' copies of the plan differ (digest check).
        """
        from lagom_megatron.engine.plan import Plan, shown
        from lagom_megatron.megatron import consensus

        if not consensus.broadcast_object(self.plan_path.is_file()):
            return None
        plan, error, kept = None, None, None
        if self.rank == 0:
            try:
                plan = Plan.load(self.plan_path)
            except (ValueError, OSError) as exc:
                error, kept = str(exc), self._move_aside("corrupt-" + _file_sha(self.plan_path))
            if plan is not None and cluster is not None:
                problem = plan_problem(plan, cluster)
                if problem is not None:
                    error, kept = problem, self._move_aside("invalid-" + plan.digest()[:12])
                    plan = None
        error, kept = consensus.broadcast_object((error, None if kept is None else str(kept)))
        if error is not None:
            say(f"lagom: WARNING: cannot reuse plan {self.plan_path}: {error}; "
                f"{f'kept as {kept}' if kept else 'left in place'}; searching a new one")
            return None
        diff = consensus.broadcast_object(plan.fingerprint_mismatch(fingerprint) if plan is not None else None)
        if diff:
            detail = "; ".join(f"{k}: plan {shown(plan.fingerprint, k)} vs run {shown(fingerprint, k)}"
                               for k in diff) if plan is not None else ""
            kept = self._move_aside(plan.digest()[:12]) if plan is not None else None
            say(f"lagom: WARNING: plan {self.plan_path} fingerprint differs in {', '.join(diff)}"
                f"{' (' + detail + ')' if detail else ''}; re-searching and saving there"
                f"{f' (the other plan is kept as {kept})' if kept is not None else ''}")
            return None
        return consensus.agree_plan(plan if plan is not None else Plan(entries={}), from_dict=Plan.from_dict)

    def _move_aside(self, tag: str) -> Path | None:
        """Renames the plan to ``<stem>.<tag><suffix>`` beside it (rank 0); None when that fails
        (the file then stays where it is, and the new plan is not saved over it: ``save_plan``)."""
        kept = self.plan_path.with_name(f"{self.plan_path.stem}.{tag}{self.plan_path.suffix}")
        try:
            os.replace(self.plan_path, kept)
        except OSError:
            self.keep_user_file = True
            return None
        return kept

    def save_plan(self, plan: Any) -> None:
        """Saves the plan and, beside it, the env file of its process-scope knobs (``plan.env``),
        which the launch scripts source on the next run (NCCL reads those knobs once per process).
        A knob outside NCCL's domain is logged and left out of the env file; training goes on."""
        from lagom_megatron.nccl.env_file import write_plan_env_file

        if getattr(self, "keep_user_file", False):  # a plan that could not be moved aside is never overwritten
            say(f"lagom: WARNING: plan not saved: {self.plan_path} could not be reused nor moved aside")
            return
        plan.save(self.plan_path)
        try:
            write_plan_env_file(self.plan_path, plan.env)
        except ValueError as exc:
            say(f"lagom: WARNING: env file for {self.plan_path} not written: {exc}")

    def write_tuner_table(self, plan: Any, cluster: Any) -> Path:
        """Writes this rank's copy of the plan as the tuner plugin's table (extended CSV), atomically."""
        from lagom_megatron.engine.files import write_text_atomic
        from lagom_megatron.nccl.export import export_plan

        table = self.run_dir / f"tuner_table.rank{self.rank}.csv"
        write_text_atomic(table, export_plan(plan, "nccl-tuner-csv", extended=True, cluster=cluster))
        return table
