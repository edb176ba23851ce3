"""The Megatron-LM parity flags in the shared pre-flight: the doctor and training refuse the same lines
with the same one line (flag, bad value, what is allowed), before any rank starts.

Each case of :data:`FLAG_CASES` is a ``cpu-tp2-dp2`` command line (world size 4, train iters 60)
plus extra flags; ``tests/training/test_preflight_parity.py`` runs the same cases for the verdict.
Sources of each check: ``preflight/values.py`` (``megatron_flag_problems``) and
``training/argument_checks.py`` (``check_installed``); the table in ``docs/training.md``.
"""

from __future__ import annotations

import importlib.util

import pytest

from lagom_megatron.preflight.values import megatron_flag_problems
from lagom_megatron.training.argument_checks import check_installed, validate_args
from lagom_megatron.training.arguments import parse_args
from tests.timeouts import COMMAND_S
from tests.training.preflight_harness import doctor, train

CPU = ["--preset", "cpu-tp2-dp2", "--mock-data"]
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FLASH_INSTALLED = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_3"))

# (id, extra flags, environment, the one line's text; None = the run may start)
FLAG_CASES = [
    (
        "init-std-negative",
        ["--init-method-std", "-0.02"],
        {},
        "--init-method-std -0.02 is out of range; allowed: a finite number >= 0",
    ),
    ("init-std-nan", ["--init-method-std", "nan"], {}, "--init-method-std nan is out of range"),
    ("init-std-zero", ["--init-method-std", "0"], {}, None),
    (
        "recompute-num-layers-zero",
        [*FULL, "--recompute-num-layers", "0"],
        {},
        "--recompute-num-layers 0 is out of range; allowed: an integer >= 1",
    ),
    (
        "recompute-num-layers-negative",
        [*FULL, "--recompute-num-layers", "-2"],
        {},
        "--recompute-num-layers -2 is out of range; allowed: an integer >= 1",
    ),
    (
        "recompute-full-without-method",
        ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
        {},
        "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers >= 1; "
        "got None and 1",
    ),
    ("recompute-full-without-layers", FULL, {}, "--recompute-granularity full needs --recompute-method"),
    (
        "recompute-selective-with-method",
        ["--recompute-granularity", "selective", "--recompute-method", "block"],
        {},
        "--recompute-granularity selective takes no --recompute-method nor --recompute-num-layers; got block and None",
    ),
    (
        "recompute-selective-with-layers",
        ["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
        {},
        "--recompute-granularity selective takes no --recompute-method",
    ),
    (
        "recompute-method-alone",
        ["--recompute-method", "block"],
        {},
        "--recompute-method and --recompute-num-layers need --recompute-granularity full",
    ),
    (
        "recompute-uniform-not-dividing",
        [*FULL, "--recompute-num-layers", "3"],
        {},
        "--recompute-num-layers 3 does not divide the 4 layers of each model chunk",
    ),
    (
        "recompute-uniform-past-the-chunk",
        [*FULL, "--recompute-num-layers", "8"],
        {},
        "--recompute-num-layers 8 does not divide the 4 layers of each model chunk",
    ),
    ("recompute-uniform-dividing", [*FULL, "--recompute-num-layers", "2"], {}, None),
    (
        "recompute-block-past-the-chunk",
        [*FULL[:2], "--recompute-method", "block", "--recompute-num-layers", "8"],
        {},
        None,
    ),
    ("recompute-full-block", [*FULL[:2], "--recompute-method", "block", "--recompute-num-layers", "1"], {}, None),
    ("recompute-selective", ["--recompute-granularity", "selective"], {}, None),
    (
        "attention-local-with-te",
        ["--attention-backend", "local", "--transformer-impl", "transformer_engine"],
        {},
        "--attention-backend local needs --transformer-impl local; got --transformer-impl transformer_engine",
    ),
    (
        "attention-local-default-impl",
        ["--attention-backend", "local"],
        {},
        "--attention-backend local needs --transformer-impl local; got --transformer-impl None",
    ),
    ("attention-local", ["--attention-backend", "local", "--transformer-impl", "local"], {}, None),
    (
        "nvte-env-against-backend",
        ["--attention-backend", "unfused"],
        {"NVTE_FLASH_ATTN": "1"},
        "NVTE_FLASH_ATTN=1 contradicts --attention-backend unfused; allowed: NVTE_FLASH_ATTN unset or 0",
    ),
    (
        "nvte-env-against-auto",
        [],
        {"NVTE_FUSED_ATTN": "0"},
        "NVTE_FUSED_ATTN=0 contradicts --attention-backend auto; allowed: NVTE_FUSED_ATTN unset or 1",
    ),
    ("nvte-env-agrees", ["--attention-backend", "fused"], {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"}, None),
    (
        "wsd-without-decay-iters",
        ["--lr-decay-style", "WSD"],
        {},
        "--lr-decay-style WSD needs --lr-wsd-decay-iters >= 1 (the iterations of the decay phase); got None",
    ),
    (
        "wsd-decay-iters-zero",
        ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "0"],
        {},
        "--lr-decay-style WSD needs --lr-wsd-decay-iters >= 1",
    ),
    (
        "wsd-longer-than-train-iters",
        ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "61"],
        {},
        "--lr-wsd-decay-iters 61 is out of range; allowed: 1..60 (--lr-decay-iters, default --train-iters)",
    ),
    (
        "wsd-longer-than-decay-iters",
        ["--lr-decay-style", "WSD", "--lr-decay-iters", "40", "--lr-wsd-decay-iters", "41"],
        {},
        "--lr-wsd-decay-iters 41 is out of range; allowed: 1..40",
    ),
    ("wsd-whole-decay", ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "60"], {}, None),
    (
        "pool-budget-zero",
        ["--lagom-pool-budget-mib", "0"],
        {},
        "--lagom-pool-budget-mib 0.0 is out of range; allowed: a finite number > 0 (MiB per rank)",
    ),
    ("pool-budget-negative", ["--lagom-pool-budget-mib", "-1"], {}, "--lagom-pool-budget-mib -1.0 is out of range"),
    (
        "pool-budget-inf",
        ["--lagom", "--lagom-pool-budget-mib", "inf"],
        {},
        "--lagom-pool-budget-mib inf is out of range",
    ),
    ("pool-budget-nan", ["--lagom-pool-budget-mib", "nan"], {}, "--lagom-pool-budget-mib nan is out of range"),
    (
        "flash-backend",
        ["--attention-backend", "flash"],
        {},
        None if FLASH_INSTALLED else "--attention-backend flash needs FlashAttention (the flash-attn package",
    ),
    (
        "use-flash-attn",
        ["--use-flash-attn"],
        {},
        None if FLASH_INSTALLED else "--use-flash-attn needs FlashAttention (the flash-attn package",
    ),
    ("bf16-reduces-in-fp32", ["--bf16"], {}, None),
    ("fp16-with-fp32-reduce", ["--fp16", "--accumulate-allreduce-grads-in-fp32"], {}, None),
    ("no-gradient-accumulation-fusion", ["--no-gradient-accumulation-fusion"], {}, None),
    ("local-rank", ["--local-rank", "3"], {}, None),
    # an option only --lagom reads, without --lagom: refused, unless it is given its default value
    (
        "lagom-plan-without-lagom",
        ["--lagom-plan", "runs/demo/cpu-pp2-dp2/plan.json"],
        {},
        "--lagom-plan needs --lagom (or drop --lagom-plan)",
    ),
    (
        "lagom-report-without-lagom",
        ["--lagom-report", "r.md"],
        {},
        "--lagom-report needs --lagom (or drop --lagom-report)",
    ),
    (
        "lagom-method-without-lagom",
        ["--lagom-method", "autoccl"],
        {},
        "--lagom-method needs --lagom (or drop --lagom-method)",
    ),
    (
        "lagom-warmup-without-lagom",
        ["--lagom-warmup-iters", "2"],
        {},
        "--lagom-warmup-iters needs --lagom (or drop --lagom-warmup-iters)",
    ),
    (
        "lagom-verify-without-lagom",
        ["--lagom-verify-iters", "8"],
        {},
        "--lagom-verify-iters needs --lagom (or drop --lagom-verify-iters)",
    ),
    (
        "lagom-budget-without-lagom",
        ["--lagom-pool-budget-mib", "256"],
        {},
        "--lagom-pool-budget-mib needs --lagom (or drop --lagom-pool-budget-mib)",
    ),
    (
        "lagom-defaults-without-lagom",
        [
            "--lagom-method",
            "priority",
            "--lagom-warmup-iters",
            "4",
            "--lagom-verify-iters",
            "4",
            "--lagom-pool-budget-mib",
            "512",
        ],
        {},
        None,
    ),
    ("lagom-versions-without-lagom", ["--lagom-allow-untested-versions"], {}, None),  # read on every run
    ("lagom-method-with-lagom", ["--lagom", "--lagom-method", "autoccl", "--lagom-warmup-iters", "2"], {}, None),
    # counts with an upper bound (an unbounded one ran an unverified plan to the end of training)
    (
        "lagom-verify-iters-unbounded",
        ["--lagom", "--lagom-verify-iters", "99999999999999999999"],
        {},
        "--lagom-verify-iters 99999999999999999999 is out of range; allowed: an integer in 1..200",
    ),
    (
        "lagom-warmup-iters-unbounded",
        ["--lagom", "--lagom-warmup-iters", "1001"],
        {},
        "--lagom-warmup-iters 1001 is out of range; allowed: an integer in 1..1000",
    ),
    (
        "lagom-counts-at-their-bounds",
        ["--lagom", "--lagom-verify-iters", "200", "--lagom-warmup-iters", "1000", "--lagom-verify-max-iters", "1000"],
        {},
        None,
    ),
    # sequential verification's cap: bounded, and not below the first look
    (
        "lagom-verify-max-without-lagom",
        ["--lagom-verify-max-iters", "80"],
        {},
        "--lagom-verify-max-iters needs --lagom (or drop --lagom-verify-max-iters)",
    ),
    (
        "lagom-verify-max-below-first",
        ["--lagom", "--lagom-verify-iters", "20", "--lagom-verify-max-iters", "10"],
        {},
        "--lagom-verify-max-iters 10 is below --lagom-verify-iters 20; allowed: an integer in 20..1000",
    ),
    (
        "lagom-verify-max-unbounded",
        ["--lagom", "--lagom-verify-max-iters", "1001"],
        {},
        "--lagom-verify-max-iters 1001 is out of range; allowed: an integer in 1..1000",
    ),
    # --split: weights separated by commas (or slashes); other characters are not dropped silently
    (
        "split-with-letters",
        ["--split", "90,abc5,5"],
        {},
        "--split '90,abc5,5' is out of range; allowed: up to three weights >= 0 separated by commas, e.g. 969,30,1, "
        "with a training weight > 0",
    ),
    ("split-commas", ["--split", "90, 5,5"], {}, None),
    # a misspelt flag: the closest known one is named by the script as by the doctor (one implementation)
    (
        "lagom-flag-typo",
        ["--lagom", "--lagom-warmup-iter", "3"],
        {},
        "unrecognized arguments: --lagom-warmup-iter (did you mean --lagom-warmup-iters?) 3",
    ),
    ("split-slashes", ["--split", "949/50/1"], {}, None),
]


