"""lagom doctor --megatron-lm: what each Megatron-LM release stops on, named with the release and its line
(the lines were read from core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0 and main d98e8a6, 0.20.0)."""

import pytest

from lagom_megatron.launch.megatron_args import argv_to_args
from lagom_megatron.preflight.megatron_lm import RELEASES, choose_release, megatron_lm_traps, release_key

LINE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "8",
    "--transformer-impl",
    "local",
    "--bf16",
]


def nothing(module):
    return False


def everything(module):
    return True


def whats(findings):
    return [(f.level, f.what, f.why) for f in findings]


@pytest.mark.parametrize(
    "release, line",
    [
        ("core_v0.16.1", "training.py:3307"),
        ("core_v0.17.1", "training.py:3547"),
        ("core_v0.18.2", "training.py:4136"),
        ("core_v0.19.1", "training.py:4481"),
        ("core_v0.20.0", "training.py:5436"),
    ],
)
def test_missing_eval_interval_names_the_release_and_line(release, line):
    found = megatron_lm_traps(argv_to_args(LINE), release, local=True, installed=everything)
    assert whats(found) == [
        (
            "error",
            f"no --eval-interval: Megatron-LM {release} computes train_iters // eval_interval",
            f"megatron/training/{line} raises TypeError before the first iteration",
        )
    ]
    assert (
        megatron_lm_traps(argv_to_args(LINE + ["--eval-interval", "4"]), release, local=True, installed=everything)
        == []
    )
    assert megatron_lm_traps(argv_to_args(LINE + ["--skip-train"]), release, local=True, installed=everything) == []


def test_fused_kernels_without_apex():
    args = argv_to_args(LINE + ["--eval-interval", "4"])
    found = megatron_lm_traps(
        args, "core_v0.17.1", local=True, installed=lambda m: m != "apex" and m != "scaled_masked_softmax_cuda"
    )
    assert [f.why for f in found] == [
        "Megatron-LM core_v0.17.1 builds torch's LayerNorm, which asserts not persist_layer_norm "
        "(megatron/core/transformer/torch_norm.py:48)",
        "Megatron-LM core_v0.17.1 imports it for these shapes (megatron/core/fusions/fused_softmax.py:357)",
    ]
    fixed = argv_to_args(LINE + ["--eval-interval", "4", "--no-persist-layer-norm", "--no-masked-softmax-fusion"])
    assert megatron_lm_traps(fixed, "core_v0.17.1", local=True, installed=lambda m: m != "apex") == []
    # another cluster: warnings (its Python is not this one); Transformer Engine layers use neither kernel
    assert {f.level for f in megatron_lm_traps(args, "core_v0.16.1", local=False, installed=nothing)} == {"warning"}
    te = argv_to_args([w for w in LINE if w != "local" and w != "--transformer-impl"] + ["--eval-interval", "4"])
    assert megatron_lm_traps(te, "core_v0.16.1", local=True, installed=lambda m: m != "apex") == []
    # the fused softmax is only picked for some shapes: seq 16 is below its range
    short = argv_to_args(LINE + ["--eval-interval", "4", "--no-persist-layer-norm", "--seq-length", "16"])
    assert megatron_lm_traps(short, "core_v0.16.1", local=True, installed=lambda m: m != "apex") == []


