"""The Megatron-LM patch path: --help answered with lagom's flags before Megatron-LM's own pre-parse,
a fallback when Megatron-LM's help cannot be formatted, finish() on Megatron-LM's sys.exit paths, and
the version gate before the doctor."""

import argparse
import sys
import types
from pathlib import Path

import pytest

from lagom_megatron.launch import megatron_lm
from lagom_megatron.launch.megatron_lm import LagomHooks
from lagom_megatron.megatron.hooks import versions
from lagom_megatron.training.arguments import LAGOM_FLAGS

PATCHES = Path(__file__).resolve().parents[2] / "patches"


@pytest.fixture
def fake_arguments(monkeypatch):
    """megatron.training.arguments.parse_args as Megatron-LM lays it out (parser, provider, parse)."""
    state = {"argv": ["--help"], "fail": None}
    arguments = types.ModuleType("megatron.training.arguments")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
        parser.add_argument("--num-layers", type=int, default=None, help="Megatron-LM's own flag.")
        if state["fail"]:  # as argparse does for a help string with a bare '%'
            parser.add_argument("--broken", help="up to 10%)")
        parser = extra_args_provider(parser) if extra_args_provider else parser
        return parser.parse_args(state["argv"])

    arguments.parse_args = parse_args
    package = types.ModuleType("megatron.training")
    package.arguments = arguments
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    return state


def test_help_lists_megatron_and_lagom_flags(fake_arguments, capsys):
    with pytest.raises(SystemExit) as exc:
        LagomHooks().print_help_if_asked(argv=["--num-layers", "2", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--num-layers" in out
    for flag in LAGOM_FLAGS:
        assert f"  {flag}" in out, flag


def test_help_falls_back_to_lagoms_flags_when_megatron_lms_help_fails(fake_arguments, capsys):
    fake_arguments["fail"] = True
    with pytest.raises(SystemExit) as exc:
        LagomHooks().print_help_if_asked(argv=["-h"])
    assert exc.value.code == 0
    captured = capsys.readouterr()
    assert "Megatron-LM's --help fails on this checkout (unsupported format character" in captured.err
    for flag in LAGOM_FLAGS:
        assert f"  {flag}" in captured.out, flag


def test_no_help_no_parse(fake_arguments):
    fake_arguments["argv"] = None  # parse_args would fail if it were called
    assert LagomHooks().print_help_if_asked(argv=["--num-layers", "2"]) is None


@pytest.mark.parametrize("name", ["megatron-lm-core_v0.16-0.17.patch", "megatron-lm-core_v0.18+.patch"])
def test_patches_answer_help_before_inprocess_restart_pre_parses(name):
    text = (PATCHES / name).read_text()
    assert text.index("+    lagom.print_help_if_asked(") < text.index(
        "inprocess_restart.maybe_wrap_for_inprocess_restart"
    )


class Ends:
    def __init__(self):
        self.events = []

    def on_setup(self, ctx):
        self.events.append("setup")

    def on_iteration_start(self, iteration):
        self.events.append("start")

    def on_iteration_end(self, iteration, elapsed_s, loss):
        self.events.append("end")

    def on_train_end(self):
        self.events.append("train_end")


@pytest.fixture
def fake_training(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # rank 0 locks the run folder, ./lagom_out/run: not in the source tree
    training = types.ModuleType("megatron.training.training")
    training.train_step = (
        lambda forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func: (
            {"lm loss": 1.0},
        )
    )
    package = types.ModuleType("megatron.training")
    package.training = training
    package.get_args = lambda: argparse.Namespace(num_microbatches=1)
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    return training


def test_finish_runs_when_megatron_lm_calls_sys_exit(fake_training, monkeypatch):
    registered, unregistered = [], []
    monkeypatch.setattr(megatron_lm.atexit, "register", registered.append)
    monkeypatch.setattr(megatron_lm.atexit, "unregister", unregistered.append)
    rec = Ends()
    hooks = LagomHooks().start(argparse.Namespace(lagom=True), callbacks=[rec])
    assert registered.count(hooks.finish) == 1  # (imports during start may register their own)

    def pretrain():  # --exit-interval: train() ends in sys.exit(exit_code)
        fake_training.train_step("f", "d", ["m"], "o", "s", "c", "fb")
        sys.exit(0)

    with pytest.raises(SystemExit):
        pretrain()
    assert rec.events == ["setup", "start", "end"]
    registered[registered.index(hooks.finish)]()  # what the interpreter runs at exit
    assert rec.events[-1] == "train_end" and not hooks.active and hooks.finish in unregistered
    hooks.finish()  # the patch's own finish() after pretrain(): nothing more
    assert rec.events.count("train_end") == 1


def test_run_finishes_on_sys_exit(fake_training):
    rec = Ends()
    hooks = LagomHooks().start(argparse.Namespace(lagom=True), callbacks=[rec])

    def pretrain():
        fake_training.train_step("f", "d", ["m"], "o", "s", "c", "fb")
        sys.exit(3)

    with pytest.raises(SystemExit):
        hooks.run(pretrain)
    assert rec.events == ["setup", "start", "end", "train_end"] and not hooks.active


def test_untested_megatron_core_stops_before_the_doctor(fake_training, monkeypatch, capsys):
    fake = versions.InstalledVersion("megatron-core", "0.21.0", "/checkout/megatron/core", True)
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: fake)
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        LagomHooks().start(argparse.Namespace(lagom=True), callbacks=[Ends()])
    assert exc.value.code == 2
    low, high = versions.TESTED_MEGATRON_CORE
    assert capsys.readouterr().out.startswith(
        f"lagom: error: megatron-core 0.21.0 (checkout at /checkout/megatron/core) is outside the tested range "
        f">={low},<{high}. Install a tested version"
    )
    hooks = LagomHooks().start(argparse.Namespace(lagom=True, lagom_allow_untested_versions=True), callbacks=[Ends()])
    assert hooks.active and "running anyway" in capsys.readouterr().out
    hooks.finish()


def test_untested_megatron_core_without_lagom_is_one_warning(fake_training, monkeypatch, capsys):
    """Without --lagom the user asked Megatron-LM, not lagom, to train: the run goes on after one line that names
    the range and what --lagom would need; no hooks are installed."""
    fake = versions.InstalledVersion("megatron-core", "0.21.0", "/checkout/megatron/core", True)
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: fake)
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    hooks = LagomHooks().start(argparse.Namespace(lagom=False), callbacks=[Ends()])
    low, high = versions.TESTED_MEGATRON_CORE
    assert not hooks.active and fake_training.train_step.__name__ != "lagom_train_step"
    assert capsys.readouterr().out == (
        f"lagom: warning: megatron-core 0.21.0 (checkout at /checkout/megatron/core) is outside the tested range "
        f">={low},<{high} (running anyway without --lagom; with --lagom, pass --lagom-allow-untested-versions "
        f"(or set {versions.ALLOW_UNTESTED_ENV}=1))\n"
    )
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: None)
    LagomHooks().start(argparse.Namespace(lagom=False))
    assert capsys.readouterr().out == ""  # a tested (here: no) megatron-core: silent


