/*
 * abi_layout.c: prints the size of every ABI struct lagom's plugin declares, and the offset of
 * every member it reads or NCCL calls through, one "<NCCL type>[.<member>] <bytes>" line each.
 *
 * Built two ways (tests/nccl/test_plugin_abi.py):
 *   - as C with lagom's own declarations (lagom_tuner.h, lagom_profiler.h): what the plugin uses;
 *   - with -DLAGOM_ABI_NCCL as C++ against NCCL's own headers (a source checkout named by the test,
 *     never kept in this repository), after a prelude the test writes that defines what those
 *     headers expect from nccl.h (ncclResult_t, ncclFunc_t, ncclDebugLogger_t, ncclPid_t); the
 *     test defines LAGOM_ABI_TUNER_V7 / LAGOM_ABI_PROFILER_V7 when the checkout has tuner_v7.h
 *     (NCCL 2.32+) / profiler_v7.h (2.31+).
 * The two outputs, and the table the test keeps, must be identical.
 */
#include <stddef.h>
#include <stdio.h>

#ifdef LAGOM_ABI_NCCL
#include "lagom_abi_nccl_prelude.h"
#define T(nccl, ours) nccl
#else
#include "../lagom_profiler.h"
#include "../lagom_tuner.h"
#define T(nccl, ours) ours
#define LAGOM_ABI_TUNER_V7 1
#define LAGOM_ABI_PROFILER_V7 1
#endif

#define SIZE(nccl, ours) printf("%s %zu\n", #nccl, sizeof(T(nccl, ours)))
#define OFF(nccl, ours, member) printf("%s.%s %zu\n", #nccl, #member, offsetof(T(nccl, ours), member))

static void tuners(void) {
  SIZE(ncclTuner_v3_t, lagomTuner_v3_t);
  OFF(ncclTuner_v3_t, lagomTuner_v3_t, name);
  OFF(ncclTuner_v3_t, lagomTuner_v3_t, init);
  OFF(ncclTuner_v3_t, lagomTuner_v3_t, getCollInfo);
  OFF(ncclTuner_v3_t, lagomTuner_v3_t, destroy);
  SIZE(ncclTuner_v4_t, lagomTuner_v4_t);
  OFF(ncclTuner_v4_t, lagomTuner_v4_t, init);
  OFF(ncclTuner_v4_t, lagomTuner_v4_t, getCollInfo);
  OFF(ncclTuner_v4_t, lagomTuner_v4_t, destroy);
  SIZE(ncclTuner_v5_t, lagomTuner_v5_t);
  OFF(ncclTuner_v5_t, lagomTuner_v5_t, init);
  OFF(ncclTuner_v5_t, lagomTuner_v5_t, getCollInfo);
  OFF(ncclTuner_v5_t, lagomTuner_v5_t, finalize);
  SIZE(ncclTuner_v6_t, lagomTuner_v6_t);
  OFF(ncclTuner_v6_t, lagomTuner_v6_t, init);
  OFF(ncclTuner_v6_t, lagomTuner_v6_t, getCollInfo);
  OFF(ncclTuner_v6_t, lagomTuner_v6_t, finalize);
  OFF(ncclTuner_v6_t, lagomTuner_v6_t, getChunkSize);
#ifdef LAGOM_ABI_TUNER_V7
  SIZE(ncclTuner_v7_t, lagomTuner_v7_t);
  OFF(ncclTuner_v7_t, lagomTuner_v7_t, init);
  OFF(ncclTuner_v7_t, lagomTuner_v7_t, getCollInfo);
  OFF(ncclTuner_v7_t, lagomTuner_v7_t, finalize);
  OFF(ncclTuner_v7_t, lagomTuner_v7_t, getChunkSize);
#endif
}

/* The plugin struct of one profiler version: name and the five calls. */
#define PLUGIN(N, O)                                                                            \
  SIZE(N, O);                                                                                   \
  OFF(N, O, init);                                                                              \
  OFF(N, O, startEvent);                                                                        \
  OFF(N, O, stopEvent);                                                                         \
  OFF(N, O, recordEventState);                                                                  \
  OFF(N, O, finalize)

