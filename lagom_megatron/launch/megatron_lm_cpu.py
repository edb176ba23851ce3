"""CPU mode of a patched Megatron-LM checkout: its own ``pretrain_gpt.py`` loop on gloo (docs/launching.md).
Without CUDA :func:`apply` shims each GPU assumption below (@core_v0.16.1 / 0.17.1 / 0.18.2 / @main 2026-08):
- ``allow_no_cuda``: ``initialize.py:62`` / ``:61`` / ``:58`` / ``:72`` asserts CUDA; ``pretrain`` never passes it
  (``training.py:768`` / ``:885`` / ``:1100`` / ``:1577``).
- GPU architecture, answered 9 (Hopper): ``arguments.py:928`` / ``:1219`` / ``:1399`` / ``:1454`` with TP or CP > 1.
- one device: ``initialize.py:319,330-331,360`` / ``:277,288-289`` / ``:250,261-262`` / ``:277,288-289`` run
  ``initialize_model_parallel`` only when ``device_count() > 0``; no ``nvcc``: ``initialize.py:224,228`` (0.16.1).
- device literals: ``initialize.py:475-512`` / ``:476-513`` / ``:451-488`` / ``:532-570`` (``_warmup_jit_function``),
  ``rerun_state_machine.py:261,265`` / ``:264,268`` (x3), ``training.py`` (11 / 12 / 15 / 15 ``"cuda"`` sites).
- no CUDA streams: ``training.py:1325-1344`` / ``:1481-1499`` / ``:1795-1817`` / ``:2523-2543``, main
  ``training/models/dist_utils.py:346``; dataset helper: ``core/datasets/utils.py:26`` builds with ``PATH``'s
  ``python3`` (``datasets/helpers.py:8`` fails to import): rebuilt with this interpreter's pybind11 and suffix.
- ``triton`` (``-m``): ``@triton.jit`` at import: ``batch_invariant_kernels.py:15`` (0.16.1, via ``initialize.py:25``),
  ``moe/paged_stash.py:8`` (0.18.2, via ``training.py:162``), main ``moe/ops/paged_stash.py:4`` (via
  ``moe/paged_stash.py:12``, ``training.py:126``); core_v0.17.1 mocks it.
core_v0.19.0 keeps these targets (``initialize.py:66``, ``arguments.py:1414``, ``dist_utils.py:303``,
``moe/ops/paged_stash.py:4``); its ``start_grad_sync`` asks for ``current_stream()``, which ``cpu_shims`` answers."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import runpy
import subprocess
import sys
import sysconfig
import types
from typing import Any

from lagom_megatron.training import cpu_shims

GPU_ARCH_VERSION = 9
"""``get_device_arch_version`` on CPU (Hopper)."""

_ORIGINALS: list[tuple[Any, str, Any]] = []
_DEVICE_LITERAL_MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.core.rerun_state_machine",
)
_LATER_MODULES = ("megatron.training.models.dist_utils",)  # core_v0.19+ (dist_utils.py:303, main :346)


def _set(owner: Any, name: str, value: Any) -> None:
    cpu_shims.set_recorded(_ORIGINALS, owner, name, value)


class _CpuCuda(cpu_shims.CpuCuda):
    """``torch.cuda`` for the shimmed modules: one device, no streams, the rest ``torch.cuda``'s."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    Stream = cpu_shims.NoStream

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def build_dataset_helpers() -> None:
    """``compile_helpers`` with this interpreter's pybind11 and suffix; SystemExit(1) as ``datasets/utils.py:30``."""
    import megatron.core.datasets as datasets

    try:
        import pybind11
    except ImportError:
        print(
            "lagom: error: Megatron-LM's dataset helper needs pybind11 (pip install 'lagom-megatron[megatron-lm]')",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
    folder = os.path.dirname(os.path.abspath(datasets.__file__))
    includes = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
    command = ["make", "-C", folder, f"CPPFLAGS={includes}", f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"]
    if subprocess.run(command).returncode != 0:
        print(f"lagom: error: {' '.join(command)} failed (above)", file=sys.stderr, flush=True)
        raise SystemExit(1)


def is_applied() -> bool:
    return bool(_ORIGINALS)


def apply(force: bool = False) -> bool:
    """Installs megatron-core's and the module docstring's shims (with CUDA only if ``force``); True when installed."""
    import torch

    if _ORIGINALS:
        return True
    if torch.cuda.is_available() and not force:
        return False
    cpu_shims.apply(force=force)
    arguments = importlib.import_module("megatron.training.arguments")
    training = importlib.import_module("megatron.training.training")
    original_init = training.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    _set(training, "initialize_megatron", initialize_megatron)
    _set(arguments, "get_device_arch_version", lambda: GPU_ARCH_VERSION)
    with contextlib.suppress(ImportError):  # core_v0.16.x only
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
        _set(fused_kernels, "load", lambda args: None)
    datasets_utils = importlib.import_module("megatron.core.datasets.utils")
    _set(datasets_utils, "compile_helpers", build_dataset_helpers)
    proxy = cpu_shims.make_cpu_torch(_CpuCuda)
    for name in _DEVICE_LITERAL_MODULES:
        _set(importlib.import_module(name), "torch", proxy)
    for name in _LATER_MODULES:
        if importlib.util.find_spec(name.rpartition(".")[0]) is not None and importlib.util.find_spec(name) is not None:
            _set(importlib.import_module(name), "torch", proxy)
    return True


def remove() -> None:
    """Undoes :func:`apply` (no-op when not applied)."""
    cpu_shims.restore(_ORIGINALS)
    cpu_shims.remove()


def _passthrough_decorator(*args: Any, **kwargs: Any) -> Any:
    """``@triton.jit`` and ``@triton.jit(...)`` alike."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda fn: fn


class _TritonStandIn(types.ModuleType):
    """A ``triton`` (or ``triton.language``) that only satisfies imports: attributes are ``MagicMock`` s."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        from unittest.mock import MagicMock

        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


TRITON_IMPORTERS = (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",  # core_v0.16.1 :15
    "megatron.core.transformer.moe.paged_stash",  # core_v0.18.2 :8
    "megatron.core.transformer.moe.ops.paged_stash",  # main :4
)


def _stand_in_modules() -> dict[str, types.ModuleType]:
    triton = _TritonStandIn("triton")
    language = _TritonStandIn("triton.language")
    for module in (triton, language):
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    triton.__version__ = "0.0.0+lagom-cpu-stand-in"
    triton.jit = triton.autotune = triton.heuristics = _passthrough_decorator
    triton.language = language
    language.constexpr = type("constexpr", (), {})
    return {"triton": triton, "triton.language": language}


def import_with_triton_stand_in(modules: tuple[str, ...] = TRITON_IMPORTERS) -> list[str]:
    """Imports the existing ``modules`` under a stand-in ``triton`` (without triton and CUDA), then removes it."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return []
    import torch

    if torch.cuda.is_available():
        return []
    from torch.utils._triton import has_triton_package

    has_triton_package()  # cached False before the stand-in exists
    # jit_fuser is torch.compile, whose stack (inductor's triton_compat) asks for triton: import it before the stand-in
    torch.compile(_passthrough_decorator)

    stand_ins = _stand_in_modules()
    sys.modules.update(stand_ins)
    present = []
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:  # a module (or parent) this release does not have
                if not (exc.name and name.startswith(exc.name)):
                    raise
                continue
            present.append(name)
    finally:
        for key, module in stand_ins.items():
            if sys.modules.get(key) is module:
                del sys.modules[key]
    return present


def main(argv: list[str] | None = None) -> int:
    """Runs SCRIPT [ARGS...] as ``__main__`` with the triton stand-in; 2 when it is missing, else its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(
            "usage: python -m lagom_megatron.launch.megatron_lm_cpu PRETRAIN_GPT_PY [ARGS...]\n"
            "Runs a patched Megatron-LM pretrain_gpt.py on CPU (gloo); see lagom_megatron/launch/megatron_lm_cpu.py.",
            file=sys.stderr if not argv else sys.stdout,
        )
        return 2 if not argv else 0
    script = argv[0]
    if not os.path.isfile(script):
        print(
            f"lagom: error: {script!r} is not a file; give the path of a patched Megatron-LM pretrain_gpt.py",
            file=sys.stderr,
        )
        return 2
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    import_with_triton_stand_in()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
