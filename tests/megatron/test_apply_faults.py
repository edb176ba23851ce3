"""Applying never kills or hangs training: one torchrun launch of 2 gloo ranks (DP=2, overlapped
gradient reduce) runs one training per fault, each fault on rank 1 only:

* capabilities disagreement (rank 1 reports the plugin as not loaded: what a missing or unreadable
  ``.so`` on one node gives);
* pool creation error (``pool-create``, after every rank made its ``new_group`` calls);
* unreadable plan table (``table``) and first-use failure (``first-use``: the plugin status check);
* the first training calls on the entries refused, on both ranks as NCCL refuses an unavailable
  algorithm (``first-call``): issued again on their own groups, then reverted;
* environment conflict (``env``: ``NCCL_MAX_CTAS`` set on rank 1 after the capabilities were agreed).

Every run must log one error naming the step and rank 1, destroy the pool entries it made, keep the
defaults on both ranks (its losses equal the default run's bit for bit) and reach its last iteration.
The switches are ``megatron.consensus``'s fault-injection variables.
"""

import json

import pytest

from tests.megatron.harness_launch import launch_harness
from tests.timeouts import LAUNCH_S

pytestmark = [pytest.mark.distributed]

ITERS = 10
ARGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--vocab-size",
    "384",
    "--tokenizer-type",
    "ByteLevel",
    "--mock-data",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(ITERS),
    "--lr",
    "3e-3",
    "--min-lr",
    "0",
    "--lr-warmup-iters",
    "1",
    "--lr-decay-style",
    "linear",
    "--log-interval",
    "1",
    "--seed",
    "1234",
    "--overlap-grad-reduce",
    "--use-distributed-optimizer",
    "--lagom-warmup-iters",
    "1",
    "--lagom-verify-iters",
    "1",
]

FAULTS = {  # run name -> (environment, what the error names)
    "caps": ({"LAGOM_INJECT_CAPABILITY_FAULT": "1:plugin_loaded"}, "rank 1 on host"),
    "pool": ({"LAGOM_INJECT_APPLY_FAULT": "pool-create:1"}, "pool-create failed on rank 1"),
    "table": ({"LAGOM_INJECT_APPLY_FAULT": "table:1"}, "table failed on rank 1"),
    "first_use": ({"LAGOM_INJECT_APPLY_FAULT": "first-use:1"}, "first-use failed on rank 1"),
    # NCCL refuses the first training call on an entry, on every rank of it alike (first_use)
    "first_call": ({"LAGOM_INJECT_APPLY_FAULT": "first-call:0,first-call:1"}, "first-call failed on rank 0"),
    "env": ({"LAGOM_INJECT_APPLY_FAULT": "env:1"}, "env failed on rank 1"),  # last: it leaves NCCL_MAX_CTAS on rank 1
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    runs = [{"name": "default", "argv": ARGS}]
    for name, (env, _) in FAULTS.items():
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
    results, logs = launch_harness(tmp, "faults", runs, nproc=2, timeout_s=LAUNCH_S)
    return tmp, results, logs


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_on_one_rank_keeps_defaults_on_all_and_training_finishes(launched, name):
    tmp, results, logs = launched
    default, run, log = results["default"], results[name], logs[name]
    assert len(run["losses"]) == ITERS, f"training stopped early:\n{log}"
    assert run["losses"] == default["losses"], f"got {run['losses']} but should be {default['losses']}"
    assert not run["not_restored"] and not run["installed_after"]
    errors = [line for line in log.splitlines() if "lagom: ERROR" in line]
    assert len(errors) == 1, errors  # one clear error (rank 0 prints; every rank acted on it)
    assert FAULTS[name][1] in errors[0] and "defaults" in errors[0], errors[0]
    rep = json.loads((tmp / name / "report.json").read_text())["summary"]
    assert rep["phase"] == "fell_back" and rep["mode"] == "aborted", rep
    if name == "caps":
        assert "plugin_loaded" in errors[0] and rep["pool"]["created"] == 0
    else:
        # every entry made before the failure is destroyed on revert: none live after
        assert rep["pool"]["live"] == 0 and rep["pool"]["destroyed"] == rep["pool"]["created"], rep["pool"]
    if name == "env":
        assert "NCCL_MAX_CTAS='4' (was None)" in errors[0], errors[0]
    if name in ("pool", "first_use", "first_call"):
        assert rep["pool"]["created"] > 0, rep["pool"]  # entries existed and were destroyed
    if name == "table":  # failed after the search: the plan is saved as rejected, so reuse keeps the defaults
        from lagom_megatron.config.plan_files import load_plan

        saved = load_plan(tmp / name / "plan.json")
        assert saved.rejected and "table failed on rank 1" in saved.stats["verification_reason"]
    else:
        assert not (tmp / name / "plan.json").exists()