def _megatron_lm_parse(hooks, argv):
    """Megatron-LM's parser from core_v0.18 on as to this flag (``arguments.py:3023`` @core_v0.19.0), then lagom's."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params")
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    return hooks.chained_provider(None)(parser).parse_args(argv)


@pytest.mark.parametrize("given, warned", [(None, False), ("optim", True)])
def test_megatron_lms_sharding_default_is_no_finding(fake_training, capsys, given, warned):
    """Megatron-LM's own default strategy is not a flag the user gave: no [fsdp-sharding] warning without FSDP."""
    hooks = LagomHooks()
    argv = ["--lagom"] + (["--data-parallel-sharding-strategy", given] if given else [])
    hooks.start(_megatron_lm_parse(hooks, argv), callbacks=[Ends()])
    hooks.finish()
    out = capsys.readouterr().out
    assert (f"[fsdp-sharding] --data-parallel-sharding-strategy {given} without --use-megatron-fsdp" in out) == warned
    assert ("fsdp-sharding" in out) == warned, out


def test_gpu_megatron_lm_check_script_parses_and_refuses_bad_usage(tmp_path):
    import subprocess

    script = PATCHES.parent / "scripts" / "gpu" / "megatron_lm_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert 'timeout --kill-after=10 "$LIMIT_S"' in text  # the run is bounded
    proc = subprocess.run(["bash", str(script), str(tmp_path), str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and "holds no pretrain_gpt.py" in proc.stderr  # no pretrain_gpt.py there


def test_a_lagom_option_without_lagom_stops_the_megatron_lm_run(capsys):
    """Megatron-LM's line parsed with lagom's flags: --lagom-plan alone is refused, not ignored."""
    with pytest.raises(SystemExit) as exc:
        LagomHooks().start(argparse.Namespace(lagom=False, lagom_plan="runs/x/plan.json", lagom_method="priority"))
    assert exc.value.code == 2
    assert capsys.readouterr().out == "lagom: error: --lagom-plan needs --lagom (or drop --lagom-plan)\n"
    hooks = LagomHooks().start(argparse.Namespace(lagom=False, lagom_plan=None, lagom_method="priority"))
    assert not hooks.active  # defaults only: nothing to refuse, nothing installed
