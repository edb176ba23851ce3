/*
 * profiler.c: lagom's NCCL profiler plugin, the half of the library that reports what NCCL ran.
 *
 * The tuner half (plugin.c) states what a plan wants; this half records, per communicator, the
 * collectives and point-to-point operations NCCL then launched with the algorithm, protocol,
 * channels and warps NCCL chose, the chunk size its proxy moved, and each collective's GPU kernel
 * time (observed.c keeps the records). lagom reads them in-process after a plan is applied and
 * compares them with the plan (nccl/observed.py, megatron/control/observed.py).
 *
 * Loading (NVIDIA/nccl v2.30.7): NCCL opens the library named by NCCL_PROFILER_PLUGIN ("none"
 * disables profiler plugins, src/plugin/profiler.cc:58-60) once per process and looks up
 * ncclProfiler_v6, then _v5 .. _v1 (:73-88); 2.31 looks up ncclProfiler_v7 first (:123-141
 * @8898068, 2.31.2); NCCL 2.23 knows only ncclProfiler_v1 (v2.23.4
 * src/misc/profiler.cc:21, :119), 2.24-2.25 v2 then v1 (v2.25.1 src/misc/profiler.cc:220-223).
 * It calls init once per communicator (ncclProfilerPluginInit, src/init.cc:1520, before the tuner's
 * init at :1641 with the same comm->commHash), with a pointer to the process's activation mask:
 *   v1-v3: init(&context, &mask)
 *   v4:    init(&context, &mask, commName, commHash, nNodes, nRanks, rank, logger)
 *   v5-v7: init(&context, commId, &mask, commName, nNodes, nRanks, rank, logger)
 * where commName is ncclConfig_t.commName (NCCL 2.27+; NULL when the creator set none). The
 * events then come as startEvent(context, &handle, descriptor) / recordEventState(handle, state,
 * args) / stopEvent(handle), in this order for one collective (src/enqueue.cc:1436-1445 and
 * src/plugin/profiler.cc): group start, coll (or p2p) start with algo/proto/nChannels/nWarps
 * (:476-542), stop of both on the host; from the proxy thread, which the host starts before those
 * stops (enqueue.cc:1441 vs :1443), proxyOp start (chunkSize, :567-587) and one kernelCh start
 * (GPU start timer) and KernelChStop state (stop timer) + stop per channel (:679-705). NCCL
 * 2.23-2.25 start coll events only inside a group event whose handle is not NULL (v2.25.1
 * src/misc/profiler.cc:383-384), so group events get a handle here. The v1-v3 descriptors' `name`
 * is always NULL: NCCL before 2.27 never sets comm->commName (v2.26.6 src/plugin/profiler.cc:242),
 * so under those versions a communicator is known by its tag only. NCCL 2.23 puts the chunk
 * itself in proxyOp.chunkSize (v2.23.4 src/misc/profiler.cc:361); 2.24+ chunk x sliceSteps (v2.24.3
 * src/misc/profiler.cc:475).
 *
 * Every descriptor version is converted into one LagomEvent (plugin_internal.h); v1's func,
 * datatype, algo and proto are enum values, named here as NCCL's own string functions name them
 * (src/collectives.cc:14-127 at v2.30.7). An init that fails to allocate returns success with a
 * NULL context: NCCL then passes NULL back and nothing is recorded for that communicator.
 *
 * ABI v7 (NVIDIA/nccl @8898068, 2.31.2) is read as v6 with three deliberate choices:
 *   - userTag (ncclCollConfig_t's userProfilerTag, 0 when untagged) is ignored: lagom passes no
 *     per-call config, and records are keyed by communicator, function and bytes;
 *   - a collective NCCL ran on a symmetric kernel (coll.isSymColl) is recorded with its kernel
 *     variant (coll.kernelVariant) as the algorithm and no protocol, since NCCL fills algo with part
 *     of that name and proto with "" there (src/plugin/profiler.cc ncclProfilerStartTaskEvents
 *     @8898068): no planned algorithm equals it, as the tuner never chose it;
 *   - kernelPhase sub-events (parent: a kernelCh handle; src/plugin/profiler.cc, the phase loop
 *     @8898068) are never asked for (the mask lacks LAGOM_PROFILE_KERNEL_PHASE); one that came
 *     anyway gets a NULL handle, so NCCL records and stops nothing of it.
 *
 * Copy-engine collectives (ABI v6+, NCCL 2.29+). A communicator created with CTAPolicy ZERO runs an
 * all-gather or all-to-all on copy engines when its buffers are in a symmetric window, every rank
 * is in the NVLink (LSA) team and the CUDA driver is 12.5+ (v2.30.7 src/enqueue.cc:3054,
 * src/ce_coll.cc:93-131), and on SM kernels otherwise, silently. Such a call has no coll event: its
 * plan takes the task off the kernel queues (src/ce_coll.cc:1412-1442) and is launched by
 * ncclLaunchCeColl instead of a kernel (src/group.cc:358-359). It reports, on the host thread, in
 * this order (src/ce_coll.cc:1361-1410 and :497-547 for an all-gather in one NVLink domain;
 * src/plugin/profiler.cc:823-938): startEvent ceColl (when the mask has any CE bit, :826-827; parent
 * the collApi handle, NULL unless asked for, :830; seqNumber and ceSeqNum the communicator's CE sync
 * count, :833, :845; func, count = the call's count, per rank for an all-gather, datatype, root,
 * :834-839), then as its children (parentObj = the ceColl handle): a ceSync start/stop (when the
 * mask has CeSync, :873) before the copies, a ceBatch start (numOps, totalBytes, useIntraSync;
 * when the mask has CeBatch, :908-921) / stop around them, a ceSync after them, and stopEvent ceColl
 * (:857-865); no recordEventState for any of them (src/include/plugin/profiler/profiler_v6.h:124-125).
 * The v7 descriptor has the same ceColl members plus userTag (profiler_v7.h ceColl @8898068, filled
 * in ncclProfilerStartCeCollEvent). NCCL 2.28 (ABI v5) already runs CE collectives (v2.28.9
 * src/ce_coll.cc ncclLaunchCeColl) but has no CE event at all, so there they leave no record.
 */