@pytest.mark.parametrize("name, extra, env, line", FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_flag_checked_once_before_any_rank(monkeypatch, capsys, name, extra, env, line):
    t = train([*CPU, *extra], monkeypatch, capsys, world=4, env=env)
    d = doctor([*CPU, *extra], monkeypatch, capsys, world=4, env=env)
    if line is None:
        assert (t.code, d.code, t.started) == (0, 0, True), (t, d)
        return
    assert (t.code, d.code, t.started) == (2, 1, False), (t, d)
    assert len(t.errors) == 1 and line in t.errors[0], t.errors
    assert any(line in e for e in d.errors), d.errors  # the same words from the doctor


def test_every_lagom_only_flag_without_lagom_is_named():
    """The doctor lists one finding per option (training prints the first and counts the rest)."""
    from lagom_megatron.preflight.lagom_flags import LAGOM_ONLY_FLAGS, lagom_flag_problems

    ns = parse_args(
        [
            *CPU,
            "--lagom-plan",
            "p.json",
            "--lagom-report",
            "r.md",
            "--lagom-method",
            "autoccl",
            "--lagom-warmup-iters",
            "2",
            "--lagom-verify-iters",
            "2",
            "--lagom-verify-max-iters",
            "8",
            "--lagom-pool-budget-mib",
            "64",
        ]
    )
    found = lagom_flag_problems(vars(ns))
    assert [f.what for f in found] == [f"{flag} needs --lagom (or drop {flag})" for flag in LAGOM_ONLY_FLAGS]
    assert found[3].why == "without --lagom no hook is installed and --lagom-plan 'p.json' would be ignored"
    assert lagom_flag_problems(dict(vars(ns), lagom=True)) == []
    assert lagom_flag_problems({"lagom": False, "num_layers": 2}) == []  # a Megatron-LM line without lagom's flags


def test_validate_args_refuses_with_the_pre_flight_words():
    """``apply_megatron_lm_defaults`` (inside ``validate_args``) raises the shared rule's first error."""
    for extra in (
        ["--init-method-std", "-1"],
        [*FULL, "--recompute-num-layers", "0"],
        ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "11"],
        ["--lagom-pool-budget-mib", "0"],
    ):
        ns = parse_args(SMALL + extra)
        expected = megatron_flag_problems(vars(ns))[0].what
        with pytest.raises(ValueError) as err:
            validate_args(ns, 1)
        assert str(err.value) == expected


