"""The plugin's ABI declarations have NCCL's sizes and offsets: every struct of tuner ABI v3-v7 and
profiler ABI v1-v7 that lagom's library exports or reads.

``nccl/plugin/test/abi_layout.c`` prints them from lagom's own headers; they must equal the table
read from NCCL's headers (``nccl_abi_layout.py``). With ``LAGOM_NCCL_SRC`` naming an NCCL source
checkout (2.30 or newer: it has ``src/include/plugin/profiler/profiler_v1.h`` .. ``_v6.h`` and
``src/include/plugin/tuner/tuner_v3.h`` .. ``_v6.h``), the same program is also compiled against
that checkout's headers, copied into a temporary folder, and the two outputs are compared, v7 too
where the checkout has ``tuner_v7.h`` (2.32) or ``profiler_v7.h`` (2.31); without it that check is
skipped with the reason (NCCL's files are never kept in this repository).
"""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lagom_megatron.nccl.plugin import PLUGIN_DIR
from tests.nccl.nccl_abi_layout import NCCL_ABI_LAYOUT

SOURCE = PLUGIN_DIR / "test" / "abi_layout.c"
pytestmark = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: the layout program is built with it"),
    pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="the table holds LP64 sizes (x86-64, aarch64)"),
]

PRELUDE = """\
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sys/types.h>
// What NCCL's plugin headers take from nccl.h, nccl_common.h and os.h.
typedef enum { ncclSuccess = 0 } ncclResult_t;
typedef enum { ncclFuncBroadcast = 0 } ncclFunc_t;
typedef enum { NCCL_LOG_NONE = 0 } ncclDebugLogLevel;
typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                                  const char *fmt, ...);
typedef pid_t ncclPid_t;
typedef int ncclProfilerEventState_t;
typedef ncclProfilerEventState_t ncclProfilerEventState_v1_t, ncclProfilerEventState_v2_t,
    ncclProfilerEventState_v3_t, ncclProfilerEventState_v4_t, ncclProfilerEventState_v5_t,
    ncclProfilerEventState_v6_t, ncclProfilerEventState_v7_t;
"""
TUNER_HEADERS = [f"plugin/tuner/tuner_v{v}.h" for v in (3, 4, 5, 6)]
PROFILER_HEADERS = [f"plugin/profiler/profiler_v{v}.h" for v in (1, 2, 3, 4, 5, 6)]
V7_HEADERS = {"plugin/tuner/tuner_v7.h": "LAGOM_ABI_TUNER_V7", "plugin/profiler/profiler_v7.h": "LAGOM_ABI_PROFILER_V7"}
"""The v7 headers (NCCL 2.32 and 2.31) and the macro that has ``abi_layout.c`` print their structs."""


def _layout(binary: Path) -> dict[str, int]:
    out = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=30).stdout
    return {key: int(value) for key, value in (line.split() for line in out.splitlines())}


def _ours(tmp_path: Path) -> dict[str, int]:
    binary = tmp_path / "abi_ours"
    proc = subprocess.run(
        ["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(SOURCE)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return _layout(binary)


def test_lagoms_declarations_have_nccls_layout(tmp_path):
    ours = _ours(tmp_path)
    assert set(ours) == set(NCCL_ABI_LAYOUT), sorted(set(ours) ^ set(NCCL_ABI_LAYOUT))
    wrong = {k: (ours[k], NCCL_ABI_LAYOUT[k]) for k in ours if ours[k] != NCCL_ABI_LAYOUT[k]}
    assert not wrong, f"(lagom's, NCCL's) bytes differ: {wrong}"


def test_table_covers_every_exported_version():
    """Every ABI version the library exports has its plugin struct and descriptor in the table (a
    version added to the plugin without a row here would go unchecked)."""
    for v in range(1, 8):
        assert f"ncclProfiler_v{v}_t" in NCCL_ABI_LAYOUT and f"ncclProfilerEventDescr_v{v}_t" in NCCL_ABI_LAYOUT
    for v in range(3, 8):
        assert f"ncclTuner_v{v}_t" in NCCL_ABI_LAYOUT
    # values counted by hand from the headers' member lists: the union starts at 24 (type, parentObj,
    # rank); v4 dropped name and commHash (16 bytes) before nChannels; v6's copy-engine members end
    # where v5's coll ends (parentGroup at 104), so both descriptors are 112 bytes
    assert (
        NCCL_ABI_LAYOUT["ncclProfilerEventDescr_v5_t"] == 112 and NCCL_ABI_LAYOUT["ncclProfilerEventDescr_v6_t"] == 112
    )
    assert NCCL_ABI_LAYOUT["ncclProfilerEventDescr_v3_t.coll.nMaxChannels"] == 96
    assert NCCL_ABI_LAYOUT["ncclProfilerEventDescr_v4_t.coll.nChannels"] == 80
    assert NCCL_ABI_LAYOUT["ncclTuner_v6_t.getChunkSize"] == 32
    # v7 (profiler_v7.h:47-63 @8898068): coll appends kernelVariant (8), isSymColl (1, padded to 8) and
    # userTag (8) after v6's parentGroup at 104, so coll and the descriptor end at 136; the tuner struct
    # keeps v6's five pointers (tuner_v7.h:55-117 @2449986f)
    assert NCCL_ABI_LAYOUT["ncclProfilerEventDescr_v7_t.coll.userTag"] == 128
    assert NCCL_ABI_LAYOUT["ncclProfilerEventDescr_v7_t"] == 136
    assert NCCL_ABI_LAYOUT["ncclTuner_v7_t"] == 40


def test_live_against_nccls_own_headers(tmp_path):
    src = os.environ.get("LAGOM_NCCL_SRC")
    if not src:
        pytest.skip("LAGOM_NCCL_SRC is unset: name an NCCL source checkout (2.29+) to compare with its headers too")
    include = Path(src) / "src" / "include"
    missing = [h for h in TUNER_HEADERS + PROFILER_HEADERS if not (include / h).is_file()]
    if missing:
        pytest.skip(f"{include} lacks {', '.join(missing)} (an NCCL older than 2.29?)")
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: NCCL's headers are C++")
    v7 = [h for h in V7_HEADERS if (include / h).is_file()]
    headers = TUNER_HEADERS + PROFILER_HEADERS + v7
    work = tmp_path / "inc"
    for h in headers:  # copied into the temporary folder only
        (work / h).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(include / h, work / h)
    (work / "lagom_abi_nccl_prelude.h").write_text(PRELUDE + "".join(f'#include "{h}"\n' for h in headers))
    binary = tmp_path / "abi_nccl"
    proc = subprocess.run(
        ["g++", "-x", "c++", "-DLAGOM_ABI_NCCL", *(f"-D{V7_HEADERS[h]}" for h in v7), f"-I{work}", "-o", str(binary)]
        + [str(SOURCE)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = _layout(binary)
    header_of = {"ncclTuner_v7_t": "plugin/tuner/tuner_v7.h"}  # every other *_v7_t key: profiler_v7.h
    kept = {
        k: n
        for k, n in _ours(tmp_path).items()
        if "_v7_t" not in k or header_of.get(k.split(".")[0], "plugin/profiler/profiler_v7.h") in v7
    }
    assert theirs == kept
