/*
 * Harness cases of the profiler half, driven in NCCL's order for every profiler ABI version.
 *
 * One collective as NCCL reports it (NVIDIA/nccl v2.30.7): the profiler's init for the
 * communicator (src/init.cc:1520), then the tuner's (:1641) with the same commHash; at launch the
 * group event and the task event (coll or p2p) start and stop on the host
 * (src/enqueue.cc:1436-1445, src/plugin/profiler.cc:432-560); then, from the proxy thread, a
 * proxyOp start (:567-587) and, per channel, a kernelCh start with its GPU start timer, the
 * KernelChStop state with its stop timer and the kernelCh stop (:679-705); finalize at the end.
 * The host starts the proxy (ncclProxyStart, src/enqueue.cc:1441) before it stops the task events
 * (:1443), so the proxy thread's events may come before or after the host's stops: driveColl plays
 * them after, or before when gProxyFirst is set. NCCL 2.23-2.26 (ABI v1-v3) give init no
 * communicator data and put commHash in the descriptors (their name is NULL: NCCL sets no
 * comm->commName before 2.27). In ABI v4 the coll/p2p parent is the group (v2.27.3
 * src/plugin/profiler.cc:244); in v5+ it is the collApi/p2pApi event, NULL when not asked for
 * (v2.30.7 :487, :527). driveColl / driveP2p below make the calls in that order with each
 * version's descriptor.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../lagom_profiler.h"
#include "harness.h"

const void *profilerStruct(int v) {
  char name[32];
  snprintf(name, sizeof(name), "ncclProfiler_v%d", v);
  return dlsym(gLib, name);
}

/* NCCL's process-wide activation mask (a static in src/plugin/profiler.cc:219): every init gets
 * its address and NCCL reads it at each group it launches. */
int gNcclMask = -1;

/* 1: driveColl / driveP2p play the proxy thread's events before the host stops the task. */
int gProxyFirst;

/* The p2p.peer startTask gives a task; the descriptor's rank is 3, so 3 is a send/recv to itself. */
int gPeer = 1;

/* init of version v for one communicator, the way NCCL calls it. */
void *profInit(int v, uint64_t hash, const char *commName, const char *tag) {
  int *mask = &gNcclMask;
  if (tag)
    setenv(LAGOM_TUNER_COMM_TAG_ENV, tag, 1);
  else
    unsetenv(LAGOM_TUNER_COMM_TAG_ENV);
  void *ctx = NULL;
  const void *p = profilerStruct(v);
  if (v <= 3) ((const lagomProfiler_v1_t *)p)->init(&ctx, mask); /* v1-v3 share init's signature */
  if (v == 4) ((const lagomProfiler_v4_t *)p)->init(&ctx, mask, commName, hash, 1, 8, 3, mockLogger);
  if (v == 5) ((const lagomProfiler_v5_t *)p)->init(&ctx, hash, mask, commName, 1, 8, 3, mockLogger);
  if (v == 6) ((const lagomProfiler_v6_t *)p)->init(&ctx, hash, mask, commName, 1, 8, 3, mockLogger);
  if (v == 7) ((const lagomProfiler_v7_t *)p)->init(&ctx, hash, mask, commName, 1, 8, 3, mockLogger);
  return ctx;
}

void profFinalize(int v, void *ctx) { ((const lagomProfiler_v1_t *)profilerStruct(v))->finalize(ctx); }

/* All seven structs have startEvent etc. at the same offsets; only the descriptor type differs. */
static void *startEv(int v, void *ctx, void *descr) {
  void *h = NULL;
  ((const lagomProfiler_v1_t *)profilerStruct(v))->startEvent(ctx, &h, descr);
  return h;
}
static void stopEv(int v, void *h) {
  if (h) ((const lagomProfiler_v1_t *)profilerStruct(v))->stopEvent(h);
}
void stopTask(int v, void *h) { stopEv(v, h); }

static int enumOf(const char *s, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (!strcmp(s, names[i])) return i;
  return 255;
}

