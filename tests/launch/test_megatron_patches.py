"""Megatron-LM patches: the code each patch adds calls functions that exist in lagom_megatron with
matching signatures; and the adapter it calls drives callbacks around a (fake) Megatron-LM
train_step, runs the doctor first, chains the existing extra_args_provider and restores everything."""

import argparse
import ast
import importlib
import inspect
import os
import re
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest

from lagom_megatron.launch.megatron_lm import LagomHooks, chain_extra_args_providers
from tests.launch.megatron_checkout import megatron_lm_checkout

PATCHES = Path(__file__).resolve().parents[2] / "patches"
PATCH_FILES = {"megatron-lm-core_v0.16-0.17.patch": "pretrain", "megatron-lm-core_v0.18+.patch": "parse_args"}


def hunks(patch_text):
    """Post-image lines of each hunk, with the indices of the added lines."""
    out, current = [], None
    for line in patch_text.splitlines():
        if line.startswith("@@"):
            current = ([], [])
            out.append(current)
        elif current is not None and line[:1] in (" ", "+", ""):
            if line.startswith("+"):
                current[1].append(len(current[0]))
            current[0].append(line[1:])
    return out


def added_code(lines, plus):
    """The smallest run of post-image lines holding every added line that parses as Python."""
    for start in range(min(plus), -1, -1):
        for end in range(max(plus) + 1, len(lines) + 1):
            text = textwrap.dedent("\n".join(lines[start:end]))
            try:
                return ast.parse(text)
            except SyntaxError:
                continue
    raise AssertionError(f"added lines do not parse: {[lines[i] for i in plus]}")


