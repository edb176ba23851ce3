"""The one schema of plan and profile files, which every reader uses (the ``lagom`` commands, the training run's
``--lagom-plan``, the SLURM launch): its one-line errors and what it accepts of what lagom writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lagom_megatron.config.plan_files import load_plan, load_profile
from lagom_megatron.engine.plan import Plan

from ..engine.factory import build, profile_from, site

DATA = Path(__file__).resolve().parents[1] / "engine" / "data"


def _plan_file(tmp_path, mutate) -> Path:
    from lagom_megatron.engine.search import search

    data = search(build(sites=[site()]), method="priority").plan.to_dict()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=99), "schema_version: Input should be 1; got 99"),
        (lambda d: d.update(bogus=1), "bogus: Extra inputs are not permitted; got 1"),
        (lambda d: d.pop("entries"), "entries: Field required"),
        (lambda d: d["entries"]["tp.ag[0]"].pop("group"), "entries.tp.ag[0].group: Field required"),
        (
            lambda d: d["entries"]["tp.ag[0]"]["config"].update(n_chanels=4),
            "entries.tp.ag[0].config: unknown CommConfig field(s) ['n_chanels']; allowed: ",
        ),
        (
            lambda d: d["entries"]["tp.ag[0]"].update(tunable="n_channels"),
            "entries.tp.ag[0].tunable: Input should be a valid list; got 'n_channels'",
        ),
        (lambda d: d.update(env={"NCCL_NTHREADS": 256}), "env.NCCL_NTHREADS: Input should be a valid string; got 256"),
        (
            lambda d: d.update(registered_groups=["dp"]),
            "registered_groups must name distinct process groups of the plan's entries ['tp']; got ['dp']",
        ),
        (lambda d: d.update(registered_groups=["tp", "tp"]), "registered_groups must name distinct process groups"),
    ],
)
def test_a_bad_plan_is_one_line_naming_the_file_and_field(tmp_path, mutate, message):
    path = _plan_file(tmp_path, mutate)
    with pytest.raises(ValueError) as info:
        load_plan(path)
    assert str(info.value).startswith(f"{path}: {message}"), info.value


def test_a_plan_given_as_a_list_or_a_profile_is_named_as_such(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"p\.json: expected a JSON object \(a plan\); got a JSON list"):
        load_plan(path)
    profile = DATA / "gloo_tp2_dp2_profile.json"
    with pytest.raises(ValueError, match="entries: Field required"):
        load_plan(profile)  # no command to name
    with pytest.raises(ValueError, match=r"looks like a profile \(it has samples, no entries\); --x reads plans"):
        load_plan(profile, "--x")


def test_what_lagom_writes_is_what_it_reads(tmp_path):
    prof = profile_from(build(sites=[site(), site(site_id="dp.rs[0]", op="reduce_scatter", group="dp")]))
    prof.fingerprint.update(world_size=8, backend=prof.backend, cluster=prof.cluster)
    prof.save(tmp_path / "profile.json")
    back = load_profile(tmp_path / "profile.json")
    assert back.to_dict() == prof.to_dict()
    plan = Plan.from_dict(json.loads(_plan_file(tmp_path, lambda d: None).read_text()))
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").digest() == plan.digest()


def test_a_sample_of_an_unlisted_site_is_refused(tmp_path):
    data = json.loads((DATA / "gloo_tp2_dp2_profile.json").read_text())
    data["samples"][0]["site_id"] = "tp.nowhere[0]"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"^.*p\.json: sample for unknown site 'tp\.nowhere\[0\]'$"):
        load_profile(path)


@pytest.mark.parametrize("state", ["bogus", "rejected", "verifying", ""])
def test_a_verification_state_lagom_never_writes_is_refused(tmp_path, state):
    """``"bogus"`` or ``"rejected"`` (a user keeping a plan off) passed ``plan validate`` and the reuse path applied
    the plan from iteration 1 unmeasured: only ``fell_back`` kept it off."""
    path = _plan_file(tmp_path, lambda d: d["stats"].update(verification=state))
    before = path.read_text()
    with pytest.raises(ValueError) as info:
        load_plan(path)
    assert str(info.value) == (
        f"{path}: stats.verification must be one of ['applied', 'fell_back'] or absent (never verified: a run "
        f"measures it before applying it); got {state!r}, which a run would apply unmeasured"
    )
    assert path.read_text() == before


@pytest.mark.parametrize("state", ["applied", "fell_back", None])
def test_the_states_lagom_writes_load(tmp_path, state):
    path = _plan_file(tmp_path, lambda d: d["stats"].update(verification=state) if state else None)
    assert load_plan(path).stats.get("verification") == state


def test_a_training_run_does_not_reuse_a_plan_of_an_unknown_state(tmp_path, capsys):
    """The run's reuse path reads the plan through the same schema: moved aside (kept, byte for byte), searched anew."""
    from lagom_megatron.megatron.outputs.run_files import RunFiles

    path = _plan_file(tmp_path, lambda d: d["stats"].update(verification="rejected"))
    before = path.read_bytes()
    files = RunFiles(plan_path=str(path))
    assert files.saved_plan({}) is None
    out = capsys.readouterr().out
    assert f"lagom: WARNING: cannot reuse plan {path}: {path}: stats.verification must be one of" in out
    assert "; searching a new one" in out
    assert not path.exists()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("p.corrupt-")]
    assert len(kept) == 1 and kept[0].read_bytes() == before


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda d: d["sites"][0].update(n_nodes=5),
            "site 'dp.grad_reduce_scatter[chunk0.bucket0]': n_nodes 5 exceeds its group_size 2; allowed: 1..2 "
            "(each node holds at least one rank of the group)",
        ),
        (
            lambda d: d["samples"][3].update(t_comp_us=1e12),
            "samples[3] (site 'tp.sp_all_gather[0]'): t_comp_us 1e+12 exceeds the profile's iteration_us "
            "380286; allowed: 0..380286 (a region's compute is part of one iteration)",
        ),
    ],
    ids=["n_nodes-above-group", "t_comp-above-iteration"],
)
def test_a_measured_profile_with_an_impossible_size_is_refused_by_search(tmp_path, capsys, mutate, message):
    from lagom_megatron.cli.main import main

    data = json.loads((DATA / "gloo_tp2_dp2_profile.json").read_text())
    assert load_profile(DATA / "gloo_tp2_dp2_profile.json").iteration_us == pytest.approx(380286.483)
    mutate(data)
    path, out = tmp_path / "p.json", tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["search", "--profile", str(path), "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lagom search: error: {path}: {message}"]
    assert not out.exists() and json.loads(path.read_text()) == data
