"""The files of one ``--lagom`` run, and lagom's log lines. Run directory: ``--lagom-plan``'s folder, else
``./lagom_out/<preset or run>``; rank 0 writes, ``consensus`` shares what it read. A plan this run cannot reuse moves
aside with every file it would overwrite (one tag, never replacing a file), else this run writes none of them."""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path
from typing import Any

DEFAULT_RUN_DIR = "lagom_out"
TUNER_TABLE = r"tuner_table\.rank\d+\.csv"
RUN_KINDS = ("tuned", "reused", "unfinished", "interrupted")
"""How a run ended (names its report): ``tuned``; ``reused``: a saved plan; ``unfinished``: ``--train-iters`` ended
first; ``interrupted``: an error or signal."""
STAYS = " (the other plan could not be moved aside: it stays, and this run saves no plan, profile or report over it)"


def say(msg: str) -> None:
    """Prints a lagom log line on rank 0 (Megatron's style: one line, fields split by `` | ``)."""
    if int(os.environ.get("RANK", "0")) == 0:
        # one write: under `python -u` print() writes text and newline apart; another rank's line can land between
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()


def _file_sha(path: Path) -> str:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return "unreadable"


def aside_name(path: Path, tag: str) -> Path:
    """``<stem>.<tag><suffix>`` beside ``path``."""
    return path.with_name(f"{path.stem}.{tag}{path.suffix}")


NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV)
"""``link(2)`` errors meaning the file system (or ``fs.protected_hardlinks``) gives no hard link here."""


def rename_no_replace(src: Path, dst: Path) -> None:
    """Renames ``src`` to ``dst`` (a symlink itself), never replacing, all or nothing: ``os.link`` + ``unlink``, or a
    checked ``os.rename`` (``preflight.files`` lock). FileExistsError: ``dst`` exists; OSError: can't move."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
        os.rename(src, dst)
        return
    try:
        os.unlink(src)
    except OSError:
        os.unlink(dst)  # both names held the file: drop the new one, the old stays as it was
        raise


def entries_problem(plan: Any, cluster: Any) -> str | None:
    """Why ``plan``'s entries and registered groups cannot run on ``cluster`` under its mechanism, in one line, or
    None: each entry's config (``rules.validate``), then what it registers (``nccl.registration``)."""
    from lagom_megatron.megatron.pool.comm_pool import rules_for
    from lagom_megatron.nccl.registration import plan_registration_problem

    try:
        rules = rules_for(cluster.backend, cluster, plan.mechanism)
    except ValueError as exc:
        return str(exc)
    for site_id, e in plan.entries.items():
        try:
            rules.validate(e.config, op=e.op, n_nodes=e.n_nodes, group_size=e.group_size or None)
        except ValueError as exc:
            return f"entry {site_id!r}: {exc}"
    return plan_registration_problem(plan, rules)


def plan_problem(plan: Any, cluster: Any) -> str | None:
    """Why ``lagom plan validate`` (``cli/plan.py``) would reject ``plan`` for ``cluster`` in one line, or None."""
    from lagom_megatron.nccl.env_vars import validate_env

    if plan.backend == "gloo" and cluster.backend != "gloo":
        return f"a gloo plan cannot be used on NCCL cluster {cluster.name!r}"
    problem = entries_problem(plan, cluster)
    if problem is not None:
        return problem
    try:
        validate_env(plan.env)
    except ValueError as exc:
        return f"env: {exc}"
    return None