#include <stdlib.h>
#include <string.h>

#include "plugin_internal.h"

#define LAGOM_EXPORT __attribute__((visibility("default")))

/* ncclFunc_t, ncclDataType_t, NCCL_ALGO_*, NCCL_PROTO_* values (src/include/nccl_common.h:74-88,
 * src/nccl.h.in:382-394) named as ncclFuncToString & co. name them. */
static const char *const kFuncs[] = {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce",
                                     "SendRecv", "Send", "Recv"};
static const char *const kTypes[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                     "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16",
                                     "ncclFloat8e4m3", "ncclFloat8e5m2"};
static const char *const kAlgos[] = {"TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"};
static const char *const kProtos[] = {"LL", "LL128", "SIMPLE"};
#define NAME_OF(table, v) ((v) < sizeof(table) / sizeof(table[0]) ? table[v] : "Unknown")

static ncclResult_t initAny(void **context, int abi, int *mask, uint64_t commHash, const char *commName,
                            int nNodes, int nRanks, int rank, ncclDebugLogger_t logFn) {
  LagomObsComm *c = observedNewComm(abi, mask, commHash, commName, nNodes, nRanks, rank, logFn);
  *context = c;
  if (logFn)
    logFn(c ? NCCL_LOG_INFO : NCCL_LOG_WARN, LAGOM_NCCL_SUBSYS_INIT, __FILE__, __LINE__,
          c ? "LAGOM/profiler: ABI v%d init: comm 0x%llx name '%s' tag '%s' rank %d/%d nNodes %d"
            : "LAGOM/profiler: out of memory in init (ABI v%d, comm 0x%llx): nothing recorded for it",
          abi, (unsigned long long)commHash, c ? c->name : "", c ? c->tag : "", rank, nRanks, nNodes);
  return ncclSuccess;
}

static ncclResult_t initV1(void **ctx, int *mask) { return initAny(ctx, 1, mask, 0, NULL, -1, -1, -1, NULL); }
static ncclResult_t initV2(void **ctx, int *mask) { return initAny(ctx, 2, mask, 0, NULL, -1, -1, -1, NULL); }
static ncclResult_t initV3(void **ctx, int *mask) { return initAny(ctx, 3, mask, 0, NULL, -1, -1, -1, NULL); }
static ncclResult_t initV4(void **ctx, int *mask, const char *name, uint64_t hash, int nNodes, int nRanks, int rank,
                           ncclDebugLogger_t logFn) {
  return initAny(ctx, 4, mask, hash, name, nNodes, nRanks, rank, logFn);
}
static ncclResult_t initV5(void **ctx, uint64_t id, int *mask, const char *name, int nNodes, int nRanks, int rank,
                           ncclDebugLogger_t logFn) {
  return initAny(ctx, 5, mask, id, name, nNodes, nRanks, rank, logFn);
}
static ncclResult_t initV6(void **ctx, uint64_t id, int *mask, const char *name, int nNodes, int nRanks, int rank,
                           ncclDebugLogger_t logFn) {
  return initAny(ctx, 6, mask, id, name, nNodes, nRanks, rank, logFn);
}
static ncclResult_t initV7(void **ctx, uint64_t id, int *mask, const char *name, int nNodes, int nRanks, int rank,
                           ncclDebugLogger_t logFn) {
  return initAny(ctx, 7, mask, id, name, nNodes, nRanks, rank, logFn);
}