def test_megatron_fsdp_needs_the_dtensor_checkpoint_format():
    args = argv_to_args(
        LINE + ["--eval-interval", "4", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--use-megatron-fsdp"]
    )
    found = megatron_lm_traps(args, "core_v0.18.2", local=True, installed=everything)
    assert [f.why for f in found] == [
        "Megatron-LM core_v0.18.2 asserts ckpt_format == 'fsdp_dtensor' (megatron/training/arguments.py:1142)"
    ]
    args["ckpt_format"] = "fsdp_dtensor"
    assert megatron_lm_traps(args, "core_v0.18.2", local=True, installed=everything) == []


def test_missing_packages_where_the_checkout_is_importable():
    args = argv_to_args(LINE + ["--eval-interval", "4", "--no-persist-layer-norm", "--no-masked-softmax-fusion"])
    checkout_only = lambda m: m in ("megatron.training", "apex")  # noqa: E731
    found = megatron_lm_traps(args, "core_v0.16.1", local=True, installed=checkout_only)
    assert [(f.what, f.why) for f in found] == [
        (
            "Python package six is missing in this Python",
            "Megatron-LM core_v0.16.1 needs it: megatron/training/tokenizer/bert_tokenization.py:25",
        ),
        (
            "Python package regex is missing in this Python",
            "Megatron-LM core_v0.16.1 needs it: megatron/training/tokenizer/gpt2_tokenization.py:25",
        ),
        (
            "Python package pybind11 is missing in this Python",
            "Megatron-LM core_v0.16.1 needs it: megatron/core/datasets/Makefile (the dataset helper's build)",
        ),
        (
            "Python package triton is missing in this Python",
            "Megatron-LM core_v0.16.1 needs it: megatron/core/transformer/custom_layers/batch_invariant_kernels.py:15",
        ),
    ]
    assert found[0].fix == "pip install 'lagom-megatron[megatron-lm]'"
    on_cpu = megatron_lm_traps(args, "core_v0.16.1", local=True, installed=checkout_only, on_gpu=False)
    assert [f.what.split()[2] for f in on_cpu] == ["six", "regex", "pybind11"]  # the CPU launcher stands in for triton
    assert (
        megatron_lm_traps(args, "core_v0.16.1", local=True, installed=lambda m: m == "apex") == []
    )  # no checkout here


def test_release_names():
    assert release_key("core_v0.16.1") == release_key("0.16.0") == "core_v0.16"
    assert release_key("core_v0.19.1") == "core_v0.19" and release_key("0.20.0rc1") == "core_v0.20"
    assert release_key("core_v0.21.0") == release_key("1.0.0") == RELEASES[-1] == "core_v0.20"  # the newest rules
    for bad in ("core_v0.15.3", "main", "0"):
        with pytest.raises(ValueError, match=rf"^'{bad}' is not one of the Megatron-LM releases the doctor knows"):
            release_key(bad)


def test_an_unknown_release_given_is_named_with_the_known_ones():
    with pytest.raises(ValueError) as err:
        choose_release("core_v0.15.3", "0.19.2")
    assert str(err.value) == (
        "--megatron-lm-release 'core_v0.15.3' is not one of the Megatron-LM releases the doctor knows "
        "(core_v0.16.x, core_v0.17.x, core_v0.18.x, core_v0.19.x, core_v0.20.x (core_v0.20: main), or newer)"
    )


def test_a_newer_release_gets_the_newest_rules_and_one_warning():
    for given, installed in ((None, "0.21.0"), ("core_v0.22.1", "0.16.1")):
        release, notes = choose_release(given, installed)
        assert release == (given or "core_v0.21.0")
        assert [(f.level, f.rule) for f in notes] == [("warning", "megatron-lm")]
        assert notes[0].what.startswith(f"Megatron-LM {release} is newer than the releases the doctor knows")
        found = megatron_lm_traps(argv_to_args(LINE), release, local=True, installed=everything)
        assert [f.why for f in found] == [
            "megatron/training/training.py:5436 raises TypeError before the first iteration"
        ]
    assert choose_release(None, "0.19.1") == ("core_v0.19.1", []) and choose_release("0.20.0", None) == ("0.20.0", [])
    assert choose_release(None, None) == ("core_v0.16.1", [])  # no megatron-core here: the oldest rules


def test_an_unreadable_installed_release_skips_the_traps_with_a_warning():
    release, notes = choose_release(None, "unknown")
    assert release is None and [(f.level, f.what) for f in notes] == [
        (
            "warning",
            "Megatron-LM core_vunknown (the importable megatron-core) is none of the releases the doctor knows "
            "(core_v0.16.x, core_v0.17.x, core_v0.18.x, core_v0.19.x, core_v0.20.x (core_v0.20: main), or newer)",
        )
    ]


def test_megatron_fsdp_v2_refuses_the_distributed_optimizer_on_main():
    args = argv_to_args(FSDP_LINE + ["--megatron-fsdp-version", "2"])
    found = megatron_lm_traps(args, "core_v0.20.0", local=True, installed=everything)
    assert [(f.level, f.why) for f in found] == [
        (
            "error",
            "Megatron-LM core_v0.20.0 asserts Megatron-FSDP v2 runs without it "
            "(megatron/training/arguments.py:1124-1126)",
        )
    ]
    assert megatron_lm_traps(args, "core_v0.19.1", local=True, installed=everything) == []  # no v2 there


FSDP_LINE = LINE + [
    "--eval-interval",
    "4",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--use-megatron-fsdp",
    "--ckpt-format",
    "fsdp_dtensor",
    "--use-distributed-optimizer",
]


@pytest.mark.parametrize(
    "release, line", [("core_v0.16.1", "arguments.py:2307"), ("core_v0.17.1", "arguments.py:2722")]
)
def test_megatron_fsdp_without_a_strategy_shards_nothing_before_core_v0_18(release, line):
    found = megatron_lm_traps(argv_to_args(FSDP_LINE), release, local=True, installed=everything)
    assert [(f.level, f.rule, f.what) for f in found] == [
        (
            "warning",
            "fsdp-sharding",
            f"--use-megatron-fsdp with --data-parallel-sharding-strategy no_shard "
            f"(Megatron-LM {release}'s default, megatron/training/{line})",
        )
    ]
    sharded = argv_to_args(FSDP_LINE + ["--data-parallel-sharding-strategy", "optim_grads_params"])
    assert megatron_lm_traps(sharded, release, local=True, installed=everything) == []
    # core_v0.18.2's parser defaults to optim_grads_params (arguments.py:2805)
    assert megatron_lm_traps(argv_to_args(FSDP_LINE), "core_v0.18.2", local=True, installed=everything) == []


@pytest.mark.parametrize(
    "release, line",
    [
        ("core_v0.16.1", "arguments.py:684"),
        ("core_v0.17.1", "arguments.py:965"),
        ("core_v0.18.2", "arguments.py:1136"),
        ("core_v0.19.1", "arguments.py:1140"),
        ("core_v0.20.0", "arguments.py:1163"),
    ],
)
def test_weight_hash_check_with_full_sharding_is_asserted(release, line):
    args = argv_to_args(
        FSDP_LINE
        + [
            "--data-parallel-sharding-strategy",
            "optim_grads_params",
            "--check-weight-hash-across-dp-replicas-interval",
            "10",
        ]
    )
    found = megatron_lm_traps(args, release, local=True, installed=everything)
    assert [(f.level, f.why) for f in found] == [
        (
            "error",
            f"Megatron-LM {release} asserts it is unset with optim_grads_params (megatron/training/{line}): "
            "each rank holds a different shard of the weights",
        )
    ]
    args["data_parallel_sharding_strategy"] = "optim_grads"  # only optim_grads_params is asserted
    assert megatron_lm_traps(args, release, local=True, installed=everything) == []
    implied = argv_to_args(FSDP_LINE + ["--check-weight-hash-across-dp-replicas-interval", "10"])
    assert [f.level for f in megatron_lm_traps(implied, "core_v0.18.2", local=True, installed=everything)] == ["error"]


def test_meta_device_with_no_shard_raises_from_core_v0_18():
    args = argv_to_args(FSDP_LINE + ["--data-parallel-sharding-strategy", "no_shard", "--init-model-with-meta-device"])
    found = megatron_lm_traps(args, "core_v0.18.2", local=True, installed=everything)
    assert [(f.level, f.why) for f in found] == [
        ("error", "Megatron-LM core_v0.18.2 raises ValueError for it (megatron/training/arguments.py:1151)")
    ]
    assert megatron_lm_traps(args, "core_v0.16.1", local=True, installed=everything) == []  # no such check there
    for release, line in (("core_v0.19.1", "arguments.py:1160"), ("core_v0.20.0", "arguments.py:1183")):
        found = megatron_lm_traps(args, release, local=True, installed=everything)
        assert [f.why for f in found] == [f"Megatron-LM {release} raises ValueError for it (megatron/training/{line})"]


@pytest.mark.parametrize(
    "release, line",
    [
        ("core_v0.16.1", "arguments.py:1050"),
        ("core_v0.17.1", "arguments.py:1341"),
        ("core_v0.18.2", "arguments.py:1507"),
    ],
)
def test_dtensor_checkpoints_need_megatron_fsdp(release, line):
    args = argv_to_args(
        LINE
        + [
            "--eval-interval",
            "4",
            "--no-persist-layer-norm",
            "--no-masked-softmax-fusion",
            "--ckpt-format",
            "fsdp_dtensor",
        ]
    )
    found = megatron_lm_traps(args, release, local=True, installed=everything)
    assert [(f.level, f.why) for f in found] == [
        ("error", f"Megatron-LM {release} asserts use_megatron_fsdp for it (megatron/training/{line})")
    ]


def test_megatron_fsdp_without_the_distributed_optimizer_is_named_before_core_v0_18():
    line = [w for w in FSDP_LINE if w != "--use-distributed-optimizer"] + [
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
    ]
    found = megatron_lm_traps(argv_to_args(line), "core_v0.17.1", local=True, installed=everything)
    assert [(f.level, f.what) for f in found] == [
        ("warning", "--use-megatron-fsdp without --use-distributed-optimizer")
    ]
    assert "core_v0.18.2 megatron/training/arguments.py:1113-1119 turns it on itself" in found[0].why
    assert megatron_lm_traps(argv_to_args(line), "core_v0.18.2", local=True, installed=everything) == []


@pytest.mark.parametrize("folder, checkout", [("site-packages", False), ("Megatron-LM", True)])
def test_only_a_checkouts_megatron_training_asks_for_its_packages(tmp_path, monkeypatch, folder, checkout):
    """megatron-core wheels ship ``megatron.training`` from 0.19 on; only a checkout's counts (it builds the dataset
    helper at start with pybind11, a wheel has no Makefile to build)."""
    import sys

    from lagom_megatron.preflight.megatron_lm import CHECKOUT, _installed

    root = tmp_path / folder
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (root / "megatron" / "training" / "__init__.py").write_text("")
    saved = {m: mod for m, mod in sys.modules.items() if m == "megatron" or m.startswith("megatron.")}
    for name in saved:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(root))
    try:
        assert _installed(CHECKOUT) is checkout
    finally:  # the stand-in package must not outlive the test, nor hide the real one
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]
        sys.modules.update(saved)