def check_calls(tree, namespace, types_of):
    """Binds every call on a lagom object to its signature; returns the names checked."""
    checked = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("lagom_megatron"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                namespace[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and inspect.isclass(namespace.get(func.id)):
                types_of[node.targets[0].id] = namespace[func.id]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, fn, label = node.func, None, None
        if isinstance(func, ast.Name) and func.id in namespace:
            fn, label = namespace[func.id], func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in types_of:
            cls = types_of[func.value.id]
            assert hasattr(cls, func.attr), f"{cls.__name__} has no attribute {func.attr!r}"
            fn, label = getattr(cls(), func.attr), f"{cls.__name__}.{func.attr}"
        if fn is None:
            continue
        positional = [object()] * len(node.args)
        keywords = {k.arg: object() for k in node.keywords}
        inspect.signature(fn).bind(*positional, **keywords)  # raises TypeError on a mismatch
        checked.append(label)
    return checked


@pytest.mark.parametrize("name,entry", sorted(PATCH_FILES.items()))
def test_added_code_calls_existing_functions_with_matching_signatures(name, entry):
    text = (PATCHES / name).read_text()
    namespace, types_of, checked = {}, {}, []
    for lines, plus in hunks(text):
        if plus:
            checked += check_calls(added_code(lines, plus), namespace, types_of)
    assert checked == ["LagomHooks", "LagomHooks.print_help_if_asked", f"LagomHooks.{entry}"] + (
        ["LagomHooks.finish"] if entry == "parse_args" else []
    )
    # the call passes the provider pretrain_gpt.py already had, and the entry takes it by keyword
    assert "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None," in text
    assert "extra_args_provider" in inspect.signature(getattr(LagomHooks, entry)).parameters


@pytest.mark.parametrize("name", sorted(PATCH_FILES))
def test_patch_is_a_git_patch_of_pretrain_gpt_only(name):
    text = (PATCHES / name).read_text()
    assert text.count("diff --git a/pretrain_gpt.py b/pretrain_gpt.py") == 1
    assert "--- a/pretrain_gpt.py" in text and "+++ b/pretrain_gpt.py" in text
    removed = [l for l in text.splitlines() if l.startswith("-") and not l.startswith("---")]
    assert len(removed) == 1  # one line replaced: the call that gets lagom's wrapper


# ---------------------------------------------------------------------------- adapter with fakes


class Recorder:
    def __init__(self):
        self.events = []

    def on_setup(self, ctx):
        self.events.append(("setup", ctx))

    def on_iteration_start(self, iteration):
        self.events.append(("start", iteration))

    def on_iteration_end(self, iteration, elapsed_s, loss):
        self.events.append(("end", iteration, loss))

    def on_train_end(self):
        self.events.append(("train_end",))


@pytest.fixture
def fake_megatron(monkeypatch, tmp_path):
    """megatron.training with train_step, get_args and parse_args, as Megatron-LM lays them out; the
    run folder (./lagom_out/run, whose lock rank 0 takes) lies under tmp_path."""
    from lagom_megatron.preflight.files import _HELD, release_folder_lock

    monkeypatch.chdir(tmp_path)
    held = set(_HELD)
    yield from _fake_megatron(monkeypatch)
    for folder in set(_HELD) - held:
        release_folder_lock(folder)


def _fake_megatron(monkeypatch):
    state = {"args": None, "argv": []}
    training = types.ModuleType("megatron.training.training")

    def train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        iteration=None,
    ):
        return ({"lm loss": 2.5},) + (False,) * 6

    training.train_step = train_step
    package = types.ModuleType("megatron.training")
    package.get_args = lambda: state["args"]
    arguments = types.ModuleType("megatron.training.arguments")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        for flag in ("--tensor-model-parallel-size", "--num-layers", "--num-attention-heads"):
            parser.add_argument(flag, type=int, default=1)
        parser = extra_args_provider(parser) if extra_args_provider else parser
        args = parser.parse_args(state["argv"])
        args.world_size, args.num_microbatches = 2, 4
        return args

    arguments.parse_args = parse_args
    package.training, package.arguments = training, arguments
    for name, mod in (
        ("megatron.training", package),
        ("megatron.training.training", training),
        ("megatron.training.arguments", arguments),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("LAGOM_CLUSTER", "h100-sxm-ib400")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from lagom_megatron.launch import megatron_lm_cpu

    cpu_mode_calls = []  # the CPU shims need a real checkout (tests/launch/test_megatron_lm_real_loop.py)
    monkeypatch.setattr(megatron_lm_cpu, "apply", lambda force=False: cpu_mode_calls.append(1) or True)
    yield types.SimpleNamespace(
        training=training, state=state, original=train_step, parse_args=parse_args, cpu_mode_calls=cpu_mode_calls
    )


def run_fake_pretrain(fake, steps):
    def pretrain(train_ds, model_provider, model_type, forward_step, extra_args_provider=None, **kw):
        fake.state["args"] = fake.parse_args(extra_args_provider)
        model = [types.SimpleNamespace(ddp_config="ddp-config")]
        for i in range(steps):
            # Megatron-LM's train() looks train_step up as a module global, as here
            fake.training.train_step(
                forward_step, "data-iter", model, "optimizer", "scheduler", "config", "fwd-bwd", iteration=i
            )
        return "done"

    return pretrain


def test_old_api_drives_callbacks_and_restores(fake_megatron, monkeypatch):
    fake_megatron.state["argv"] = ["--lagom", "--num-layers", "4", "--num-attention-heads", "4"]
    rec = Recorder()
    hooks = LagomHooks()
    monkeypatch.setattr(LagomHooks, "start", _start_with(rec, LagomHooks.start))
    seen_providers = []

    def modelopt_provider(parser):
        seen_providers.append("modelopt")
        parser.add_argument("--modelopt-flag", action="store_true")
        return parser

    out = hooks.pretrain(
        run_fake_pretrain(fake_megatron, 3),
        "ds",
        "mp",
        "encoder_or_decoder",
        "fwd",
        extra_args_provider=modelopt_provider,
        store=None,
    )
    assert out == "done"
    assert seen_providers == ["modelopt", "modelopt"]  # pre-parse and pretrain's own parse
    kinds = [e[0] for e in rec.events]
    assert kinds == ["setup", "start", "end", "start", "end", "start", "end", "train_end"]
    ctx = rec.events[0][1]
    assert (ctx.optimizer, ctx.data_iterator, ctx.forward_backward_func, ctx.ddp_config) == (
        "optimizer",
        "data-iter",
        "fwd-bwd",
        "ddp-config",
    )
    assert ctx.args.lagom is True and ctx.args.num_microbatches == 4
    assert [e[1] for e in rec.events if e[0] == "start"] == [1, 2, 3]
    assert rec.events[2][2] == 2.5
    assert fake_megatron.training.train_step is fake_megatron.original and not hooks.active
    assert fake_megatron.cpu_mode_calls == [1]  # before the pre-parse: validate_args asks for the GPU


def _start_with(recorder, original_start):
    def start(self, args, **kw):
        return original_start(self, args, callbacks=[recorder])

    return start


def test_new_api_parse_then_finish(fake_megatron, monkeypatch):
    fake_megatron.state["argv"] = ["--lagom"]
    rec = Recorder()
    monkeypatch.setattr(LagomHooks, "start", _start_with(rec, LagomHooks.start))
    hooks = LagomHooks()

    def parse_and_validate_args(extra_args_provider, args_defaults):
        return fake_megatron.parse_args(extra_args_provider)

    args = hooks.parse_args(parse_and_validate_args, extra_args_provider=None, args_defaults={})
    assert args.lagom is True and hooks.active
    assert fake_megatron.training.train_step is not fake_megatron.original
    fake_megatron.state["args"] = args
    fake_megatron.training.train_step("f", "d", ["m"], "o", "s", "c", "fb")
    hooks.finish()
    assert [e[0] for e in rec.events] == ["setup", "start", "end", "train_end"]
    assert fake_megatron.training.train_step is fake_megatron.original
    assert fake_megatron.cpu_mode_calls == [1]


TORCHRUN_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
"""What plain ``torchrun`` gives each rank: no NCCL_TUNER_PLUGIN, no LAGOM_TUNER_CONFIG."""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (the plugin is built with it)")
def test_plain_torchrun_on_a_gpu_enables_the_tuner_plugin_before_the_first_communicator(
    fake_megatron, monkeypatch, tmp_path
):
    """A GPU run (CUDA stood in) started by plain torchrun: ``start`` sets NCCL_TUNER_PLUGIN to lagom's
    library and an empty LAGOM_TUNER_CONFIG before ``pretrain`` (whose initialize_megatron creates the
    first NCCL communicator, which is when NCCL loads a tuner) runs, as scripts/pretrain_gpt.py does."""
    import torch

    for name in ("NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "LAGOM_TUNER_CONFIG"):  # absent, and absent again after
        monkeypatch.setenv(name, "")  # the test (start() writes os.environ itself)
        monkeypatch.delenv(name)
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LAGOM_TUNER_DIR", str(tmp_path / "plugin"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    fake_megatron.state["argv"] = ["--lagom"]
    rec = Recorder()
    monkeypatch.setattr(LagomHooks, "start", _start_with(rec, LagomHooks.start))
    seen = {}
    pretrain = run_fake_pretrain(fake_megatron, 1)

    def pretrain_seeing_env(*args, **kwargs):
        seen.update({k: os.environ.get(k) for k in ("NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "LAGOM_TUNER_CONFIG")})
        return pretrain(*args, **kwargs)

    LagomHooks().pretrain(pretrain_seeing_env, "ds", "mp", "t", "fwd", extra_args_provider=None)
    library = (tmp_path / "plugin" / "libnccl-tuner-lagom.so").resolve()
    assert seen == {"NCCL_TUNER_PLUGIN": str(library), "NCCL_PROFILER_PLUGIN": str(library), "LAGOM_TUNER_CONFIG": ""}
    assert library.is_file() and [e[0] for e in rec.events] == ["setup", "start", "end", "train_end"]


def test_gloo_or_no_cuda_leaves_the_plugin_unset(monkeypatch):
    """Without CUDA, or with --distributed-backend gloo, no NCCL runs: nothing is set."""
    import torch

    from lagom_megatron.launch.megatron_lm import enable_tuner_plugin

    env = {}
    assert enable_tuner_plugin(argparse.Namespace(distributed_backend="nccl"), env) is None and env == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert enable_tuner_plugin(argparse.Namespace(distributed_backend="gloo"), env) is None and env == {}


def test_without_lagom_nothing_is_installed(fake_megatron):
    fake_megatron.state["argv"] = []
    hooks = LagomHooks()
    hooks.pretrain(run_fake_pretrain(fake_megatron, 1), "ds", "mp", "t", "fwd", extra_args_provider=None)
    assert hooks.callbacks == [] and fake_megatron.training.train_step is fake_megatron.original


def test_doctor_errors_stop_before_pretrain(fake_megatron, capsys):
    fake_megatron.state["argv"] = ["--lagom", "--tensor-model-parallel-size", "3", "--num-layers", "4"]
    called = []
    with pytest.raises(SystemExit) as exc:
        LagomHooks().pretrain(lambda *a, **k: called.append(1), extra_args_provider=None)
    assert exc.value.code == 1 and called == []
    out = capsys.readouterr().out
    assert "[world-size] world size 2 is not divisible by TP x PP x CP = 3 x 1 x 1 = 3" in out
    assert fake_megatron.training.train_step is fake_megatron.original


def test_start_refuses_twice(fake_megatron):
    args = argparse.Namespace(lagom=True, world_size=2, tensor_model_parallel_size=1)
    hooks = LagomHooks().start(args, callbacks=[Recorder()])
    with pytest.raises(RuntimeError, match="already installed"):
        hooks.start(args, callbacks=[Recorder()])
    hooks.finish()
    assert fake_megatron.training.train_step is fake_megatron.original


def test_chain_extra_args_providers():
    order = []

    def a(parser):
        order.append("a")
        parser.add_argument("--a")
        return parser

    def b(parser):  # returns None: the same parser goes on
        order.append("b")
        parser.add_argument("--b")

    parser = chain_extra_args_providers(a, None, b)(argparse.ArgumentParser())
    assert order == ["a", "b"] and parser.parse_args(["--a", "1", "--b", "2"]).b == "2"


def test_adapter_matches_the_controller_and_training_context():
    """The adapter builds TrainingContext by keyword and calls the controller's four callbacks."""
    from lagom_megatron.megatron.control.controller import LagomController
    from lagom_megatron.training.loop import TrainingContext

    inspect.signature(LagomController.from_args).bind(argparse.Namespace())
    for name, n_args in (("on_setup", 1), ("on_iteration_start", 1), ("on_iteration_end", 3), ("on_train_end", 0)):
        inspect.signature(getattr(LagomController, name)).bind(object(), *[object()] * n_args)
    source = inspect.getsource(LagomHooks._on_setup)
    used = set(re.findall(r"\b(\w+)=", source.split("TrainingContext(")[1].split(")\n")[0]))
    assert used == set(inspect.signature(TrainingContext).parameters)


@pytest.mark.skipif(megatron_lm_checkout()[0] is None, reason=megatron_lm_checkout()[1])
def test_the_checkout_holds_exactly_one_of_the_patches():
    """The checkout's pretrain_gpt.py is a release's with one of ``patches/`` applied (``git apply --check -R``):
    core_v0.16/0.17 take the first, core_v0.18, 0.19 and main the second."""
    import subprocess

    checkout = megatron_lm_checkout()[0]
    applied = [
        name
        for name in PATCH_FILES
        if subprocess.run(
            ["git", "apply", "--check", "--reverse", str(PATCHES / name)], cwd=checkout, capture_output=True
        ).returncode
        == 0
    ]
    assert len(applied) == 1, applied