/* The members every version has at the same names: proxyOp's chunk size. */
#define PROXY_OP(e, d) ((e).chunkSize = (d)->proxyOp.chunkSize)

static ncclResult_t start(void *context, void **handle, LagomEvent *e) {
  *handle = observedStart(context, e);
  return ncclSuccess;
}

static ncclResult_t startV1(void *context, void **handle, lagomProfilerDescr_v1_t *d) {
  LagomEvent e = {.type = d->type, .parent = d->parentObj};
  if (d->type == LAGOM_PROFILE_COLL) {
    e.func = NAME_OF(kFuncs, d->coll.func);
    e.dtype = NAME_OF(kTypes, d->coll.datatype);
    e.algo = NAME_OF(kAlgos, d->coll.algo);
    e.proto = NAME_OF(kProtos, d->coll.proto);
    e.count = d->coll.count;
    e.nChannels = d->coll.nMaxChannels;
    e.nWarps = d->coll.nWarps;
    e.commHash = d->coll.commHash;
    e.commName = d->coll.name;
  } else if (d->type == LAGOM_PROFILE_P2P) {
    e.func = NAME_OF(kFuncs, d->p2p.func);
    e.dtype = NAME_OF(kTypes, d->p2p.datatype);
    e.count = d->p2p.count;
    e.commHash = d->p2p.commHash;
    e.commName = d->p2p.name;
  } else if (d->type == LAGOM_PROFILE_PROXY_OP) {
    PROXY_OP(e, d);
  }
  return start(context, handle, &e);
}

/* v2 and v3 share the coll/p2p members lagom reads (v3 dropped trafficBytes, added kernelCh). */
#define START_V2_V3(e, d)                                                                       \
  do {                                                                                          \
    if ((d)->type == LAGOM_PROFILE_COLL) {                                                      \
      (e).func = (d)->coll.func;                                                                \
      (e).dtype = (d)->coll.datatype;                                                           \
      (e).algo = (d)->coll.algo;                                                                \
      (e).proto = (d)->coll.proto;                                                              \
      (e).count = (d)->coll.count;                                                              \
      (e).nChannels = (d)->coll.nMaxChannels;                                                   \
      (e).nWarps = (d)->coll.nWarps;                                                            \
      (e).commHash = (d)->coll.commHash;                                                        \
      (e).commName = (d)->coll.name;                                                            \
    } else if ((d)->type == LAGOM_PROFILE_P2P) {                                                \
      (e).func = (d)->p2p.func;                                                                 \
      (e).dtype = (d)->p2p.datatype;                                                            \
      (e).count = (d)->p2p.count;                                                               \
      (e).commHash = (d)->p2p.commHash;                                                         \
      (e).commName = (d)->p2p.name;                                                             \
    } else if ((d)->type == LAGOM_PROFILE_PROXY_OP) {                                           \
      PROXY_OP(e, d);                                                                           \
    }                                                                                           \
  } while (0)

static ncclResult_t startV2(void *context, void **handle, lagomProfilerDescr_v2_t *d) {
  LagomEvent e = {.type = d->type, .parent = d->parentObj};
  START_V2_V3(e, d);
  return start(context, handle, &e);
}

static ncclResult_t startV3(void *context, void **handle, lagomProfilerDescr_v3_t *d) {
  LagomEvent e = {.type = d->type, .parent = d->parentObj};
  START_V2_V3(e, d);
  return start(context, handle, &e); /* v3 kernelCh events carry no timer: not requested */
}

/* v4-v7: the same coll/p2p/proxyOp/kernelCh members (v5-v7 add members before and after). */
#define START_V4(e, d)                                                                          \
  do {                                                                                          \
    if ((d)->type == LAGOM_PROFILE_COLL) {                                                      \
      (e).func = (d)->coll.func;                                                                \
      (e).dtype = (d)->coll.datatype;                                                           \
      (e).algo = (d)->coll.algo;                                                                \
      (e).proto = (d)->coll.proto;                                                              \
      (e).count = (d)->coll.count;                                                              \
      (e).nChannels = (d)->coll.nChannels;                                                      \
      (e).nWarps = (d)->coll.nWarps;                                                            \
    } else if ((d)->type == LAGOM_PROFILE_P2P) {                                                \
      (e).func = (d)->p2p.func;                                                                 \
      (e).dtype = (d)->p2p.datatype;                                                            \
      (e).count = (d)->p2p.count;                                                               \
      (e).nChannels = (d)->p2p.nChannels;                                                       \
      (e).selfPeer = (d)->p2p.peer == (d)->rank;                                                \
    } else if ((d)->type == LAGOM_PROFILE_PROXY_OP) {                                           \
      PROXY_OP(e, d);                                                                           \
    } else if ((d)->type == LAGOM_PROFILE_KERNEL_CH) {                                          \
      (e).pTimer = (d)->kernelCh.pTimer;                                                        \
      (e).hasTimer = 1;                                                                         \
    }                                                                                           \
  } while (0)

