"""Which cluster a run is checked against, for ``lagom doctor`` and ``pretrain_gpt.py`` (torch only if CUDA may be)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CPU_CLUSTER = "cpu-gloo"


def load_cluster(name: str, source: str) -> Any:
    """``ClusterSpec.load(name)``; ValueError ``<source>=<name>: ...`` (known names, or the file's error)."""
    from lagom_megatron.engine.cluster import ClusterSpec, available_clusters

    try:
        return ClusterSpec.load(name)
    except FileNotFoundError:
        raise ValueError(
            f"{source}={name!r} is not a known cluster or a cluster file; allowed: "
            f"{', '.join(available_clusters())} or a path to a cluster YAML"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{source}={name!r}: {exc}") from None


def cuda_certainly_absent() -> bool:
    """True when ``torch.cuda.is_available()`` is certainly False, without importing torch: ``cuda`` and ``hip``
    None in ``torch/version.py``, or a Linux CUDA build without a loadable ``libcuda.so.1``. False: ask torch."""
    import ast
    import importlib.util
    import sys
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")
        folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
        tree = ast.parse((folder / "version.py").read_text(encoding="utf-8")) if folder else None
    except (ImportError, ValueError, OSError, SyntaxError):
        return False
    build: dict[str, Any] = {}
    for node in tree.body if tree else ():
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else getattr(node, "target", None)
            if isinstance(node, ast.AnnAssign)
            else None
        )
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and node.value is not None:
            try:
                build[target.id] = ast.literal_eval(node.value)
            except ValueError:
                return False
    if set(build) != {"cuda", "hip"} or build["hip"] is not None:
        return False
    if build["cuda"] is None:
        return True
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def cluster_field(cluster: Any, name: str) -> Any:
    if isinstance(cluster, Mapping):
        return cluster.get(name)
    return getattr(cluster, name, None)


@dataclass(frozen=True)
class Machine:
    """This machine's CUDA GPU (or none), compute capability and NCCL."""

    cuda: bool
    sm_arch: int | None = None
    """Compute capability x 10 (90 = Hopper)."""
    nccl_version: str | None = None

    def describe(self) -> str:
        """``no CUDA GPU`` or ``a CUDA GPU of compute capability sm_90 (NCCL 2.27.5)``."""
        if not self.cuda:
            return "no CUDA GPU"
        return f"a CUDA GPU of compute capability sm_{self.sm_arch} (NCCL {self.nccl_version})"


def this_machine() -> Machine:
    """This machine's :class:`Machine` (no torch: no CUDA GPU)."""
    if cuda_certainly_absent():
        return Machine(cuda=False)
    try:
        import torch
    except ImportError:
        return Machine(cuda=False)

    if not torch.cuda.is_available():
        return Machine(cuda=False)
    major, minor = torch.cuda.get_device_capability()
    nccl = torch.cuda.nccl.version()
    return Machine(
        cuda=True,
        sm_arch=major * 10 + minor,
        nccl_version=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    )


@dataclass(frozen=True)
class Target:
    """The cluster a run is checked against and what chose it."""

    cluster: Any
    """A ``ClusterSpec``, or a dict for this machine's GPU."""
    source: str
    """``flag``, ``env``, ``preset`` or ``machine``."""
    chosen_by: str

    @property
    def name(self) -> str:
        """The cluster's name (``this machine's GPU`` for a GPU without a cluster file)."""
        return str(cluster_field(self.cluster, "name") or "this machine's GPU")

    def reason(self) -> str:
        """Why this cluster, in words, with what would choose another."""
        if self.source == "flag":
            return f"named by {self.chosen_by}"
        if self.source == "env":
            return "named by $LAGOM_CLUSTER (--cluster checks another)"
        if self.source == "preset":
            return f"the cluster of {self.chosen_by} (--cluster or $LAGOM_CLUSTER checks another)"
        return "this machine (--preset, --cluster or $LAGOM_CLUSTER checks another)"

    def describe(self) -> str:
        """``cluster 'h100-sxm-ib400' (NCCL 2.27.5, sm_90 GPUs)`` or ``cluster 'cpu-gloo' (gloo, CPU)``."""
        if cluster_field(self.cluster, "backend") == "gloo":
            return f"cluster {self.name!r} (gloo, CPU)"
        return (
            f"cluster {self.name!r} (NCCL {cluster_field(self.cluster, 'nccl_version')}, "
            f"sm_{cluster_field(self.cluster, 'sm_arch')} GPUs)"
        )


def choose_cluster(
    preset: Any,
    environ: Mapping[str, str] | None = None,
    given: str | None = None,
    given_by: str = "--cluster",
    machine: Machine | None = None,
) -> Target:
    """``given``, else ``$LAGOM_CLUSTER``, the preset's (a loaded ``Preset``, or a name or path to load), this machine
    (no CUDA: ``cpu-gloo``); ValueError if unknown."""
    environ = os.environ if environ is None else environ
    if given:
        return Target(load_cluster(given, given_by), "flag", given_by)
    if environ.get("LAGOM_CLUSTER"):
        return Target(load_cluster(environ["LAGOM_CLUSTER"], "LAGOM_CLUSTER"), "env", "LAGOM_CLUSTER")
    if preset:
        from lagom_megatron.config.presets import Preset, load_preset

        if not isinstance(preset, Preset):
            preset = load_preset(preset)
        return Target(
            load_cluster(preset.cluster, f"preset {preset.name!r} cluster"), "preset", f"preset {preset.name!r}"
        )
    machine = this_machine() if machine is None else machine
    if not machine.cuda:
        return Target(load_cluster(CPU_CLUSTER, "cluster"), "machine", "this machine")
    local = environ.get("LOCAL_WORLD_SIZE", "")
    return Target(
        {
            "gpus_per_node": int(local) if local.strip().isdigit() else None,
            "sm_arch": machine.sm_arch,
            "backend": "nccl",
            "nccl_version": machine.nccl_version,
        },
        "machine",
        "this machine",
    )


def mismatch(target: Target, machine: Machine) -> str | None:
    """Why this machine cannot run ``target`` (NCCL without CUDA, another ``sm_arch``) and the flag to use, or None."""
    if cluster_field(target.cluster, "backend") != "nccl":
        return None
    chosen = f"{target.chosen_by} is for" if target.source == "preset" else f"{target.chosen_by} chose"
    # the flag is on the line already when it chose the cluster: say what to give it instead
    instead = f" instead of {target.chosen_by} {target.name}" if target.source == "flag" else ""
    if not machine.cuda:
        return (
            f"{chosen} {target.describe()} but this machine has {machine.describe()} ({CPU_CLUSTER}); "
            f"run it on that cluster (lagom doctor checks it from here), or to run it on CPU anyway "
            f"{'use' if instead else 'add'} --lagom-cluster {CPU_CLUSTER}{instead}"
        )
    sm = cluster_field(target.cluster, "sm_arch")
    if sm and machine.sm_arch and int(sm) != machine.sm_arch:
        from lagom_megatron.engine.cluster import ClusterSpec, available_clusters

        same = [n for n in available_clusters() if ClusterSpec.load(n).sm_arch == machine.sm_arch]
        hint = f" ({', '.join(same)} or a cluster YAML)" if same else " (a cluster YAML describing it)"
        return (
            f"{chosen} {target.describe()} but this machine has {machine.describe()}; "
            f"name a cluster of this GPU with --lagom-cluster{hint}{instead}"
        )
    return None
