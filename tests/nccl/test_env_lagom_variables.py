"""``nccl.env_vars.LAGOM_VARIABLES``, the one table of NCCL variables that change what lagom tunes, sees or reads:
each one set is named once, by ``lagom doctor`` and by training's pre-flight, saying what lagom loses."""

from __future__ import annotations

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.nccl.capabilities import P2P_SWITCHES
from lagom_megatron.nccl.env_check import override_issues
from lagom_megatron.nccl.env_vars import LAGOM_VARIABLES
from tests.training.preflight_harness import _env

TRIGGERS = {  # a value of each variable that changes lagom (with NCCL_DEBUG=WARN: NCCL writes its file)
    "NCCL_MIN_CTAS": "2",
    "NCCL_MAX_CTAS": "8",
    "NCCL_CGA_CLUSTER_SIZE": "2",
    "NCCL_CTA_POLICY": "1",
    "NCCL_NVLS_NCHANNELS": "16",
    "NCCL_MIN_NCHANNELS": "2",
    "NCCL_MAX_NCHANNELS": "8",
    "NCCL_NCHANNELS_PER_NET_PEER": "2",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "^LL128",
    "NCCL_TUNER_PLUGIN": "libnccl-tuner-other.so",
    "NCCL_MIN_P2P_NCHANNELS": "2",
    "NCCL_MAX_P2P_NCHANNELS": "4",
    "NCCL_PROFILER_PLUGIN": "/opt/site/libnccl-profiler-user.so",
    "NCCL_DEBUG_FILE": "/scratch/nccl.log",
}


def test_every_variable_of_the_table_is_named_once_when_set():
    assert set(TRIGGERS) == set(LAGOM_VARIABLES)
    issues = override_issues({**TRIGGERS, "NCCL_DEBUG": "WARN"})
    assert sorted(i.variable for i in issues) == sorted(LAGOM_VARIABLES)
    assert all(i.level == "warning" and i.value == TRIGGERS[i.variable] for i in issues)
    assert override_issues({"NCCL_DEBUG": "WARN"}) == []


def test_the_p2p_channel_variables_are_those_the_run_reads():
    """NCCL's two P2P channel bounds (``src/graph/paths.cc:957-958`` @v2.30.7-1), which the run's capabilities record."""
    assert (
        {v for v, (effect, _) in LAGOM_VARIABLES.items() if effect == "p2p-channels"}
        == set(P2P_SWITCHES)
        == {
            "NCCL_MIN_P2P_NCHANNELS",
            "NCCL_MAX_P2P_NCHANNELS",
        }
    )
    (issue,) = override_issues({"NCCL_MAX_P2P_NCHANNELS": "4"})
    assert issue.what == (
        "NCCL_MAX_P2P_NCHANNELS='4' bounds the channels of every send/recv: lagom's n_channels knob for the send/recv "
        "sites keeps only the values NCCL can still run, and leaves the search when one is left"
    )
    assert issue.fix == "unset NCCL_MAX_P2P_NCHANNELS to let lagom search the send/recv channels"


@pytest.mark.parametrize(
    "env, what",
    [
        (
            {"NCCL_PROFILER_PLUGIN": "/opt/site/libnccl-profiler-user.so"},
            "NCCL_PROFILER_PLUGIN='/opt/site/libnccl-profiler-user.so' names another profiler plugin, which lagom "
            "never replaces: lagom checks only the tuner's row hits, not what NCCL ran",
        ),
        (
            {"NCCL_PROFILER_PLUGIN": "None"},
            "NCCL_PROFILER_PLUGIN='none' disables profiler plugins: lagom checks only the tuner's row hits, not what "
            "NCCL ran",
        ),
        ({"NCCL_PROFILER_PLUGIN": "/build/libnccl-tuner-lagom.so"}, None),
        ({"NCCL_PROFILER_PLUGIN": "/opt/p.so", "NCCL_TUNER_PLUGIN": "/opt/p.so"}, None),  # the tuner's library
    ],
)
def test_a_users_profiler_plugin_is_named_without_lagoms_tuner_plugin(env, what):
    """It was named only when ``NCCL_TUNER_PLUGIN`` named lagom's library, so a plain doctor said nothing."""
    assert [i.what for i in override_issues(env)] == ([what] if what else [])