/* What every descriptor version has: the header, proxyOp and proxyStep. */
#define DESCR_COMMON(N, O)                                                                      \
  SIZE(N, O);                                                                                   \
  OFF(N, O, type);                                                                              \
  OFF(N, O, parentObj);                                                                         \
  OFF(N, O, rank);                                                                              \
  OFF(N, O, proxyOp.pid);                                                                       \
  OFF(N, O, proxyOp.channelId);                                                                 \
  OFF(N, O, proxyOp.peer);                                                                      \
  OFF(N, O, proxyOp.nSteps);                                                                    \
  OFF(N, O, proxyOp.chunkSize);                                                                 \
  OFF(N, O, proxyOp.isSend);                                                                    \
  OFF(N, O, proxyStep.step)

/* v1-v3 coll/p2p members lagom reads (v1 holds enums where v2/v3 hold strings, same names). */
#define DESCR_V1_TASKS(N, O)                                                                    \
  OFF(N, O, coll.name);                                                                         \
  OFF(N, O, coll.commHash);                                                                     \
  OFF(N, O, coll.func);                                                                         \
  OFF(N, O, coll.count);                                                                        \
  OFF(N, O, coll.datatype);                                                                     \
  OFF(N, O, coll.nMaxChannels);                                                                 \
  OFF(N, O, coll.nWarps);                                                                       \
  OFF(N, O, coll.algo);                                                                         \
  OFF(N, O, coll.proto);                                                                        \
  OFF(N, O, p2p.name);                                                                          \
  OFF(N, O, p2p.commHash);                                                                      \
  OFF(N, O, p2p.func);                                                                          \
  OFF(N, O, p2p.datatype);                                                                      \
  OFF(N, O, p2p.count);                                                                         \
  OFF(N, O, p2p.peer)

/* v4-v7 coll/p2p/kernelCh members lagom reads. */
#define DESCR_V4_TASKS(N, O)                                                                    \
  OFF(N, O, coll.seqNumber);                                                                    \
  OFF(N, O, coll.func);                                                                         \
  OFF(N, O, coll.count);                                                                        \
  OFF(N, O, coll.datatype);                                                                     \
  OFF(N, O, coll.nChannels);                                                                    \
  OFF(N, O, coll.nWarps);                                                                       \
  OFF(N, O, coll.algo);                                                                         \
  OFF(N, O, coll.proto);                                                                        \
  OFF(N, O, p2p.func);                                                                          \
  OFF(N, O, p2p.datatype);                                                                      \
  OFF(N, O, p2p.count);                                                                         \
  OFF(N, O, p2p.peer);                                                                          \
  OFF(N, O, p2p.nChannels);                                                                     \
  OFF(N, O, kernelCh.channelId);                                                                \
  OFF(N, O, kernelCh.pTimer)

#ifdef LAGOM_ABI_PROFILER_V7
/* v7: every member it appends or reads, and where its copy-engine and kernel-phase members sit. */
static void profilerV7(void) {
  DESCR_COMMON(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t);
  DESCR_V4_TASKS(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, coll.parentGroup);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, coll.kernelVariant);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, coll.isSymColl);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, coll.userTag);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, p2p.parentGroup);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, p2p.userTag);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, collApi.graphCaptured);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, collApi.userTag);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, p2pApi.userTag);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceColl.func);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceColl.count);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceColl.datatype);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceColl.stream);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceColl.userTag);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceCollBatch.numOps);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceCollBatch.totalBytes);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, ceCollBatch.useIntraSync);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, kernelPhase.channelId);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, kernelPhase.phaseId);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, kernelPhase.phaseName);
  OFF(ncclProfilerEventDescr_v7_t, lagomProfilerDescr_v7_t, kernelPhase.pTimer);
  SIZE(ncclProfilerEventStateArgs_v7_t, lagomProfilerStateArgs_v7_t);
  OFF(ncclProfilerEventStateArgs_v7_t, lagomProfilerStateArgs_v7_t, kernelCh.pTimer);
  PLUGIN(ncclProfiler_v7_t, lagomProfiler_v7_t);
}
#endif