class RunFiles:
    """A run's file paths, read and written (shared ones by rank 0); ``keep_user_file``: a plan not moved aside."""

    def __init__(
        self,
        *,
        plan_path: str | None = None,
        report_path: str | None = None,
        preset_name: str | None = None,
        rank: int = 0,
    ) -> None:
        self.run_dir = Path(plan_path).parent if plan_path else Path(DEFAULT_RUN_DIR) / (preset_name or "run")
        self.plan_path = Path(plan_path) if plan_path else self.run_dir / "plan.json"
        self.profile_path = self.run_dir / "profile.json"
        self.tuner_table = self.run_dir / f"tuner_table.rank{rank}.csv"
        self.report_path = Path(report_path) if report_path else self.run_dir / "report.md"
        self.plan_given = bool(plan_path)
        self.report_given = bool(report_path)
        self.rank = rank
        self.keep_user_file = False
        self._held: set[Path] = set()

    def plan_files(self, *, existing: bool = True) -> list[Path]:
        """Plan files, plan first (all paths unless ``existing``): plan.env, profile, reports + PNGs, tuner tables."""
        from lagom_megatron.nccl.env_file import env_file_path

        def named(folder: Path, pattern: str) -> list[Path]:
            return sorted(p for p in folder.iterdir() if re.fullmatch(pattern, p.name)) if folder.is_dir() else []

        report = self.report_path
        reports = [report, *named(report.parent, rf"{re.escape(report.stem)}\.reused-\d+{re.escape(report.suffix)}")]
        paths = [self.plan_path, env_file_path(self.plan_path), self.profile_path]
        for r in reports:
            paths += [r, r.with_suffix(".png")]
        paths += named(self.run_dir, TUNER_TABLE)
        out: list[Path] = []
        for p in paths:
            if p not in out and (not existing or os.path.lexists(p)):
                out.append(p)
        return out

    def outputs(self) -> list[tuple[str, Path, str | None]]:
        """(what, path, why or None for a user-given path) of each file this run writes at a fixed name, plan first."""
        from lagom_megatron.nccl.env_file import env_file_path

        return [
            ("--lagom-plan", self.plan_path, None)
            if self.plan_given
            else ("the default plan", self.plan_path, "without --lagom-plan"),
            ("the plan's env file", env_file_path(self.plan_path), "lagom writes it beside the plan"),
            ("lagom's profile", self.profile_path, "lagom writes it in the plan's folder"),
            ("--lagom-report", self.report_path, None)
            if self.report_given
            else ("the default report", self.report_path, "without --lagom-report"),
            ("the report's figure", self.report_path.with_suffix(".png"), "lagom writes it beside the report"),
        ]

    def name_clash(self) -> str | None:
        """Why two of this run's files would be one (same path, symlink, hard link; named as tuner table / report)."""

        def same(a: Path, b: Path) -> bool:
            if os.path.realpath(a) == os.path.realpath(b):
                return True
            return a.exists() and b.exists() and os.path.samefile(a, b)

        outputs = self.outputs()
        # the report first: it is the one to rename when it names the plan (the plan may hold a search's result)
        given = [(what, path) for what, path, why in reversed(outputs) if why is None]
        for what, path in given:
            for other, other_path, why in outputs:
                if other_path is path or (other == "the report's figure" and what == "--lagom-report"):
                    continue  # a report named .png is refused by its suffix (argument_checks.validate_args)
                if same(path, other_path):
                    return (
                        f"{what} {str(path)!r} is the same file as {other} {str(other_path)!r}"
                        f"{f' ({why})' if why else ''}: one would replace the other; give {what} another file name"
                    )
        kinds = [k for k in RUN_KINDS if k != "tuned"]
        stem, suffix = self.report_path.stem, self.report_path.suffix
        numbered = rf"{re.escape(stem)}\.({'|'.join(kinds)})-\d+{re.escape(suffix)}"
        for what, path in given:
            if same(path.parent, self.run_dir) and re.fullmatch(TUNER_TABLE, path.name):
                return (
                    f"{what} {str(path)!r} is the name of a tuner table lagom writes in the plan's folder "
                    f"(tuner_table.rank<r>.csv): one would replace the other; give {what} another file name"
                )
            if (
                what == "--lagom-plan"
                and same(path.parent, self.report_path.parent)
                and re.fullmatch(numbered, path.name)
            ):
                return (
                    f"{what} {str(path)!r} is the name of a report lagom writes for a run that does not tune "
                    f"({stem}.<{'|'.join(kinds)}>-<n>{suffix}): one would replace the other; give {what} "
                    "another file name"
                )
        return None

    def may_write(self, path: str | os.PathLike) -> bool:
        """False for a file of a plan that could neither be reused nor moved aside (``keep_user_file``)."""
        return Path(path) not in self._held

    def saved_plan(self, fingerprint: dict[str, Any], cluster: Any = None) -> Any:
        """Collective: the saved plan if reusable, else None (rank 0 moves it to ``plan.corrupt-<sha>.json``,
        ``plan.invalid-<digest>.json`` or ``plan.<digest>.json``); ``consensus.PlanDisagreement``: copies differ."""
        from lagom_megatron.engine.plan import Plan, shown
        from lagom_megatron.megatron import consensus

        if not consensus.broadcast_object(self.plan_path.is_file()):
            if self.rank == 0:
                self._move_earlier_files()
            return None
        plan, error, kept = None, None, None
        if self.rank == 0:
            plan, error, tag = self.read_plan(cluster)
            if tag is not None:
                kept = self._move_aside(tag)
        error, kept = consensus.broadcast_object((error, kept))
        if error is not None:
            say(
                f"lagom: WARNING: cannot reuse plan {self.plan_path}: {error}; "
                f"{f'kept as {kept}' if kept else 'left in place'}; searching a new one"
            )
            return None
        diff = consensus.broadcast_object(plan.fingerprint_mismatch(fingerprint) if plan is not None else None)
        if diff:
            detail = (
                "; ".join(f"{k}: plan {shown(plan.fingerprint, k)} vs run {shown(fingerprint, k)}" for k in diff)
                if plan is not None
                else ""
            )
            kept = self._move_aside(plan.digest()[:12]) if plan is not None else None
            say(
                f"lagom: WARNING: plan {self.plan_path} fingerprint differs in {', '.join(diff)}"
                f"{' (' + detail + ')' if detail else ''}; re-searching and saving there"
                f"{f' (the other plan is kept as {kept})' if kept is not None else ''}"
                f"{STAYS if self.keep_user_file else ''}"
            )
            return None
        return consensus.agree_plan(plan if plan is not None else Plan(entries={}), from_dict=Plan.from_dict)

    def read_plan(self, cluster: Any = None) -> tuple[Any, str | None, str | None]:
        """Reads the plan file, moving nothing: ``(plan, None, None)``, or ``(None, why, tag)`` where ``tag`` is the
        name :meth:`saved_plan` moves it aside under (``corrupt-<sha>``: unreadable; ``invalid-<digest>``: a plan
        ``plan_problem`` rejects for ``cluster``)."""
        from lagom_megatron.config.plan_files import load_plan

        try:
            plan = load_plan(self.plan_path)
        except (ValueError, OSError) as exc:
            return None, str(exc), "corrupt-" + _file_sha(self.plan_path)
        problem = plan_problem(plan, cluster) if cluster is not None else None
        if problem is not None:
            return None, problem, "invalid-" + plan.digest()[:12]
        return plan, None, None

    def plan_to_reuse(self, fingerprint: dict[str, Any], cluster: Any = None) -> Any:
        """This rank's view, before any process group, of the plan :meth:`saved_plan` will reuse: the plan file if
        it reads, ``cluster`` accepts it and its fingerprint matches ``fingerprint``'s keys, else None. Reads only;
        ``saved_plan`` decides later with the whole fingerprint (the agreed capabilities too)."""
        if not self.plan_path.is_file():
            return None
        plan, _, _ = self.read_plan(cluster)
        if plan is None or plan.fingerprint_mismatch(fingerprint):
            return None
        return plan

    def _move_earlier_files(self) -> None:
        sources = self.plan_files()
        if not sources:
            return
        kept = self._move_aside("earlier-" + _file_sha(sources[0]))
        if kept is not None:
            say(
                f"lagom: WARNING: no plan at {self.plan_path}, but this run would write over {len(sources)} "
                f"file(s) there: moved aside as {kept}; searching a new plan"
            )
        else:
            say(
                f"lagom: WARNING: no plan at {self.plan_path}, and {', '.join(str(p) for p in sources)} could not "
                "be moved aside: they stay, and this run writes none of them; searching a new plan"
            )

    def _move_aside(self, tag: str) -> str | None:
        """Moves :meth:`plan_files` to ``<stem>.<tag>[-n]<suffix>``, all or none; None: ``keep_user_file``."""
        sources = self.plan_files()
        base, n = tag, 1
        while any(os.path.lexists(aside_name(p, tag)) for p in sources):
            n += 1
            tag = f"{base}-{n}"
        moved: list[tuple[Path, Path]] = []
        for src in sources:
            dst = aside_name(src, tag)
            try:
                rename_no_replace(src, dst)
            except OSError:
                for done, back in reversed(moved):
                    try:
                        rename_no_replace(back, done)
                    except OSError:
                        pass  # its bytes are safe under the new name; the old one is held below
                self.keep_user_file = True
                self._held = set(self.plan_files(existing=False)) if sources[0] == self.plan_path else set(sources)
                return None
            moved.append((src, dst))
        if sources[0] != self.plan_path:
            return ", ".join(str(d) for _, d in moved)
        (_, plan), *rest = moved
        return f"{plan}" + (f" with {', '.join(str(d) for _, d in rest)}" if rest else "")

    def save_plan(self, plan: Any) -> None:
        """Saves the plan and ``plan.env`` of its process-scope knobs (sourced by the launch scripts: NCCL reads them
        once per process); a knob outside NCCL's domain is logged and left out."""
        from lagom_megatron.nccl.env_file import env_file_path, write_plan_env_file

        if not self.may_write(self.plan_path):
            say(f"lagom: WARNING: plan not saved: {self.plan_path} could not be reused nor moved aside")
            return
        plan.save(self.plan_path)
        if not self.may_write(env_file_path(self.plan_path)):
            say(f"lagom: WARNING: env file not written: {env_file_path(self.plan_path)} could not be moved aside")
            return
        try:
            write_plan_env_file(self.plan_path, plan.env)
        except ValueError as exc:
            say(f"lagom: WARNING: env file for {self.plan_path} not written: {exc}")

    def save_profile(self, profile: Any) -> None:
        """Saves the profile (``engine.profile.Profile``) at ``profile_path`` unless :meth:`may_write` refuses it."""
        if not self.may_write(self.profile_path):
            say(
                f"lagom: WARNING: profile not saved: {self.profile_path} belongs to plan {self.plan_path}, "
                "which could not be reused nor moved aside"
            )
            return
        profile.save(self.profile_path)


