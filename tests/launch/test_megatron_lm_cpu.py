"""launch/megatron_lm_cpu.py without a checkout: the triton stand-in is seen by the modules imported under
it and by nothing after; the launcher's usage; the Megatron-LM shims' lines exist as cited (the shims
themselves run in tests/launch/test_megatron_lm_real_loop.py, which needs a checkout)."""

import importlib
import importlib.util
import sys

import pytest

from lagom_megatron.launch import megatron_lm_cpu

needs_no_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is not None, reason="triton is installed: no stand-in is used"
)


@needs_no_triton
def test_modules_importing_triton_get_the_stand_in_and_nothing_else_does(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_mlm_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # as Megatron-LM's batch_invariant_kernels.py does at import time: import, decorate, annotate
    (pkg / "kernels.py").write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef kernel(x, BLOCK: tl.constexpr):\n    return x + 1\n\n"
        "@triton.jit(launch_metadata=None)\ndef other(x):\n    return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = megatron_lm_cpu.import_with_triton_stand_in(
        ("fake_mlm_pkg.kernels", "fake_mlm_pkg.absent", "no_such_package.module")
    )
    assert imported == ["fake_mlm_pkg.kernels"]
    kernels = sys.modules["fake_mlm_pkg.kernels"]
    assert kernels.kernel(1, 8) == 2 and kernels.other(3) == 3  # the decorators return the function
    assert "triton" not in sys.modules and "triton.language" not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module("triton")
    from torch.utils._triton import has_triton_package

    assert has_triton_package() is False


def test_launcher_usage(capsys, tmp_path):
    assert (
        megatron_lm_cpu.main([]) == 2
        and "usage: python -m lagom_megatron.launch.megatron_lm_cpu" in capsys.readouterr().err
    )
    assert megatron_lm_cpu.main(["--help"]) == 0 and "usage:" in capsys.readouterr().out
    assert megatron_lm_cpu.main([str(tmp_path / "pretrain_gpt.py")]) == 2
    assert "is not a file; give the path of a patched Megatron-LM pretrain_gpt.py" in capsys.readouterr().err


def test_launcher_runs_the_script_as_main_with_its_arguments(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        "import sys\nprint('main' if __name__ == '__main__' else 'imported', sys.argv[1:])\nsys.exit(3)\n"
    )
    assert megatron_lm_cpu.main([str(script), "--eval-interval", "4"]) == 3
    assert capsys.readouterr().out == "main ['--eval-interval', '4']\n"


def test_the_shims_apply_nothing_on_a_gpu_machine(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_lm_cpu.apply() is False and not megatron_lm_cpu.is_applied()


def test_megatron_lm_torch_has_one_device_and_streams_that_never_wait():
    from lagom_megatron.training import cpu_shims

    cuda = cpu_shims.make_cpu_torch(megatron_lm_cpu._CpuCuda).cuda
    assert cuda.device_count() == 1 and cuda.Stream is cpu_shims.NoStream
    stream = cuda.Stream()
    stream.wait_stream(cuda.current_stream())  # training.py's DDP stream (:1876-1879 @core_v0.19.0)
    cuda.current_stream().wait_event(object())  # start_grad_sync (param_and_grad_buffer.py:638 @core_v0.19.0)
    with cuda.stream(stream):
        pass


def test_a_failed_real_loop_shows_the_ranks_traceback_not_torchruns_summary():
    from tests.launch.test_megatron_lm_real_loop import rank_failure

    log = "\n".join(
        [
            " [after dataloaders are built] ...",
            "[rank1]: Traceback (most recent call last):",
            "[rank0]: Traceback (most recent call last):",
            '[rank1]:   File "param_and_grad_buffer.py", line 632, in start_grad_sync',
            "W1206 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 11 closing signal SIGTERM",
            "[rank1]:     current_stream = torch.cuda.current_stream()",
            "[rank1]: RuntimeError: Found no NVIDIA driver on your system.",
            "[rank0]:   File x",
            *["E1206 failed (exitcode: -15) local_rank: 2 (pid: 12) of binary: python"] * 40,
        ]
    )
    assert rank_failure(log) == "\n".join(
        [
            "the first rank's traceback:",
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "param_and_grad_buffer.py", line 632, in start_grad_sync',
            "[rank1]:     current_stream = torch.cuda.current_stream()",
            "[rank1]: RuntimeError: Found no NVIDIA driver on your system.",
        ]
    )
    refused = "args dump\nlagom: error: megatron-core 0.21.0 is outside the tested range\nE1206 exitcode: 2"
    assert rank_failure(refused) == "lagom refused:\nlagom: error: megatron-core 0.21.0 is outside the tested range"
    assert rank_failure("a\nb") == "last lines:\na\nb"


def test_the_docs_megatron_lm_cpu_line_is_the_real_loops_and_finishes_tuning():
    """docs/launching.md's CPU line is what tests/launch/test_megatron_lm_real_loop.py trains (TP2 x DP2, --lagom),
    and its --train-iters cover the iterations the tuner needs to reach a verdict on gloo."""
    import re
    import shlex
    from pathlib import Path

    from lagom_megatron.engine.tuner import Tuner
    from lagom_megatron.megatron.pool.comm_pool import rules_for
    from lagom_megatron.preflight.cluster import load_cluster
    from tests.launch.test_megatron_lm_real_loop import LAGOM, LAYOUTS, TINY

    text = (Path(__file__).resolve().parents[2] / "docs" / "launching.md").read_text()
    block = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if "launch.megatron_lm_cpu pretrain_gpt.py" in b)
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    argv = words[words.index("pretrain_gpt.py") + 1 :]
    assert argv == TINY + LAYOUTS["tp2xdp2"] + LAGOM
    warmup, verify = (int(argv[argv.index(flag) + 1]) for flag in ("--lagom-warmup-iters", "--lagom-verify-iters"))
    tuner = Tuner(
        Tuner.Config(warmup_iters=warmup, verify_iters=verify),
        rules=rules_for("gloo", load_cluster("cpu-gloo", "cluster")),
    )
    assert int(argv[argv.index("--train-iters") + 1]) >= tuner.total_iters == warmup + 2 + 3 + 1 + 2 * verify
    assert (
        Tuner(Tuner.Config(), rules=rules_for("gloo", load_cluster("cpu-gloo", "cluster"))).total_iters == 18
    )  # as the docs say