def test_grad_reduce_in_fp32_follows_megatron_lm():
    """Megatron-LM core_v0.16.1 arguments.py:711-724: on with bf16; fp16 keeps what was given."""
    assert validate_args(parse_args(SMALL + ["--bf16"]), 1).accumulate_allreduce_grads_in_fp32 is True
    assert validate_args(parse_args(SMALL + ["--fp16"]), 1).accumulate_allreduce_grads_in_fp32 is False
    assert (
        validate_args(
            parse_args(SMALL + ["--fp16", "--accumulate-allreduce-grads-in-fp32"]), 1
        ).accumulate_allreduce_grads_in_fp32
        is True
    )
    assert validate_args(parse_args(SMALL), 1).accumulate_allreduce_grads_in_fp32 is False


@pytest.mark.parametrize(
    "args, rule, text",
    [
        (
            {"bf16": True, "accumulate_allreduce_grads_in_fp32": True, "main_grads_dtype": "bf16"},
            "grad-reduce",
            "--accumulate-allreduce-grads-in-fp32 with --bf16 needs --main-grads-dtype fp32; got bf16",
        ),
        (
            {"use_torch_fsdp2": True, "gradient_accumulation_fusion": True},
            "grad-reduce",
            "--use-torch-fsdp2 needs --no-gradient-accumulation-fusion",
        ),
        (
            {
                "distribute_saved_activations": True,
                "tensor_model_parallel_size": 1,
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            },
            "recompute",
            "--distribute-saved-activations needs --tensor-model-parallel-size > 1 (got 1)",
        ),
        (
            {"recompute_activations": True, "recompute_method": "block"},
            "recompute",
            "--recompute-granularity selective takes no --recompute-method",
        ),
    ],
)
def test_megatron_lm_lines(args, rule, text):
    """Flags only a Megatron-LM line has (``lagom doctor --megatron-lm``)."""
    found = megatron_flag_problems(args, {})
    assert [(f.rule, text in f.what) for f in found] == [(rule, True)], found


