"""NCCL_TUNER_PLUGIN checks: values with which NCCL would silently not load a tuner plugin, unit
and through `lagom doctor` (exit 1, one error line naming the variable)."""

import shutil
import subprocess

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.nccl.plugin import build_tuner
from lagom_megatron.nccl.plugin_launch import check_tuner_plugin, probe_library, tuner_symbols_for

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("plugin_check")
    foreign = out / "libnot-a-tuner.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(foreign)],
        input="int lagomNothing = 1;\n",
        check=True,
        capture_output=True,
        text=True,
    )
    broken = out / "libbroken.so"
    broken.write_bytes(b"not an ELF file")
    return {"lagom": build_tuner(out), "foreign": foreign, "broken": broken}


def test_symbols_each_nccl_release_looks_up():
    assert tuner_symbols_for("2.32.6")[0] == "ncclTunerPlugin_v7"
    assert tuner_symbols_for("2.31.2")[0] == tuner_symbols_for("2.30.7")[0] == "ncclTunerPlugin_v6"
    assert tuner_symbols_for("2.29.3")[0] == "ncclTunerPlugin_v5"
    assert tuner_symbols_for("2.27.5") == ("ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2")
    assert tuner_symbols_for("2.22.3") == ("ncclTunerPlugin_v3", "ncclTunerPlugin_v2")
    assert tuner_symbols_for("2.21.5") == ("ncclTunerPlugin_v2", "ncclTunerPlugin_v1")
    assert len(tuner_symbols_for(None)) == 7 and tuner_symbols_for("none") == tuner_symbols_for(None)


def test_values_that_load_no_plugin():
    assert check_tuner_plugin({}) == []
    (none,) = check_tuner_plugin({"NCCL_TUNER_PLUGIN": "None"})
    assert (none.level, none.variable, none.what) == (
        "error",
        "NCCL_TUNER_PLUGIN",
        "NCCL_TUNER_PLUGIN='None' disables the tuner plugin",
    )
    (rel,) = check_tuner_plugin({"NCCL_TUNER_PLUGIN": "build/libnccl-tuner-lagom.so"})
    assert rel.what == "NCCL_TUNER_PLUGIN='build/libnccl-tuner-lagom.so' is a relative path"
    assert check_tuner_plugin({"NCCL_TUNER_PLUGIN": "lagom"}) == [], "a loader-path name is NCCL's lookup"
    assert check_tuner_plugin({"NCCL_TUNER_PLUGIN": "/no/such/lib.so"}) == [], "env_check reports missing files"


@needs_gcc
def test_library_symbols(libs):
    assert probe_library(str(libs["lagom"]))[0] == tuple(f"ncclTunerPlugin_v{v}" for v in (7, 6, 5, 4, 3))
    assert check_tuner_plugin({"NCCL_TUNER_PLUGIN": str(libs["lagom"])}, nccl_version="2.27.5") == []
    (foreign,) = check_tuner_plugin({"NCCL_TUNER_PLUGIN": str(libs["foreign"])})
    assert foreign.what.startswith(f"NCCL_TUNER_PLUGIN='{libs['foreign']}' has none of the symbols NCCL looks up")
    assert "it exports no ncclTunerPlugin_v* struct" in foreign.why
    (old,) = check_tuner_plugin({"NCCL_TUNER_PLUGIN": str(libs["lagom"])}, nccl_version="2.21.5")
    assert "none of the symbols NCCL 2.21.5 looks up (ncclTunerPlugin_v2, ncclTunerPlugin_v1)" in old.what
    assert "NCCL 2.22 or newer" in old.fix
    (broken,) = check_tuner_plugin({"NCCL_TUNER_PLUGIN": str(libs["broken"])})
    assert broken.what.startswith(f"NCCL_TUNER_PLUGIN='{libs['broken']}' does not load: ")


@needs_gcc
@pytest.mark.parametrize(
    "kind, line",
    [
        (
            "missing",
            "error: [nccl-env] NCCL_TUNER_PLUGIN='/nonexistent/libnccl-tuner-lagom.so': the file does not exist",
        ),
        ("relative", "error: [nccl-env] NCCL_TUNER_PLUGIN='./libnccl-tuner-lagom.so' is a relative path"),
        (
            # h100-sxm-ib400 carries NCCL 2.30.7, which tries v6 down to v2 (v2.30.7 src/plugin/tuner.cc:73-85)
            "foreign",
            "error: [nccl-env] NCCL_TUNER_PLUGIN='{foreign}' has none of the symbols NCCL 2.30.7 looks up "
            "(ncclTunerPlugin_v6, ncclTunerPlugin_v5, ncclTunerPlugin_v4, ncclTunerPlugin_v3, ncclTunerPlugin_v2)",
        ),
        ("none", "error: [nccl-env] NCCL_TUNER_PLUGIN='none' disables the tuner plugin"),
    ],
)
def test_doctor_errors_name_the_variable(libs, capsys, monkeypatch, kind, line):
    value = {
        "missing": "/nonexistent/libnccl-tuner-lagom.so",
        "relative": "./libnccl-tuner-lagom.so",
        "foreign": str(libs["foreign"]),
        "none": "none",
    }[kind]
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", value)
    assert main(["doctor", "--preset", "llama3-70b-h100x64", "--cluster", "h100-sxm-ib400"]) == 1
    out = capsys.readouterr().out
    assert line.format(foreign=libs["foreign"]) in out.splitlines()
    assert "1 error(s)" in out