static void profilers(void) {
  DESCR_COMMON(ncclProfilerEventDescr_v1_t, lagomProfilerDescr_v1_t);
  DESCR_V1_TASKS(ncclProfilerEventDescr_v1_t, lagomProfilerDescr_v1_t);
  OFF(ncclProfilerEventDescr_v1_t, lagomProfilerDescr_v1_t, coll.op);
  OFF(ncclProfilerEventDescr_v1_t, lagomProfilerDescr_v1_t, coll.isNvls);
  DESCR_COMMON(ncclProfilerEventDescr_v2_t, lagomProfilerDescr_v2_t);
  DESCR_V1_TASKS(ncclProfilerEventDescr_v2_t, lagomProfilerDescr_v2_t);
  DESCR_COMMON(ncclProfilerEventDescr_v3_t, lagomProfilerDescr_v3_t);
  DESCR_V1_TASKS(ncclProfilerEventDescr_v3_t, lagomProfilerDescr_v3_t);
  OFF(ncclProfilerEventDescr_v3_t, lagomProfilerDescr_v3_t, kernelCh.channelId);
  OFF(ncclProfilerEventDescr_v3_t, lagomProfilerDescr_v3_t, netPlugin.data);
  DESCR_COMMON(ncclProfilerEventDescr_v4_t, lagomProfilerDescr_v4_t);
  DESCR_V4_TASKS(ncclProfilerEventDescr_v4_t, lagomProfilerDescr_v4_t);
  DESCR_COMMON(ncclProfilerEventDescr_v5_t, lagomProfilerDescr_v5_t);
  DESCR_V4_TASKS(ncclProfilerEventDescr_v5_t, lagomProfilerDescr_v5_t);
  OFF(ncclProfilerEventDescr_v5_t, lagomProfilerDescr_v5_t, coll.parentGroup);
  OFF(ncclProfilerEventDescr_v5_t, lagomProfilerDescr_v5_t, p2p.parentGroup);
  OFF(ncclProfilerEventDescr_v5_t, lagomProfilerDescr_v5_t, collApi.graphCaptured);
  DESCR_COMMON(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t);
  DESCR_V4_TASKS(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, coll.parentGroup);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceColl.func);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceColl.count);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceColl.datatype);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceColl.stream);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceCollBatch.numOps);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceCollBatch.totalBytes);
  OFF(ncclProfilerEventDescr_v6_t, lagomProfilerDescr_v6_t, ceCollBatch.useIntraSync);

  SIZE(ncclProfilerEventStateArgs_v1_t, lagomProfilerStateArgs_v1_t);
  OFF(ncclProfilerEventStateArgs_v1_t, lagomProfilerStateArgs_v1_t, proxyOp.steps);
  SIZE(ncclProfilerEventStateArgs_v3_t, lagomProfilerStateArgs_v1_t);
  SIZE(ncclProfilerEventStateArgs_v4_t, lagomProfilerStateArgs_v4_t);
  OFF(ncclProfilerEventStateArgs_v4_t, lagomProfilerStateArgs_v4_t, kernelCh.pTimer);
  SIZE(ncclProfilerEventStateArgs_v6_t, lagomProfilerStateArgs_v4_t);

  PLUGIN(ncclProfiler_v1_t, lagomProfiler_v1_t);
  PLUGIN(ncclProfiler_v2_t, lagomProfiler_v2_t);
  PLUGIN(ncclProfiler_v3_t, lagomProfiler_v3_t);
  PLUGIN(ncclProfiler_v4_t, lagomProfiler_v4_t);
  PLUGIN(ncclProfiler_v5_t, lagomProfiler_v5_t);
  PLUGIN(ncclProfiler_v6_t, lagomProfiler_v6_t);
#ifdef LAGOM_ABI_PROFILER_V7
  profilerV7();
#endif
}

int main(void) {
  tuners();
  profilers();
  return 0;
}