def test_megatron_lm_lines_that_pass():
    assert (
        megatron_flag_problems(
            {"bf16": True, "accumulate_allreduce_grads_in_fp32": True, "main_grads_dtype": "fp32"}, {}
        )
        == []
    )
    assert megatron_flag_problems({"use_torch_fsdp2": True, "gradient_accumulation_fusion": False}, {}) == []
    assert (
        megatron_flag_problems(
            {
                "distribute_saved_activations": True,
                "tensor_model_parallel_size": 2,
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 1,
            },
            {},
        )
        == []
    )


def _find_spec_without(*missing):
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        return None if name in missing else (real(name, *a, **k) or object())

    return find_spec


def test_gradient_accumulation_fusion_on_a_gpu_needs_apex(monkeypatch):
    """megatron-core 0.16.1 tensor_parallel/layers.py:924-933: the local layers raise without APEX's
    fused_weight_gradient_mlp_cuda when the fusion is on (Megatron-LM's default on a GPU)."""
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("fused_weight_gradient_mlp_cuda"))
    ns = validate_args(parse_args(SMALL + ["--transformer-impl", "local"]), 1)
    with pytest.raises(ValueError, match="gradient accumulation fusion .* --no-gradient-accumulation-fusion"):
        check_installed(ns, on_gpu=True)
    check_installed(ns, on_gpu=False)  # CPU runs never fuse
    ns.transformer_impl = "transformer_engine"
    check_installed(ns, on_gpu=True)  # Transformer Engine's layers fuse without APEX
    ns.transformer_impl, ns.gradient_accumulation_fusion = "local", False
    check_installed(ns, on_gpu=True)


