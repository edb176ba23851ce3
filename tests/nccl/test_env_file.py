"""The env file of process-scope NCCL knobs: validation, atomic write, round trip, and that a
shell sourcing it gets exactly the values."""

import shutil
import subprocess

import pytest

from lagom_megatron.nccl.env_file import env_file_path, read_env_file, validate_process_env, write_env_file


def test_env_file_sits_beside_the_plan(tmp_path):
    assert env_file_path(tmp_path / "runs" / "plan.json") == tmp_path / "runs" / "plan.env"
    assert env_file_path("plan").name == "plan.env"


def test_round_trip_and_aliases(tmp_path):
    path = write_env_file(
        {"n_threads": 256, "NCCL_BUFFSIZE": "2097152", "NCCL_TUNER_PLUGIN": "/opt/lagom dir/libnccl-tuner-lagom.so"},
        tmp_path / "plan.env",
        source="plan.json",
    )
    text = path.read_text()
    assert text.startswith("# written by lagom: process-scope NCCL settings of plan.json\n")
    assert "export NCCL_NTHREADS=256\n" in text and "export NCCL_BUFFSIZE=2097152\n" in text
    assert read_env_file(path) == {
        "NCCL_NTHREADS": "256",
        "NCCL_BUFFSIZE": "2097152",
        "NCCL_TUNER_PLUGIN": "/opt/lagom dir/libnccl-tuner-lagom.so",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["plan.env"], "no temporary file left behind"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_sourcing_the_file_exports_the_values(tmp_path):
    path = write_env_file({"NCCL_NTHREADS": 128, "LAGOM_TUNER_CONFIG": "/tmp/it's a plan.csv"}, tmp_path / "p.env")
    out = subprocess.run(
        ["bash", "-c", f'source "{path}" && echo "$NCCL_NTHREADS|$LAGOM_TUNER_CONFIG"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "128|/tmp/it's a plan.csv"


def test_empty_env_writes_a_harmless_file(tmp_path):
    path = write_env_file({}, tmp_path / "plan.env")
    assert read_env_file(path) == {}


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NCCL_NTHREADS": 1024}, r"NCCL_NTHREADS must be one of \[64, 128, 256, 512\]; got 1024"),
        ({"NCCL_NTHREADS": "many"}, "NCCL_NTHREADS must be an integer; got 'many'"),
        ({"NCCL_NTHREADS": True}, "must be an integer"),
        ({"NCCL_BUFFSIZE": 3 << 20}, r"NCCL_BUFFSIZE must be a power of two in 65536\.\.1073741824 bytes; got 3145728"),
        ({"NCCL_BUFFSIZE": 1 << 15}, "got 32768"),
        ({"NCCL_MAX_CTAS": 8}, "'NCCL_MAX_CTAS' is not a process-scope knob lagom writes"),
        ({"n_threads": 64, "NCCL_NTHREADS": 64}, "NCCL_NTHREADS is given twice"),
        ({"NCCL_TUNER_PLUGIN": " "}, "NCCL_TUNER_PLUGIN must be a non-empty path"),
    ],
)
def test_values_outside_nccl_domains_are_refused(tmp_path, env, message):
    with pytest.raises(ValueError, match=message):
        write_env_file(env, tmp_path / "plan.env")
    assert not (tmp_path / "plan.env").exists()


def test_reading_a_hand_edited_file_validates_it(tmp_path):
    path = tmp_path / "plan.env"
    path.write_text("export NCCL_NTHREADS=96\n")
    with pytest.raises(ValueError, match="got 96"):
        read_env_file(path)
    path.write_text("# ok\nNCCL_NTHREADS=64\n")
    with pytest.raises(ValueError, match=r"plan.env:2: expected 'export VAR=value'"):
        read_env_file(path)
    with pytest.raises(FileNotFoundError):
        read_env_file(tmp_path / "missing.env")


def test_validate_orders_knobs_first():
    assert list(
        validate_process_env({"LAGOM_TUNER_CONFIG": "t.csv", "NCCL_BUFFSIZE": 1 << 22, "NCCL_NTHREADS": 512})
    ) == ["NCCL_NTHREADS", "NCCL_BUFFSIZE", "LAGOM_TUNER_CONFIG"]


def test_plan_env_file_with_tuner_paths(tmp_path):
    from lagom_megatron.nccl.env_file import write_plan_env_file

    plan = tmp_path / "runs" / "plan.json"
    path = write_plan_env_file(
        plan,
        {"NCCL_NTHREADS": "256"},
        tuner_plugin=tmp_path / "libnccl-tuner-lagom.so",
        tuner_table=tmp_path / "runs" / "plan.csv",
    )
    assert path == tmp_path / "runs" / "plan.env"
    assert path.read_text().splitlines()[0] == "# written by lagom: process-scope NCCL settings of plan.json"
    assert read_env_file(path) == {
        "NCCL_NTHREADS": "256",
        "NCCL_TUNER_PLUGIN": str(tmp_path / "libnccl-tuner-lagom.so"),
        "LAGOM_TUNER_CONFIG": str(tmp_path / "runs" / "plan.csv"),
    }
