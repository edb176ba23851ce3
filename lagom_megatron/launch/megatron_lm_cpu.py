"""CPU mode of a patched Megatron-LM checkout: Megatron-LM's own ``pretrain_gpt.py`` loop on gloo.

    torchrun --standalone --nproc-per-node 4 -m lagom_megatron.launch.megatron_lm_cpu pretrain_gpt.py \\
        --distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion \\
        --no-persist-layer-norm --eval-interval 10 --eval-iters 1 <model, batch and data flags> --lagom

Megatron-LM's ``megatron/training`` assumes a GPU in a few places that megatron-core's CPU shims
(``lagom_megatron.training.cpu_shims``) do not reach. :func:`apply` installs those shims and the
ones below, only when CUDA is absent; :func:`remove` restores every original. ``LagomHooks`` (the
code the patches add) calls :func:`apply` before it parses, so plain ``torchrun pretrain_gpt.py``
gets them too when ``triton`` is installed; this module's ``main`` (``-m``, above) also gives
``triton`` a stand-in before ``pretrain_gpt.py`` imports anything, which is the only thing it
adds. Line numbers are of Megatron-LM's tags core_v0.16.1 / core_v0.17.1 / core_v0.18.2 and of
its main branch of 2026-08 (``main``):

======================  ===========================================================================
shim                    the Megatron-LM line it answers
======================  ===========================================================================
``allow_no_cuda``       ``initialize.py:62`` / ``:61`` / ``:58`` / main ``:72`` assert
                        ``torch.cuda.is_available()`` unless ``initialize_megatron(allow_no_cuda=True)``,
                        which ``pretrain`` never passes (``training.py:768`` / ``:885`` / ``:1100`` /
                        main ``:1577``)
GPU architecture        ``arguments.py:928`` / ``:1219`` / ``:1399`` / main ``:1454``:
                        ``get_device_arch_version()`` (``torch.cuda.get_device_properties``) with
                        TP or CP > 1; answered as 9 (Hopper), which keeps
                        ``CUDA_DEVICE_MAX_CONNECTIONS`` checks as on most clusters
one device              ``initialize.py:319,330-331,360`` / ``:277,288-289`` / ``:250,261-262`` /
                        main ``:277,288-289``: ``mpu.initialize_model_parallel`` runs only when
                        ``torch.cuda.device_count() > 0``, after ``torch.cuda.set_device``
no ``nvcc``             ``initialize.py:224,228`` (core_v0.16.1 only) ``fused_kernels.load`` runs
                        ``CUDA_HOME/bin/nvcc``; it builds nothing training needs there
device literals         ``initialize.py:475-512`` (``_warmup_jit_function``, ``torch.rand`` on
                        ``"cuda"``; ``:476-513`` / ``:451-488`` / main ``:532-570``),
                        ``rerun_state_machine.py:261,265`` / ``:264,268`` (x3), and
                        ``training.py`` (11 / 12 / 15 / 15 ``device="cuda"`` or
                        ``current_device()`` sites: start-time all-reduce, loss and
                        evaluation reductions)
no CUDA streams         ``training.py:1325-1344`` / ``:1481-1499`` / ``:1795-1817`` / main
                        ``:2523-2543`` and main ``training/models/dist_utils.py:346``: ``get_model``
                        builds DDP inside ``torch.cuda.stream(...)``
dataset helper build    ``core/datasets/utils.py:26`` runs ``make`` in ``megatron/core/datasets``, whose
                        Makefile asks the ``python3`` / ``python3-config`` on ``PATH`` for pybind11's
                        includes and the extension suffix (another interpreter's suffix makes
                        ``datasets/helpers.py:8`` fail to import the result); the same ``make`` is run
                        with this interpreter's values
``triton`` (``-m``)     ``batch_invariant_kernels.py:15`` (core_v0.16.1, imported by
                        ``initialize.py:25``) and ``moe/paged_stash.py:8`` (core_v0.18.2, imported by
                        ``training.py:162``; main ``moe/ops/paged_stash.py:4``, through
                        ``moe/paged_stash.py:12`` from ``training.py:126``) import it
                        unconditionally and decorate kernels with ``@triton.jit`` at import time;
                        core_v0.17.1 falls back to a ``MagicMock`` itself. The stand-in is a module
                        whose every attribute is a ``MagicMock`` and whose ``jit`` / ``autotune`` /
                        ``heuristics`` return the function: no kernel runs on CPU
======================  ===========================================================================
"""

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
"""What ``get_device_arch_version`` answers on CPU: 9 (Hopper; 10 would be Blackwell)."""

_ORIGINALS: list[tuple[Any, str, Any]] = []
_DEVICE_LITERAL_MODULES = ("megatron.training.initialize", "megatron.training.training",
                           "megatron.core.rerun_state_machine")
"""Megatron-LM modules that allocate on ``"cuda"`` (table above); each gets a torch proxy."""
_LATER_MODULES = ("megatron.training.models.dist_utils",)
"""The same, in releases that have them (main: ``_ddp_wrap`` builds DDP in a CUDA stream, ``dist_utils.py:346``)."""


def _set(owner: Any, name: str, value: Any) -> None:
    cpu_shims.set_recorded(_ORIGINALS, owner, name, value)