def test_flash_attention_needs_its_package(monkeypatch):
    ns = validate_args(parse_args(SMALL + ["--attention-backend", "flash"]), 1)
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("flash_attn", "flash_attn_3"))
    with pytest.raises(ValueError, match="--attention-backend flash needs FlashAttention"):
        check_installed(ns)
    monkeypatch.setattr(importlib.util, "find_spec", _find_spec_without("flash_attn"))
    check_installed(ns)  # FlashAttention 3 is enough


def test_untested_versions_same_verdict_and_override(monkeypatch, capsys):
    """Training refuses torch / megatron-core outside the tested ranges (``check_versions``); the doctor
    now reaches the same verdict on this machine, and ``--lagom-allow-untested-versions`` lets both start."""
    import lagom_megatron.megatron.hooks.versions as versions

    line = "torch 2.99.0 (from site-packages) is outside the tested range >=2.6.0,<2.15"
    monkeypatch.setattr(versions, "untested_versions", lambda: [line])
    t = train(CPU, monkeypatch, capsys, world=4)
    d = doctor(CPU, monkeypatch, capsys, world=4)
    assert (t.code, d.code, t.started) == (2, 1, False)
    assert line in t.errors[0] and any(line == e for e in d.errors), (t, d)
    t = train([*CPU, "--lagom-allow-untested-versions"], monkeypatch, capsys, world=4)
    d = doctor([*CPU, "--lagom-allow-untested-versions"], monkeypatch, capsys, world=4)
    assert (t.code, d.code, t.started) == (0, 0, True), (t, d)
    d = doctor(CPU, monkeypatch, capsys, world=4, env={"LAGOM_ALLOW_UNTESTED_VERSIONS": "1"})
    assert d.code == 0


def test_cuda_absence_is_read_without_importing_torch(tmp_path):
    """The pre-flight of a refused line, in a fresh process, ends without importing torch, and training's
    verdict and line are unchanged. CUDA is certainly absent for a CPU build (``cuda = None`` in
    torch/version.py) and for a Linux CUDA build where ``libcuda.so.1`` does not load (a CUDA wheel on a
    machine without a GPU driver), and then torch agrees: ``is_available()`` is False without a CUDA build,
    and ``cudaGetDeviceCount`` finds no device without a driver (torch/cuda/__init__.py:230-241 @v2.15.0)."""
    import ctypes
    import subprocess
    import sys

    from tests.training.preflight_harness import ROOT

    code = (
        "import sys, runpy\n"
        "sys.argv = ['pretrain_gpt.py', '--preset', 'cpu-tp2-dp2', '--mock-data', '--init-method-std', '-1']\n"
        "try:\n    runpy.run_path('scripts/pretrain_gpt.py', run_name='__main__')\n"
        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n"
    )
    import os

    from tests.training.preflight_harness import CLEAN

    env = {**{k: v for k, v in os.environ.items() if k not in CLEAN}, "RANK": "0", "WORLD_SIZE": "4"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_S
    )
    assert out.stdout.strip() == "exit 2 False", (out.stdout, out.stderr)
    assert "--init-method-std -1.0 is out of range" in out.stderr
    import torch

    from lagom_megatron.preflight.cluster import cuda_certainly_absent

    try:
        ctypes.CDLL("libcuda.so.1")
        driver = True
    except OSError:
        driver = False
    cpu_build = torch.version.cuda is None and torch.version.hip is None
    cuda_build_without_driver = torch.version.hip is None and sys.platform.startswith("linux") and not driver
    assert cuda_certainly_absent() == (cpu_build or cuda_build_without_driver)
    assert not (cuda_certainly_absent() and torch.cuda.is_available())


