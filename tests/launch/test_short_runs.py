"""A ``--lagom`` run too short to tune is named before it starts, by ``lagom doctor`` and by training, with the
iterations ``engine.tuner.Tuner`` counts; the warning promises no plan that the run will not save."""

from __future__ import annotations

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.tuner import DEFAULT_CONFIG, Tuner, TunerConfig
from lagom_megatron.megatron.pool.comm_pool import rules_for
from lagom_megatron.preflight.lagom_flags import tuning_iterations
from tests.training.preflight_harness import SCRIPT, _env


def _tuner(cluster: str, **counts) -> Tuner:
    spec = ClusterSpec.load(cluster)
    return Tuner(TunerConfig(**counts), rules=rules_for(spec.backend, spec))


def _gloo_counts():
    t = _tuner("cpu-gloo")
    return len(t.probes), t.profiling_iters, t.profiling_iters + 1 + 2 * DEFAULT_CONFIG.verify_iters


def test_the_counts_are_the_tuners():
    probes, searched, verified = _gloo_counts()
    assert tuning_iterations({}, ClusterSpec.load("cpu-gloo"))[:3] == (probes, searched, verified)
    assert searched == DEFAULT_CONFIG.warmup_iters + 2 + probes
    t = _tuner("h200-sxm", warmup_iters=8, verify_iters=20, verify_max_iters=160)
    assert tuning_iterations(
        {"lagom_warmup_iters": 8, "lagom_verify_iters": 20, "lagom_verify_max_iters": 160}, ClusterSpec.load("h200-sxm")
    ) == (len(t.probes), t.profiling_iters, t.profiling_iters + 1 + 2 * 20, t.total_iters)
    assert tuning_iterations({}, {"backend": "nccl", "sm_arch": 90}) is None  # no cluster file: not judged


def _expected(train_iters: int) -> str:
    probes, searched, verified = _gloo_counts()
    profile = (
        f"{searched} to profile: {DEFAULT_CONFIG.warmup_iters} warm-up, 1 at the defaults, 1 serialized, "
        f"{probes} probe(s)"
    )
    if train_iters < searched:
        return (
            f"warning: [lagom-iterations] --train-iters {train_iters} ends before lagom's profiling does: no plan will "
            f"be searched or saved (lagom needs {profile}; {verified} for a verified plan)"
        )
    return (
        f"warning: [lagom-iterations] --train-iters {train_iters} ends before lagom's verification does: the plan is "
        f"searched after {searched} iterations and saved never verified (a later run measures it before applying "
        f"it); a verdict needs {verified} ({profile}; then 1 + 2 x {DEFAULT_CONFIG.verify_iters} to verify)"
    )


def _line(tmp_path, train_iters):
    return [
        "--preset",
        "cpu-tp2-dp2",
        "--mock-data",
        "--lagom",
        "--lagom-plan",
        str(tmp_path / "run" / "plan.json"),
        "--train-iters",
        str(train_iters),
    ]


@pytest.mark.parametrize("offset", ["before profiling ends", "before the verdict", "long enough"])
def test_the_doctor_names_a_run_too_short_to_tune(offset, tmp_path, capsys, monkeypatch):
    """It said nothing; training said "the plan will be saved unverified" and then saved none (``--train-iters 6``)."""
    _, searched, verified = _gloo_counts()
    n = {"before profiling ends": searched - 3, "before the verdict": verified - 1, "long enough": verified}[offset]
    _env(monkeypatch, {})
    capsys.readouterr()
    assert main(["doctor", "--world-size", "4", "--", *_line(tmp_path, n)]) == 0
    out = capsys.readouterr().out
    found = [line for line in out.splitlines() if "[lagom-iterations]" in line]
    assert found == ([] if n >= verified else [_expected(n)])
    assert out.splitlines()[-1].endswith(f"0 error(s), {len(found)} warning(s)")
    assert not (tmp_path / "run").exists()


def test_training_says_so_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    import lagom_megatron.training.loop as loop

    started = []
    monkeypatch.setattr(loop, "pretrain", started.append)
    _env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "4"})
    capsys.readouterr()
    assert SCRIPT.main(_line(tmp_path, 6)) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"lagom doctor: {_expected(6)}" in err
    assert not any("saved unverified" in line for line in err)
    assert len(started) == 1  # a warning: the run starts
    assert not (tmp_path / "run" / "plan.json").exists()


def test_a_plan_that_exists_may_be_reused_and_is_not_judged(tmp_path, capsys, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text("{}")
    _env(monkeypatch, {})
    capsys.readouterr()
    main(["doctor", "--world-size", "4", "--", *_line(tmp_path, 6)])
    assert "[lagom-iterations]" not in capsys.readouterr().out
    assert (tmp_path / "run" / "plan.json").read_text() == "{}"
