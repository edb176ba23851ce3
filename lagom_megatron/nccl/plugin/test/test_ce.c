/*
 * Harness cases of the profiler half for copy-engine (CE) collectives, profiler ABI v6 and v7
 * (NCCL 2.29+), driven in NCCL's order.
 *
 * One CE all-gather as NVIDIA/nccl v2.30.7 reports it, on a communicator of 8 ranks in one NVLink
 * domain (ncclLaunchCeColl, src/ce_coll.cc:1361-1410; ncclCeAllGather, :497-547; the profiler
 * calls, src/plugin/profiler.cc:823-938), each gated on NCCL's process-wide activation mask as NCCL
 * gates it:
 *   startEvent ceColl            when the mask has any CE bit (:826-827); parent the collApi
 *                                handle, NULL here (lagom asks for no API event; :830); seqNumber
 *                                and ceSeqNum the communicator's CE sync count (:833, :845)
 *   ceSync start / stop          before the copies (ncclMemOpSync, ce_coll.cc:511, :248, :280), when
 *                                the mask has CeSync and the ceColl handle is not NULL (:872-873);
 *                                each sync adds 1 to the CE sync count (ce_coll.cc:143)
 *   ceBatch start / stop         around the copies (ncclCeLaunchBatchOps, ce_coll.cc:537, :365, :490),
 *                                when the mask has CeBatch (:906-908): numOps copies (the rank's
 *                                own share when out of place, then one per peer, :514-530), their
 *                                total bytes (:916-920), useIntraSync (numOps > 8 and >= 512 MiB,
 *                                :533-534, :20-22)
 *   ceSync start / stop          after them (ce_coll.cc:540)
 *   stopEvent ceColl             (:857-865)
 * with no recordEventState (src/include/plugin/profiler/profiler_v6.h:124-125). NCCL enqueues a CE
 * all-gather's count in bytes, as ncclInt8 (ceCollTaskAppend, src/enqueue.cc:2785-2788). v7 (2.31.2)
 * makes the same calls with a userTag in ceColl (ncclProfilerStartCeCollEvent @8898068).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define CE_BITS (LAGOM_PROFILE_CE_COLL | LAGOM_PROFILE_CE_SYNC | LAGOM_PROFILE_CE_BATCH)

static unsigned gCeSeq;     /* the communicator's CE sync count (comm->ceColl.ceSeqNum) */
static int gSyncs;          /* ceSync events NCCL sent (its mask had CeSync) */
static int gSyncHandles;    /* ceSync events that got a handle (lagom gives none) */
static int gBatchHandles;   /* ceBatch events that got a handle (lagom gives none) */

static void *ceStart(int v, void *ctx, void *descr) {
  void *h = NULL;
  ((const lagomProfiler_v6_t *)profilerStruct(v))->startEvent(ctx, &h, descr); /* v6 and v7 alike */
  return h;
}
static void ceStop(int v, void *h) {
  if (h) ((const lagomProfiler_v6_t *)profilerStruct(v))->stopEvent(h);
}

/* One child event (ceSync or ceBatch) under `coll`, as ncclMemOpSync / ncclCeLaunchBatchOps make it. */
static void ceChild(int v, void *ctx, void *coll, int type, int numOps, size_t totalBytes) {
  int isComplete = gCeSeq % 2; /* comm->ceColl.useCompletePtr flips at every sync (ce_coll.cc:276) */
  if (type == LAGOM_PROFILE_CE_SYNC) gCeSeq++; /* whether or not the profiler hears of it */
  if (!coll || !(gNcclMask & type)) return;
  lagomProfilerDescr_v7_t d = {.type = (uint64_t)type, .parentObj = coll, .rank = 3};
  if (type == LAGOM_PROFILE_CE_SYNC) {
    d.ceCollSync.isComplete = isComplete, d.ceCollSync.nRanks = 8;
    gSyncs++;
  } else {
    d.ceCollBatch.numOps = numOps, d.ceCollBatch.totalBytes = totalBytes, d.ceCollBatch.useIntraSync = false;
  }
  void *h = ceStart(v, ctx, &d); /* v6's descriptor is v7's without the members v7 appends */
  if (h) ++*(type == LAGOM_PROFILE_CE_SYNC ? &gSyncHandles : &gBatchHandles);
  ceStop(v, h);
}

