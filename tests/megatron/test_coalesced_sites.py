"""Collectives issued inside a ``_coalescing_manager`` as sites, run for real on two gloo processes.

One launch of ``coalesced_worker.worker`` (2 processes, FileStore, no port) installs
``patches.install`` with the Transformer Engine stand-in (``te_standin``) and runs:

* TE's quantized sequence-parallel gathers (MXFP8, FP8 block scaling, NVFP4): the stand-in's
  column-parallel ``Linear`` with an input quantizer gathers its input in backward through
  ``gather_along_first_dim(..., async_op=True, quantizer=...)``, which calls the coalesced helper
  exactly as TE v2.18 does (``te_standin/distributed.py``); the forward gather is synchronous.
"""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from .coalesced_worker import worker  # noqa: E402

# Bytes one coalesced backward gather moves (2 ranks, 128 x 128 per rank, column-wise usage only):
# MXFP8: data [256, 128] uint8 + scale-inverses [ru(256 / 32, 4), ru(128, 128)] = [8, 128] uint8;
# FP8 1x128 blocks: transposed data [2 x 128, 128] uint8 + scale-inverses [256 / 128, ru(128, 4)] float32;
# NVFP4: transposed packed data [2 x 128, 64] uint8 + unpadded scale-inverses [2 x 128, 128 / 16] uint8.
GATHERED = {"MXFP8Quantizer": 256 * 128 + 8 * 128, "Float8BlockQuantizer": 256 * 128 + 2 * 128 * 4,
            "NVFP4Quantizer": 256 * 64 + 256 * 8}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("coalesced")
    mp.spawn(worker, args=(str(out / "store"), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("recipe", sorted(GATHERED))
def test_te_quantized_backward_gather_is_the_module_site(ranks, recipe):
    for r in ranks:
        rec = r[f"{recipe}_records"]
        # one site for the coalesced gather (data and scale-inverses), named like the plain-tensor one
        assert rec["tp.sp_all_gather[chunk0.fc1]"] == ["all_gather", GATHERED[recipe], 1, "tp", "uint8"]
        # the dgrad reduce-scatter of the same backward, a plain tensor: [256, 8] @ [8, 128] float32 in
        assert rec["tp.sp_reduce_scatter[chunk0.fc1]"] == ["reduce_scatter", 256 * 128 * 4, 1, "tp", "float32"]
        assert len(rec) == 2, rec  # the synchronous forward gather is not a site
        assert r[f"{recipe}_same_hooked"] and r[f"{recipe}_same_routed"]
        comm, comp, region = r[f"{recipe}_serialized"]["tp.sp_all_gather[chunk0.fc1]"]
        assert comm > 0 and comp >= 0 and region > 0
        comm, comp, region = r[f"{recipe}_overlapped"]["tp.sp_all_gather[chunk0.fc1]"]
        assert math.isnan(comp) and region > 0  # timed as an overlapped call


@pytest.mark.parametrize("recipe", sorted(GATHERED))
def test_te_quantized_gather_routes_the_manager_and_every_inner_call(ranks, recipe):
    for r in ranks:
        assert r[f"{recipe}_routed_calls"] == 1
        seen = r[f"{recipe}_routed_groups"]
        # forward: the synchronous gather on TP itself; backward: the manager and its 2 inner
        # gathers (column-wise data and scale-inverses) all on the pool entry of "tp"
        assert seen[0] == ["manager", "tp", True], seen
        assert seen[3:] == [["manager", "tp", False], ["all_gather", "tp", False], ["all_gather", "tp", False]], seen


def test_the_quantized_gathers_were_patched(ranks):
    patched = set(ranks[0]["patched"])
    for name in ("_all_gather_mxfp8", "_all_gather_nvfp4", "_start_all_gather_fp8_blockwise"):
        assert f"tests.megatron.te_standin.distributed.{name}" in patched, sorted(patched)