@pytest.mark.parametrize(
    "debug, file, what",
    [
        (
            None,
            "nccl.%h.%p.log",
            "NCCL_DEBUG_FILE='nccl.%h.%p.log' has no effect: NCCL_DEBUG is unset, and NCCL opens the file only at "
            "NCCL_DEBUG=WARN, INFO, ABORT or TRACE",
        ),
        (
            "VERSION",
            "nccl.log",
            "NCCL_DEBUG_FILE='nccl.log' has no effect: NCCL_DEBUG is 'VERSION', and NCCL opens the file only at "
            "NCCL_DEBUG=WARN, INFO, ABORT or TRACE",
        ),
        (
            "INFO",
            "/scratch/nccl.log",
            "NCCL_DEBUG_FILE='/scratch/nccl.log' has no %h or %p: the ranks write NCCL's lines to one file, each "
            "truncating it when it starts, so the channels and algorithms NCCL ran are lost for all but the last",
        ),
        (
            "warn",
            "nccl.%h.%%p",  # %% is a literal %: no process id
            "NCCL_DEBUG_FILE='nccl.%h.%%p' has no %p: the ranks write NCCL's lines to one file, each truncating it "
            "when it starts, so the channels and algorithms NCCL ran are lost for all but the last",
        ),
        ("INFO", "/scratch/nccl.%h.%p.log", None),
    ],
)
def test_nccl_debug_file(debug, file, what):
    env = {"NCCL_DEBUG_FILE": file, **({"NCCL_DEBUG": debug} if debug else {})}
    assert [i.what for i in override_issues(env)] == ([what] if what else [])


def test_the_fix_names_a_file_per_process():
    (issue,) = override_issues({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "/scratch/nccl.log"})
    assert issue.fix == "name one file per process, e.g. NCCL_DEBUG_FILE=/scratch/nccl.%h.%p.log"


SET = {
    "NCCL_MAX_P2P_NCHANNELS": "4",
    "NCCL_PROFILER_PLUGIN": "/opt/site/libnccl-profiler-user.so",
    "NCCL_DEBUG_FILE": "/scratch/nccl.log",
}


def _named(lines):
    return {var: sum(1 for line in lines if f"[nccl-override] {var}=" in line) for var in SET}


def test_the_doctor_names_each_once(capsys, monkeypatch):
    """A plain ``lagom doctor --preset`` (its preset exports NCCL_DEBUG=WARN)."""
    _env(monkeypatch, SET)
    for k in ("NCCL_TUNER_PLUGIN", "LAGOM_CLUSTER"):
        monkeypatch.delenv(k, raising=False)
    capsys.readouterr()
    assert main(["doctor", "--preset", "llama3-8b-h100x8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert _named(out) == dict.fromkeys(SET, 1)
    assert out[-1] == "lagom doctor: preset llama3-8b-h100x8: 0 error(s), 3 warning(s)"


def test_training_names_each_once_before_it_starts(monkeypatch):
    """Training's pre-flight (``check_run`` on the cluster it chose, as ``pretrain_preflight`` runs it on a node; a
    ``--lagom`` run prints each finding as ``lagom doctor: <finding>``), with the preset's env exported as the launch
    scripts export it."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.preflight.check import check_run
    from lagom_megatron.training.arguments import parse_args

    args = parse_args(["--preset", "llama3-8b-h100x8", "--mock-data", "--lagom-plan", "/nonexistent/plan.json"])
    env = {**load_preset("llama3-8b-h100x8").env, **SET}
    found = check_run(args, env, ClusterSpec.load("h100-sxm-ib400"), world_size=8, local=True)
    logged = [f"lagom doctor: {f}" for f in found]
    assert _named(logged) == dict.fromkeys(SET, 1), logged
    assert [f.rule for f in found] == ["nccl-override"] * 3 and [f.what.split("=")[0] for f in found] == [
        var for var in LAGOM_VARIABLES if var in SET
    ]
