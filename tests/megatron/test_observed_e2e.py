"""Applied = observed on gloo, end to end: one torchrun launch of 2 gloo ranks (DP=2, overlapped
gradient reduce, distributed optimizer) trains three times: without lagom, with lagom, and with
lagom where rank 1's record of what ran disagrees with the plan for one site
(``LAGOM_INJECT_APPLY_FAULT=observed:1``, ``megatron.observed``).

Without the fault every planned site ran as planned (the gloo pool's own record: worker threads of
the group each call ran on, pieces it was issued in). With it, both ranks revert that site together
(the same plan on both, saved without it), the log and the report name the site with planned vs
observed and rank 1, and training reaches its last iteration.
"""

import json

import pytest

from tests.megatron.harness_launch import launch_harness
from tests.megatron.test_apply_faults import ARGS, ITERS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observed")
    runs = [{"name": "default", "argv": ARGS}]
    for name, env in (("clean", {}), ("fault", {"LAGOM_INJECT_APPLY_FAULT": "observed:1"})):
        runs.append(
            {
                "name": name,
                "argv": [
                    *ARGS,
                    "--lagom",
                    "--lagom-plan",
                    str(tmp / name / "plan.json"),
                    "--lagom-report",
                    str(tmp / name / "report.json"),
                ],
                "env": env,
            }
        )
    results, logs = launch_harness(tmp, "observed", runs, nproc=2, timeout_s=540)
    return tmp, results, logs


def test_without_a_fault_every_planned_site_ran_as_planned(launched):
    tmp, results, logs = launched
    log = logs["clean"]
    assert len(results["clean"]["losses"]) == ITERS, log
    rep = json.loads((tmp / "clean" / "report.json").read_text())["summary"]
    observed = rep.get("observed")
    assert observed, f"no observed check in the report:\n{log}"
    assert {r["status"] for r in observed.values()} == {"applied"}, observed
    (line,) = [x for x in log.splitlines() if x.startswith("lagom: observed:")]
    assert line == f"lagom: observed: {len(observed)} site(s) ran as planned, 0 differed, 0 unobserved (gloo)"
    assert "did not run as planned" not in log


def test_a_disagreeing_rank_reverts_the_site_on_every_rank(launched):
    from lagom_megatron.config.plan_files import load_plan

    tmp, results, logs = launched
    log = logs["fault"]
    assert len(results["fault"]["losses"]) == ITERS, f"training stopped early:\n{log}"
    rep = json.loads((tmp / "fault" / "report.json").read_text())
    observed = rep["summary"]["observed"]
    bad = {sid: r for sid, r in observed.items() if r["status"] == "differs"}
    assert len(bad) == 1, observed
    ((sid, r),) = bad.items()
    knob = r["knobs"][0]
    assert r["rank"] == 1 and r["planned"][knob] != r["observed"][knob], r
    (warn,) = [x for x in log.splitlines() if "did not run as planned" in x]
    assert (
        f"{sid} ({knob} planned {r['planned'][knob]} observed {r['observed'][knob]}; rank 1; fault injected" in warn
    ), warn
    assert "keep the defaults on every rank" in warn
    saved = load_plan(tmp / "fault" / "plan.json")
    assert saved.entries[sid].config.is_default() and saved.stats["sites_reverted"] == [sid]
    others = [s for s, e in saved.entries.items() if not e.config.is_default()]
    assert all(observed[s]["status"] == "applied" for s in others), "the other sites stay as planned"