def test_arguments_are_refused_before_the_machine_is_detected(monkeypatch, capsys):
    """Where finding the GPU would import torch, the argument rules run first: a refused line never
    reaches ``this_machine``; a valid one does, and gets the full verdict."""
    import lagom_megatron.preflight.cluster as cluster
    from lagom_megatron.preflight.cluster import Machine
    from lagom_megatron.training import pretrain_gpt

    detected = []
    monkeypatch.setattr(cluster, "cuda_certainly_absent", lambda: False)
    monkeypatch.setattr(pretrain_gpt, "this_machine", lambda: detected.append(1) or Machine(cuda=False))
    t = train([*CPU, "--recompute-num-layers", "0"], monkeypatch, capsys, world=4)
    assert (t.code, t.started, detected) == (2, False, [])
    assert t.errors == ["pretrain_gpt.py: error: --recompute-num-layers 0 is out of range; allowed: an integer >= 1"]
    t = train([*CPU, "--global-batch-size", "7"], monkeypatch, capsys, world=4)  # a layout rule, also pure
    assert (t.code, detected) == (2, [])
    t = train(CPU, monkeypatch, capsys, world=4)
    assert (t.code, t.started, len(detected)) == (0, True, 1)


def test_a_cluster_named_by_the_flag_gets_another_value_for_that_flag(monkeypatch, capsys):
    from lagom_megatron.preflight.cluster import Machine, choose_cluster, mismatch, this_machine

    given = choose_cluster(None, {}, "h100-sxm-ib400", "--lagom-cluster", Machine(cuda=False))
    assert mismatch(given, Machine(cuda=False)).endswith(
        "or to run it on CPU anyway use --lagom-cluster cpu-gloo instead of --lagom-cluster h100-sxm-ib400"
    )
    ampere = Machine(cuda=True, sm_arch=80, nccl_version="2.21.5")
    assert mismatch(given, ampere).endswith(
        "name a cluster of this GPU with --lagom-cluster (a100-ib100 or a cluster YAML) instead of --lagom-cluster "
        "h100-sxm-ib400"
    )
    preset = choose_cluster("llama3-8b-h100x8", {}, None, "--lagom-cluster", Machine(cuda=False))
    assert mismatch(preset, Machine(cuda=False)).endswith("anyway add --lagom-cluster cpu-gloo")  # not on the line
    if not this_machine().cuda:
        t = train([*CPU, "--lagom-cluster", "h100-sxm-ib400"], monkeypatch, capsys)
        assert (t.code, t.started) == (2, False)
        assert t.errors == [
            "pretrain_gpt.py: error: --lagom-cluster chose cluster 'h100-sxm-ib400' (NCCL 2.30.7, "
            "sm_90 GPUs) but this machine has no CUDA GPU (cpu-gloo); run it on that cluster (lagom "
            "doctor checks it from here), or to run it on CPU anyway use --lagom-cluster cpu-gloo "
            "instead of --lagom-cluster h100-sxm-ib400"
        ]


def test_only_two_lagom_options_work_without_lagom_and_the_docs_name_both(monkeypatch, capsys):
    from lagom_megatron.preflight.lagom_flags import LAGOM_FLAGS, LAGOM_ONLY_FLAGS
    from tests.training.preflight_harness import ROOT

    assert LAGOM_FLAGS - set(LAGOM_ONLY_FLAGS) - {"--lagom"} == {"--lagom-allow-untested-versions", "--lagom-cluster"}
    t = train([*CPU, "--lagom-cluster", "cpu-gloo"], monkeypatch, capsys)
    assert (t.code, t.started, t.errors) == (0, True, [])  # the cluster is read without --lagom
    for doc in ("README.md", "docs/integration.md", "docs/training.md"):
        text = " ".join((ROOT / doc).read_text(encoding="utf-8").split())
        assert (
            "`--lagom-allow-untested-versions` and `--lagom-cluster`" in text
            or "`--lagom-allow-untested-versions` (the version check runs on every run) and `--lagom-cluster`" in text
        ), doc