class _NoStream:
    """``torch.cuda.Stream`` on CPU: waiting does nothing (gloo's work is synchronous on the CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as the shimmed Megatron-LM modules see it: one device, no streams; every other
    attribute is ``torch.cuda``'s own."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cuda, name)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    Stream = _NoStream

    @staticmethod
    def current_stream(device: Any = None) -> _NoStream:
        return _NoStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _megatron_lm_torch() -> types.ModuleType:
    """megatron-core's CPU torch proxy (CUDA devices of tensor factories -> CPU) with ``cuda`` = :class:`_CpuCuda`."""
    proxy = cpu_shims.make_cpu_torch()
    proxy.cuda = _CpuCuda("lagom_cpu_torch.cuda")
    return proxy


def build_dataset_helpers() -> None:
    """Megatron-LM's ``compile_helpers`` with this interpreter's pybind11 includes and extension suffix.

    Runs the same ``make -C megatron/core/datasets`` with ``CPPFLAGS`` and ``LIBEXT`` given on the
    command line (they override the Makefile's ``python3 -m pybind11 --includes`` and
    ``python3-config --extension-suffix``, which would ask whatever ``python3`` is first on ``PATH``).

    Raises:
        SystemExit: code 1 when ``make`` fails or pybind11 is not installed, as Megatron-LM's own
            ``compile_helpers`` exits (``core/datasets/utils.py:30``), after saying why.
    """
    import megatron.core.datasets as datasets

    try:
        import pybind11
    except ImportError:
        print("lagom: error: Megatron-LM's dataset helper needs pybind11 (pip install 'lagom-megatron[megatron-lm]')",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    folder = os.path.dirname(os.path.abspath(datasets.__file__))
    includes = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
    command = ["make", "-C", folder, f"CPPFLAGS={includes}", f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"]
    if subprocess.run(command).returncode != 0:
        print(f"lagom: error: {' '.join(command)} failed (above)", file=sys.stderr, flush=True)
        raise SystemExit(1)


def is_applied() -> bool:
    """True while the Megatron-LM shims are installed."""
    return bool(_ORIGINALS)


def apply(force: bool = False) -> bool:
    """Installs megatron-core's CPU shims and the Megatron-LM ones of the module docstring.

    Needs a Megatron-LM checkout on ``sys.path`` (``megatron.training`` importable).

    Args:
        force: install even if CUDA is available (tests only).

    Returns:
        True when installed (now or earlier), False on a machine with CUDA (nothing changed).
    """
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
    proxy = _megatron_lm_torch()
    for name in _DEVICE_LITERAL_MODULES:
        _set(importlib.import_module(name), "torch", proxy)
    for name in _LATER_MODULES:
        if importlib.util.find_spec(name.rpartition(".")[0]) is not None and importlib.util.find_spec(name) is not None:
            _set(importlib.import_module(name), "torch", proxy)
    return True


def remove() -> None:
    """Restores every original of :func:`apply`, then megatron-core's shims (no-op when not applied)."""
    cpu_shims.restore(_ORIGINALS)
    cpu_shims.remove()


def _passthrough_decorator(*args: Any, **kwargs: Any) -> Any:
    """``@triton.jit`` and ``@triton.jit(...)`` alike: the function itself."""
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
    "megatron.core.transformer.moe.paged_stash",                        # core_v0.18.2 :8
    "megatron.core.transformer.moe.ops.paged_stash",                    # main :4
)
"""Megatron-LM modules that import triton unconditionally (the table's last row); those the checkout has
are imported under the stand-in."""


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
    """Imports the Megatron-LM modules of ``modules`` that exist, with a stand-in ``triton`` and
    ``triton.language`` in ``sys.modules`` only while they import, when triton is absent and CUDA is
    too (the table's last row). The modules keep the stand-in as their global; afterwards ``import
    triton`` fails again as it should, so torch (``torch.utils._triton.has_triton_package``, whose
    answer torch's compiler caches, asked here before the stand-in exists) never sees it.

    Returns:
        The modules imported under the stand-in (empty when triton is installed, or CUDA is available).
    """
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return []
    import torch

    if torch.cuda.is_available():
        return []
    from torch.utils._triton import has_triton_package

    has_triton_package()  # cached False before the stand-in exists
    # megatron-core's jit_fuser is torch.compile: decorating imports torch's compiler stack (dynamo,
    # inductor, inductor's triton_compat), which asks for triton; import it now, without the stand-in
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
    """``python -m lagom_megatron.launch.megatron_lm_cpu SCRIPT [ARGS...]``: runs SCRIPT as ``__main__``
    with the triton stand-in (when needed) in place; the script's folder leads ``sys.path``, as
    ``python SCRIPT`` would have it.

    Returns:
        2 with a usage line when no script is given or it does not exist; else what the script exits with.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print("usage: python -m lagom_megatron.launch.megatron_lm_cpu PRETRAIN_GPT_PY [ARGS...]\n"
              "Runs a patched Megatron-LM pretrain_gpt.py on CPU (gloo); see lagom_megatron/launch/megatron_lm_cpu.py.",
              file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"lagom: error: {script!r} is not a file; give the path of a patched Megatron-LM pretrain_gpt.py",
              file=sys.stderr)
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