@needs_gcc
def test_doctor_accepts_lagoms_plugin(libs, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", str(libs["lagom"]))
    main(["doctor", "--preset", "llama3-70b-h100x64", "--cluster", "h100-sxm-ib400"])
    assert "NCCL_TUNER_PLUGIN" not in capsys.readouterr().out


def test_profiler_symbols_each_nccl_release_looks_up():
    from lagom_megatron.nccl.plugin_launch import abis_in_use, profiler_symbols_for

    assert profiler_symbols_for("2.22.3") == ()
    assert profiler_symbols_for("2.23.4") == ("ncclProfiler_v1",)
    assert profiler_symbols_for("2.25.1") == ("ncclProfiler_v2", "ncclProfiler_v1")
    assert profiler_symbols_for("2.26.2")[0] == "ncclProfiler_v3"
    assert profiler_symbols_for("2.27.5")[0] == "ncclProfiler_v4"
    assert profiler_symbols_for("2.28.3")[0] == "ncclProfiler_v5"
    assert profiler_symbols_for("2.30.7")[0] == profiler_symbols_for("2.29.2")[0] == "ncclProfiler_v6"
    assert profiler_symbols_for("2.31.2")[0] == profiler_symbols_for("2.32.6")[0] == "ncclProfiler_v7"
    lagoms = [f"ncclTunerPlugin_v{v}" for v in range(3, 8)] + [f"ncclProfiler_v{v}" for v in range(1, 8)]
    assert abis_in_use(lagoms, "2.32.6") == ("ncclTunerPlugin_v7", "ncclProfiler_v7")
    assert abis_in_use(lagoms, "2.31.2") == ("ncclTunerPlugin_v6", "ncclProfiler_v7")
    assert abis_in_use(lagoms, "2.30.7") == ("ncclTunerPlugin_v6", "ncclProfiler_v6")
    assert abis_in_use(lagoms, "2.27.5") == ("ncclTunerPlugin_v4", "ncclProfiler_v4")
    assert abis_in_use(lagoms, "2.22.3") == ("ncclTunerPlugin_v3", None)
    assert abis_in_use(lagoms, "2.21.5") == (None, None)
    assert abis_in_use(["ncclProfiler_v2"], "2.30.7") == (None, "ncclProfiler_v2")


@needs_gcc
def test_doctor_reports_the_abis_nccl_will_use(libs, capsys, monkeypatch):
    lib = str(libs["lagom"])
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", lib)
    monkeypatch.setenv("NCCL_PROFILER_PLUGIN", lib)
    assert main(["doctor", "--preset", "llama3-70b-h100x64", "--cluster", "h100-sxm-ib400"]) == 0
    # h100-sxm-ib400 pins NCCL 2.30.7: it takes the newest struct lagom's plugin exports that it knows, tuner v6
    # (v2.30.7 src/plugin/tuner.cc:73) and profiler v6 (v2.30.7 src/plugin/profiler.cc:73)
    out = capsys.readouterr().out.splitlines()
    assert (
        f"lagom doctor: NCCL 2.30.7 will use, of {lib}: ncclTunerPlugin_v6 (tuner ABI v6); ncclProfiler_v6 "
        "(profiler ABI v6)"
    ) in out
    monkeypatch.setenv("NCCL_PROFILER_PLUGIN", "/opt/site/libnccl-profiler-user.so")
    assert main(["doctor", "--preset", "llama3-70b-h100x64", "--cluster", "h100-sxm-ib400"]) == 0
    out = capsys.readouterr().out
    assert (
        "warning: [nccl-override] NCCL_PROFILER_PLUGIN='/opt/site/libnccl-profiler-user.so' names another profiler "
        "plugin, which lagom never replaces: lagom checks only the tuner's row hits, not what NCCL ran"
    ) in out
    assert "ncclTunerPlugin_v6 (tuner ABI v6); no profiler of lagom's (NCCL_PROFILER_PLUGIN=/opt/site/" in out


@needs_gcc
def test_a_library_with_neither_struct_is_refused(libs):
    (err,) = check_tuner_plugin({"NCCL_TUNER_PLUGIN": str(libs["foreign"])}, nccl_version="2.30.7")
    assert err.level == "error" and "it exports no ncclTunerPlugin_v* struct and no ncclProfiler_v* struct" in err.why