/* A task event (coll when algo != NULL, else p2p) in version v's descriptor. */
void *startTask(int v, void *ctx, void *group, uint64_t hash, const char *func, size_t count,
                       const char *dtype, const char *algo, const char *proto, int nChannels, int nWarps) {
  static const char *const funcs[] = {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Send", "Recv"};
  static const char *const types[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                      "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16"};
  static const char *const algos[] = {"TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"};
  static const char *const protos[] = {"LL", "LL128", "SIMPLE"};
  int coll = algo != NULL;
  if (v == 1) {
    lagomProfilerDescr_v1_t d = {.type = coll ? LAGOM_PROFILE_COLL : LAGOM_PROFILE_P2P, .parentObj = group, .rank = 3};
    if (coll) {
      d.coll.commHash = hash, d.coll.func = (uint8_t)enumOf(func, funcs, 8), d.coll.count = count;
      d.coll.datatype = (uint8_t)enumOf(dtype, types, 10), d.coll.nMaxChannels = (uint8_t)nChannels;
      d.coll.nWarps = (uint8_t)nWarps, d.coll.algo = (uint8_t)enumOf(algo, algos, 7);
      d.coll.proto = (uint8_t)enumOf(proto, protos, 3);
    } else {
      d.p2p.commHash = hash, d.p2p.func = (uint8_t)enumOf(func, funcs, 8), d.p2p.count = count;
      d.p2p.datatype = (uint8_t)enumOf(dtype, types, 10), d.p2p.peer = gPeer;
    }
    return startEv(v, ctx, &d);
  }
  if (v == 2 || v == 3) { /* the same members, at other offsets after v2's trafficBytes */
    lagomProfilerDescr_v3_t d3 = {.type = coll ? LAGOM_PROFILE_COLL : LAGOM_PROFILE_P2P, .parentObj = group, .rank = 3};
    lagomProfilerDescr_v2_t d2 = {.type = d3.type, .parentObj = group, .rank = 3};
    if (coll) {
      d3.coll.commHash = d2.coll.commHash = hash, d3.coll.func = d2.coll.func = func;
      d3.coll.count = d2.coll.count = count, d3.coll.datatype = d2.coll.datatype = dtype;
      d3.coll.nMaxChannels = d2.coll.nMaxChannels = (uint8_t)nChannels;
      d3.coll.nWarps = d2.coll.nWarps = (uint8_t)nWarps, d3.coll.algo = d2.coll.algo = algo;
      d3.coll.proto = d2.coll.proto = proto;
    } else {
      d3.p2p.commHash = d2.p2p.commHash = hash, d3.p2p.func = d2.p2p.func = func;
      d3.p2p.count = d2.p2p.count = count, d3.p2p.datatype = d2.p2p.datatype = dtype, d3.p2p.peer = d2.p2p.peer = gPeer;
    }
    return v == 2 ? startEv(v, ctx, &d2) : startEv(v, ctx, &d3);
  }
  if (v == 7) { /* 2.31: a userTag NCCL passes through (lagom keys nothing by it), not a symmetric kernel */
    lagomProfilerDescr_v7_t d = {.type = coll ? LAGOM_PROFILE_COLL : LAGOM_PROFILE_P2P, .parentObj = NULL, .rank = 3};
    if (coll) {
      d.coll.func = func, d.coll.count = count, d.coll.datatype = dtype, d.coll.nChannels = (uint8_t)nChannels;
      d.coll.nWarps = (uint8_t)nWarps, d.coll.algo = algo, d.coll.proto = proto, d.coll.parentGroup = group;
      d.coll.userTag = 0x7a9;
    } else {
      d.p2p.func = func, d.p2p.count = count, d.p2p.datatype = dtype, d.p2p.peer = gPeer;
      d.p2p.nChannels = (uint8_t)nChannels, d.p2p.parentGroup = group, d.p2p.userTag = 0x7a9;
    }
    return startEv(v, ctx, &d);
  }
  lagomProfilerDescr_v6_t d6 = {.type = coll ? LAGOM_PROFILE_COLL : LAGOM_PROFILE_P2P, .parentObj = NULL, .rank = 3};
  lagomProfilerDescr_v4_t d4 = {.type = (uint8_t)d6.type, .parentObj = group, .rank = 3};
  if (coll) {
    d6.coll.func = d4.coll.func = func, d6.coll.count = d4.coll.count = count;
    d6.coll.datatype = d4.coll.datatype = dtype, d6.coll.nChannels = d4.coll.nChannels = (uint8_t)nChannels;
    d6.coll.nWarps = d4.coll.nWarps = (uint8_t)nWarps, d6.coll.algo = d4.coll.algo = algo;
    d6.coll.proto = d4.coll.proto = proto, d6.coll.parentGroup = group;
  } else {
    d6.p2p.func = d4.p2p.func = func, d6.p2p.count = d4.p2p.count = count, d6.p2p.datatype = d4.p2p.datatype = dtype;
    d6.p2p.peer = d4.p2p.peer = gPeer, d6.p2p.nChannels = d4.p2p.nChannels = (uint8_t)nChannels, d6.p2p.parentGroup = group;
  }
  if (v == 4) return startEv(v, ctx, &d4);
  return startEv(v, ctx, &d6); /* v5's descriptor is v6's without the copy-engine members at its end */
}

/* Kernel-phase sub-events v7 could send under a kernelCh handle (src/plugin/profiler.cc, the
 * phase loop @8898068: start with the kernelCh handle as parent, then, for a handle, the phase
 * stop state and stop); counts the handles lagom gave them, which must stay 0. */
int gPhaseHandles;
static void phaseEvents(void *ctx, void *kernelCh, uint8_t channel) {
  for (uint8_t i = 0; i < 2; i++) {
    lagomProfilerDescr_v7_t d = {.type = LAGOM_PROFILE_KERNEL_PHASE, .parentObj = kernelCh};
    d.kernelPhase.channelId = channel, d.kernelPhase.phaseId = i, d.kernelPhase.phaseName = "compute";
    d.kernelPhase.pTimer = 10 + i; /* outside every kernelCh span: would change kernel_ns if counted */
    void *h = startEv(7, ctx, &d);
    if (!h) continue;
    gPhaseHandles++;
    lagomProfilerStateArgs_v7_t a = {.kernelCh = {.pTimer = 90000}};
    ((const lagomProfiler_v7_t *)profilerStruct(7))->recordEventState(h, 31 /* ncclProfilerKernelPhaseStop */, &a);
    stopEv(7, h);
  }
}

/* The proxy thread's events of one task: a proxyOp with `chunk`, then per channel a kernelCh
 * start (timer 1000 + 10 c), KernelChStop (timer 5000 + 5 c) and stop (v7: kernel phases first). */
void proxyEvents(int v, void *ctx, void *task, int chunk, int nChannels) {
  if (v <= 3) {
    lagomProfilerDescr_v3_t op = {.type = LAGOM_PROFILE_PROXY_OP, .parentObj = task};
    op.proxyOp.chunkSize = chunk;
    stopEv(v, startEv(v, ctx, &op)); /* v1 and v2 have proxyOp at the same offset as v3 */
    return;
  }
  /* v5-v7 keep proxyOp and kernelCh at v4's offsets: one v7 descriptor (the largest) serves them */
  lagomProfilerDescr_v7_t op = {.type = LAGOM_PROFILE_PROXY_OP, .parentObj = task};
  lagomProfilerDescr_v4_t op4 = {.type = LAGOM_PROFILE_PROXY_OP, .parentObj = task};
  op.proxyOp.chunkSize = op4.proxyOp.chunkSize = chunk;
  stopEv(v, startEv(v, ctx, v == 4 ? (void *)&op4 : (void *)&op));
  for (int c = 0; c < nChannels; c++) {
    lagomProfilerDescr_v7_t k = {.type = LAGOM_PROFILE_KERNEL_CH, .parentObj = task};
    lagomProfilerDescr_v4_t k4 = {.type = LAGOM_PROFILE_KERNEL_CH, .parentObj = task};
    k.kernelCh.channelId = k4.kernelCh.channelId = (uint8_t)c;
    k.kernelCh.pTimer = k4.kernelCh.pTimer = 1000 + 10 * (uint64_t)c;
    void *h = startEv(v, ctx, v == 4 ? (void *)&k4 : (void *)&k);
    if (v == 7) phaseEvents(ctx, h, (uint8_t)c);
    lagomProfilerStateArgs_v4_t a = {.kernelCh = {.pTimer = 5000 + 5 * (uint64_t)c}};
    ((const lagomProfiler_v4_t *)profilerStruct(v))->recordEventState(h, LAGOM_PROFILER_KERNEL_CH_STOP, &a);
    stopEv(v, h);
  }
}

void driveColl(int v, void *ctx, uint64_t hash, const char *func, size_t count, const char *algo,
               const char *proto, int nChannels, int chunk) {
  lagomProfilerDescr_v7_t g = {.type = LAGOM_PROFILE_GROUP};
  void *group = startEv(v, ctx, &g);
  void *task = startTask(v, ctx, group, hash, func, count, "ncclFloat32", algo, proto, nChannels, 16);
  if (gProxyFirst) proxyEvents(v, ctx, task, chunk, nChannels);
  stopEv(v, task);
  stopEv(v, group);
  if (!gProxyFirst) proxyEvents(v, ctx, task, chunk, nChannels);
}

void driveP2p(int v, void *ctx, uint64_t hash, const char *func, size_t count, int nChannels) {
  lagomProfilerDescr_v7_t g = {.type = LAGOM_PROFILE_GROUP};
  void *group = startEv(v, ctx, &g);
  void *task = startTask(v, ctx, group, hash, func, count, "ncclBfloat16", NULL, NULL, nChannels, 0);
  if (gProxyFirst) proxyEvents(v, ctx, task, 0, nChannels);
  stopEv(v, task);
  stopEv(v, group);
  if (!gProxyFirst) proxyEvents(v, ctx, task, 0, nChannels);
}

char *snapshot(void) {
  int (*snap)(char *, int) = (int (*)(char *, int))dlsym(gLib, "lagomProfilerSnapshot");
  static char buf[1 << 16];
  int n = snap(buf, sizeof(buf));
  if (n >= (int)sizeof(buf)) fprintf(stderr, "  snapshot cut at %zu of %d bytes\n", sizeof(buf), n);
  return buf;
}

void setActive(int on) { ((void (*)(int))dlsym(gLib, "lagomProfilerSetActive"))(on); }
void resetRecords(void) { ((void (*)(void))dlsym(gLib, "lagomProfilerReset"))(); }
int profilerState(void) { return ((int (*)(void))dlsym(gLib, "lagomProfilerState"))(); }

/* The line of `kind` ("coll"/"p2p") in the snapshot holding every "key=value" of `want`. */
int hasLine(const char *snap, const char *kind, const char *want) {
  char copy[1024];
  for (const char *line = snap; *line;) {
    const char *end = strchr(line, '\n');
    size_t n = end ? (size_t)(end - line) : strlen(line);
    if (n + 2 < sizeof(copy) && !strncmp(line, kind, strlen(kind)) && line[strlen(kind)] == ' ') {
      memcpy(copy, line, n);
      copy[n] = ' ';
      copy[n + 1] = '\0';
      char fields[512];
      snprintf(fields, sizeof(fields), "%s", want);
      int all = 1;
      for (char *tok = strtok(fields, " "); tok && all; tok = strtok(NULL, " ")) {
        char pat[128];
        snprintf(pat, sizeof(pat), " %s ", tok);
        all = strstr(copy, pat) != NULL;
      }
      if (all) return 1;
    }
    line += n + (end ? 1 : 0);
  }
  return 0;
}