def run_fingerprint(args: Any, *, backend: str, cluster: str) -> dict[str, Any]:
    """The model and layout values of ``args`` plus world size, backend, cluster, torch and megatron-core versions."""
    import torch

    from lagom_megatron.megatron.hooks.versions import installed_megatron_core

    # the version Python imports, not pip's: a Megatron-LM checkout on PYTHONPATH shadows megatron-core
    found = installed_megatron_core()
    mcore = found.version if found is not None else "unknown"
    keys = (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "padded_vocab_size",
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "data_parallel_size",
        "sequence_parallel",
        "num_experts",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "use_distributed_optimizer",
        "ddp_bucket_size",
        "bf16",
        "fp16",
    )
    fp: dict[str, Any] = {k: getattr(args, k, None) for k in keys}
    # Megatron-FSDP's strategy decides its sites; None without Megatron-FSDP
    fp["data_parallel_sharding_strategy"] = (
        getattr(args, "data_parallel_sharding_strategy", None) if getattr(args, "use_megatron_fsdp", False) else None
    )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    fp.update(zip(RUN_KEYS, (world_size, backend, cluster, torch.__version__.split("+")[0], mcore), strict=True))
    return fp


RUN_KEYS = ("world_size", "backend", "cluster", "torch", "megatron_core")
"""Fingerprint keys every training run sets, never None: a plan lacking one is never reused (``saved_plan``)."""


def num_microbatches(args: Any) -> int:
    """Micro-batches per iteration: ``args.num_microbatches``, else Megatron-Core's calculator, else 1."""
    n = getattr(args, "num_microbatches", None)
    if not n:
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            n = get_num_microbatches()
        except (ImportError, AssertionError, AttributeError):
            n = 1
    return max(1, int(n))