/* One CE all-gather of `bytes` per rank on 8 ranks, out of place: 8 copies of `bytes` each. Returns
 * the ceColl handle lagom gave (already stopped; NULL when NCCL would start no event). */
void *driveCeAllGather(int v, void *ctx, size_t bytes) {
  void *coll = NULL;
  if (gNcclMask & CE_BITS) {
    lagomProfilerDescr_v7_t d = {.type = LAGOM_PROFILE_CE_COLL, .parentObj = NULL, .rank = 3};
    d.ceColl.seqNumber = gCeSeq, d.ceColl.func = "AllGather", d.ceColl.sendBuff = &d;
    d.ceColl.recvBuff = &d, d.ceColl.count = bytes, d.ceColl.root = 0, d.ceColl.datatype = "ncclInt8";
    d.ceColl.syncStrategy = "MC", d.ceColl.intraBatchSync = false, d.ceColl.ceSeqNum = gCeSeq;
    if (v == 7) d.ceColl.userTag = 0x7a9;
    if (v == 6) {
      lagomProfilerDescr_v6_t d6 = {.type = d.type, .parentObj = NULL, .rank = 3};
      memcpy(&d6.ceColl, &d.ceColl, sizeof(d6.ceColl)); /* v7 only appends userTag */
      coll = ceStart(v, ctx, &d6);
    } else {
      coll = ceStart(v, ctx, &d);
    }
  }
  ceChild(v, ctx, coll, LAGOM_PROFILE_CE_SYNC, 0, 0);
  ceChild(v, ctx, coll, LAGOM_PROFILE_CE_BATCH, 8, 8 * bytes);
  ceChild(v, ctx, coll, LAGOM_PROFILE_CE_SYNC, 0, 0);
  ceStop(v, coll);
  return coll;
}

/* The fallback: the same all-gather on SM kernels (CE unavailable, src/enqueue.cc:3054), ring /
 * simple on 8 channels, as an ordinary coll event. */
static void driveSmAllGather(int v, void *ctx, size_t bytes) {
  lagomProfilerDescr_v7_t d = {.type = LAGOM_PROFILE_COLL, .rank = 3};
  d.coll.func = "AllGather", d.coll.count = bytes, d.coll.datatype = "ncclInt8", d.coll.nChannels = 8;
  d.coll.nWarps = 16, d.coll.algo = "RING", d.coll.proto = "SIMPLE";
  lagomProfilerDescr_v6_t d6 = {.type = d.type, .rank = 3};
  memcpy(&d6.coll, &d.coll, sizeof(d6.coll));
  ceStop(v, ceStart(v, ctx, v == 6 ? (void *)&d6 : (void *)&d));
}

/* --snapshot V ce | ce_fallback: two 1 MiB-per-rank all-gathers of communicator "dp" (8 ranks) on
 * copy engines, or on SM kernels. */
int printCeSnapshot(int v, const char *scenario) {
  resetRecords();
  setActive(1);
  void *prof = profInit(v, 0xce00 + (uint64_t)v, "dp", "dp");
  for (int i = 0; i < 2; i++) {
    if (!strcmp(scenario, "ce"))
      driveCeAllGather(v, prof, 1 << 20);
    else
      driveSmAllGather(v, prof, 1 << 20);
  }
  fputs(snapshot(), stdout);
  profFinalize(v, prof);
  setActive(0);
  return 0;
}