static ncclResult_t startV4(void *context, void **handle, lagomProfilerDescr_v4_t *d) {
  LagomEvent e = {.type = d->type, .parent = d->parentObj};
  START_V4(e, d);
  return start(context, handle, &e);
}

static ncclResult_t startV5(void *context, void **handle, lagomProfilerDescr_v5_t *d) {
  LagomEvent e = {.type = (int)(d->type & 0x7fffffff), .parent = d->parentObj};
  START_V4(e, d);
  return start(context, handle, &e);
}

/* v6-v7: a copy-engine collective (ceColl, the same members at the same offsets in both; v7 appends
 * userTag, ignored as for coll) is recorded as a collective NCCL ran on no channel with algorithm
 * LAGOM_CE_ALGO; a ceBatch child adds its copies; a ceSync child carries nothing lagom reads. */
#define START_CE(e, d)                                                                          \
  do {                                                                                          \
    if ((d)->type == LAGOM_PROFILE_CE_COLL) {                                                   \
      (e).func = (d)->ceColl.func;                                                              \
      (e).dtype = (d)->ceColl.datatype;                                                         \
      (e).algo = LAGOM_CE_ALGO;                                                                 \
      (e).count = (d)->ceColl.count;                                                            \
    } else if ((d)->type == LAGOM_PROFILE_CE_BATCH) {                                           \
      (e).copies = (d)->ceCollBatch.numOps;                                                     \
      (e).copyBytes = (d)->ceCollBatch.totalBytes;                                              \
    }                                                                                           \
  } while (0)

static ncclResult_t startV6(void *context, void **handle, lagomProfilerDescr_v6_t *d) {
  LagomEvent e = {.type = (int)(d->type & 0x7fffffff), .parent = d->parentObj};
  START_V4(e, d);
  START_CE(e, d);
  return start(context, handle, &e);
}

static ncclResult_t startV7(void *context, void **handle, lagomProfilerDescr_v7_t *d) {
  LagomEvent e = {.type = (int)(d->type & 0x7fffffff), .parent = d->parentObj};
  START_V4(e, d);
  START_CE(e, d);
  if (e.type == LAGOM_PROFILE_COLL && d->coll.isSymColl) {
    e.algo = d->coll.kernelVariant ? d->coll.kernelVariant : d->coll.algo;
    e.proto = NULL;
  }
  return start(context, handle, &e);
}

static ncclResult_t stopAny(void *handle) {
  observedStop(handle);
  return ncclSuccess;
}

static ncclResult_t recordV1(void *handle, lagomProfilerState_t state, lagomProfilerStateArgs_v1_t *args) {
  (void)handle;
  (void)state;
  (void)args; /* v1-v3 states carry no timer lagom reads */
  return ncclSuccess;
}

static ncclResult_t recordV4(void *handle, lagomProfilerState_t state, lagomProfilerStateArgs_v4_t *args) {
  if (args) observedRecord(handle, state, args->kernelCh.pTimer);
  return ncclSuccess;
}

static ncclResult_t finalizeAny(void *context) {
  observedFreeComm(context);
  return ncclSuccess;
}

#define LAGOM_PROFILER(V, REC)                                                                  \
  LAGOM_EXPORT const lagomProfiler_v##V##_t ncclProfiler_v##V = {                               \
      .name = "lagom",                                                                          \
      .init = initV##V,                                                                         \
      .startEvent = startV##V,                                                                  \
      .stopEvent = stopAny,                                                                     \
      .recordEventState = REC,                                                                  \
      .finalize = finalizeAny,                                                                  \
  }

LAGOM_PROFILER(7, recordV4);
LAGOM_PROFILER(6, recordV4);
LAGOM_PROFILER(5, recordV4);
LAGOM_PROFILER(4, recordV4);
LAGOM_PROFILER(3, recordV1);
LAGOM_PROFILER(2, recordV1);
LAGOM_PROFILER(1, recordV1);