/* Two CE all-gathers of 1 MiB per rank leave one record: algo CE, no protocol, no channel, two
 * calls, 2 x 8 copies of 1 MiB; no coll record. The ceColl event gets a handle, its ceBatch and
 * ceSync children none (NCCL then stops nothing of them). Under the level-2 mask (KernelCh on) a CE
 * call still expects no kernelCh event: 300 calls, more than the 256 slots, drop nothing. With the
 * mask at 0 NCCL starts no CE event, and ABI v5 (NCCL 2.28, no CE events) never asks for them. */
void test_profiler_ce_allgather(void) {
  for (int v = 6; v <= 7; v++) {
    resetRecords();
    setActive(1);
    gCeSeq = 0, gSyncs = gSyncHandles = gBatchHandles = 0;
    void *prof = profInit(v, 0xce, "dp", "dp");
    int want = LAGOM_PROFILE_COLL | LAGOM_PROFILE_P2P | LAGOM_PROFILE_PROXY_OP | LAGOM_PROFILE_CE_COLL |
               LAGOM_PROFILE_CE_BATCH;
    CHECK(gNcclMask == want, "v%d: level-1 mask %d; want %d (ceColl and ceBatch, not ceSync)", v, gNcclMask, want);
    void *h1 = driveCeAllGather(v, prof, 1 << 20);
    void *h2 = driveCeAllGather(v, prof, 1 << 20);
    const char *snap = snapshot();
    CHECK(h1 && h2, "v%d: the ceColl events get a handle", v);
    CHECK(gCeSeq == 4 && gSyncs == 0 && gBatchHandles == 0, "v%d: %u syncs, %d sent, %d batch handles", v, gCeSeq,
          gSyncs, gBatchHandles);
    CHECK(hasLine(snap, "ce", "func=AllGather count=1048576 dtype=ncclInt8 algo=CE proto=- channels=0 warps=0 "
                  "calls=2 chunk=0 kernel_ns=0 kernel_calls=0 copies=16 copy_bytes=16777216"),
          "v%d: the CE record:\n%s", v, snap);
    CHECK(!strstr(snap, "\ncoll ") && hasLine(snap, "comm", "tag=dp name=dp dropped=0 overflow=0"),
          "v%d: one CE record, no coll one:\n%s", v, snap);
    /* a ceSync NCCL would send under a mask with CeSync: no handle, no change */
    gNcclMask |= LAGOM_PROFILE_CE_SYNC;
    driveCeAllGather(v, prof, 1 << 20);
    snap = snapshot();
    CHECK(gSyncs == 2 && gSyncHandles == 0, "v%d: %d syncs sent, %d got a handle", v, gSyncs, gSyncHandles);
    CHECK(hasLine(snap, "ce", "calls=3 copies=24 copy_bytes=25165824"), "v%d: third call:\n%s", v, snap);
    resetRecords();
    setActive(2);
    for (int i = 0; i < 300; i++) driveCeAllGather(v, prof, 4096);
    snap = snapshot();
    CHECK(hasLine(snap, "ce", "count=4096 calls=300 kernel_ns=0 kernel_calls=0 copies=2400 copy_bytes=9830400"),
          "v%d: level 2:\n%.400s", v, snap);
    CHECK(hasLine(snap, "comm", "dropped=0"), "v%d: every CE call released its slot:\n%.400s", v, snap);
    resetRecords();
    setActive(0);
    CHECK(driveCeAllGather(v, prof, 1 << 20) == NULL && !strstr(snapshot(), "\nce "), "v%d: mask 0: no event", v);
    profFinalize(v, prof);
    CHECK(!strstr(snapshot(), "comm "), "v%d: records left after finalize", v);
  }
  setActive(1);
  void *prof = profInit(5, 0xce5, "dp", "dp");
  CHECK(!(gNcclMask & CE_BITS), "v5: mask %d asks for CE events", gNcclMask);
  profFinalize(5, prof);
  setActive(0);
}
