/*
 * observed.c: what NCCL really ran, per communicator, as its profiler events report it; kept in
 * bounded memory and read back in-process by lagom (nccl/plugin_status.py).
 *
 * Records. Each communicator NCCL initialised the profiler half for (profiler.c) has a
 * LagomObsComm: its commHash, rank, size, nodes, the profiler ABI, the communicator's name (the
 * profiler's commName, ABI v4+) and lagom's tag ($LAGOM_TUNER_COMM_TAG in init, which runs in the
 * creating thread: NVIDIA/nccl v2.30.7 src/init.cc:1520, before the tuner's init at :1641). Every
 * coll or p2p event adds one call to the bucket of its (kind, func, count, datatype, algorithm,
 * protocol, channels, warps): at most LAGOM_OBS_BUCKETS buckets per communicator (more distinct
 * shapes are counted in `overflow`), so memory does not grow with the number of calls.
 *
 * GPU time. With profiler ABI v4+ (NCCL 2.27+) each channel of a collective reports a kernelCh
 * event whose descriptor carries the channel's GPU start timer and whose KernelChStop state
 * carries its stop timer (v2.30.7 src/plugin/profiler.cc:679-705, from the proxy thread's profiler
 * transport, src/transport/profiler.cc:23-55). A collective's kernel time is the latest stop minus
 * the earliest start over its channels; it is added to the bucket's total when the host stop and
 * the stops of all its channels have been seen. NCCL adds one profiler proxy op per channel of the
 * task (src/enqueue.cc:641-654, :1103-1110), so a task expects `nChannels` channel events. Those
 * come from the proxy thread, which the host starts before it stops the task event
 * (hostStreamPlanTask: start, proxy start, stop, enqueue.cc:1436-1445), so they may come before
 * or after that stop; a task keeps a slot (of LAGOM_OBS_SLOTS per communicator, taken round
 * robin) until all of them did; a task that finds no free slot is counted in `dropped` (its call is still
 * counted, its kernel time is not). Child events carry the slot's address with a tag in its low
 * bits as their handle.
 *
 * Copy engines. A copy-engine collective (ABI v6+, profiler.c says when NCCL runs one) adds one call
 * to a bucket of kind LAGOM_PROFILE_CE_COLL with algorithm "CE", no protocol, 0 channels and warps;
 * it takes a slot from its start to its stop so that its ceBatch children (parent: its handle,
 * between the two on the host thread) add their copies and bytes to that bucket. The mask asks
 * for ceColl and ceBatch at level 1 (no ceSync: it carries nothing lagom reads).
 *
 * Chunk size. A proxyOp event (network transfers only) carries args->chunkSize x sliceSteps
 * (src/plugin/profiler.cc:580); the largest seen is kept per bucket.
 *
 * Self send/recv. NCCL reports a P2P task to the rank itself (descriptor p2p.peer == rank) with
 * nChannels >= 1 (src/enqueue.cc:914-922) but adds no proxy op for it (nProxyOps = selfSend ? 0 : 2,
 * :882, so the loops at :1028 and :1065-1111 add none; src/proxy.cc:753 skips one to itself too), so
 * no kernelCh event ever comes for it: such a task expects none, and its slot goes at the host stop.
 * Every all-to-all has two such tasks per call (src/enqueue.cc:3070-3082), so a slot kept for them
 * would leave the communicator with no free slot after LAGOM_OBS_SLOTS / 2 calls.
 *
 * Cost. NCCL copies the activation mask the profiler's init was handed into each task it enqueues
 * (src/enqueue.cc:2643, :2795); lagom keeps it at 0 (no event at all) except while
 * lagomProfilerSetActive(level > 0) is in force. Level 1 asks for what ran (coll, p2p, proxyOp):
 * no profiler proxy op, no profiler proxy connection. Level 2 adds KernelCh, the GPU timers, which
 * costs a profiler proxy op per channel of every task (src/enqueue.cc:651-653, :1110; src/proxy.cc
 * :758-761) and, at the first such task of a communicator, 2 x MAXCHANNELS blocking proxy
 * connections inside the enqueue (src/plugin/profiler.cc:753-776): never in timed iterations.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "plugin_internal.h"

#define LAGOM_EXPORT __attribute__((visibility("default")))

/* The CE events lagom asks for from ABI v6: ceColl and ceBatch (its copies), not ceSync. */
#define LAGOM_CE_EVENTS (LAGOM_PROFILE_CE_COLL | LAGOM_PROFILE_CE_BATCH)

static LagomObsComm *gComms;    /* live communicators, newest first */
static char gCommsLock;
static int *gMaskPtr;           /* the mask NCCL handed the last init */
static int gMaskBits;           /* the events lagom asks for at level 2 */
static int gActive;             /* lagomProfilerSetActive's level: 0, 1 or 2 */
static int gApplied;            /* the mask lagom last handed NCCL */
static int gInits;
static int gProfilerAbi;
static int gState;              /* LAGOM_PROFILER_STATE_* */
static char gForeign[256];      /* NCCL_PROFILER_PLUGIN when it names another library */

LAGOM_EXPORT int lagomProfilerState(void);

static void lock(char *l) {
  while (__atomic_test_and_set(l, __ATOMIC_ACQUIRE)) {
  }
}
static void unlock(char *l) { __atomic_clear(l, __ATOMIC_RELEASE); }

static void copyStr(char *dst, const char *src, size_t cap) {
  size_t i = 0;
  for (; src && src[i] && i + 1 < cap; i++) {
    unsigned char c = (unsigned char)src[i];
    dst[i] = (c <= ' ' || c == '=' || c >= 127) ? '_' : (char)c; /* one token in the snapshot */
  }
  dst[i] = '\0';
}

static void applyMask(void) {
  int level = __atomic_load_n(&gActive, __ATOMIC_RELAXED);
  int bits = level ? __atomic_load_n(&gMaskBits, __ATOMIC_RELAXED) : 0;
  if (level < 2) bits &= ~LAGOM_PROFILE_KERNEL_CH;
  __atomic_store_n(&gApplied, bits, __ATOMIC_RELAXED);
  int *p = __atomic_load_n(&gMaskPtr, __ATOMIC_ACQUIRE);
  if (p) __atomic_store_n(p, bits, __ATOMIC_RELAXED);
}

LagomObsComm *observedNewComm(int abi, int *mask, uint64_t commHash, const char *commName, int nNodes,
                              int nRanks, int rank, ncclDebugLogger_t logFn) {
  __atomic_fetch_add(&gInits, 1, __ATOMIC_RELAXED);
  __atomic_store_n(&gProfilerAbi, abi, __ATOMIC_RELAXED);
  __atomic_store_n(&gState, LAGOM_PROFILER_STATE_LAGOM, __ATOMIC_RELAXED);
  /* kernelCh events carry GPU timers from v4; v1/v2 have none and v3's carry no timer; CE events
   * come from v6 (see the top) */
  __atomic_store_n(&gMaskBits, LAGOM_PROFILE_COLL | LAGOM_PROFILE_P2P | LAGOM_PROFILE_PROXY_OP |
                   (abi >= 4 ? LAGOM_PROFILE_KERNEL_CH : 0) | (abi >= 6 ? LAGOM_CE_EVENTS : 0), __ATOMIC_RELAXED);
  if (mask) {
    __atomic_store_n(&gMaskPtr, mask, __ATOMIC_RELEASE);
    applyMask();
  }
  LagomObsComm *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->group.kind = LAGOM_HANDLE_GROUP;
  c->abi = abi;
  c->commHash = commHash;
  c->nNodes = nNodes;
  c->nRanks = nRanks;
  c->rank = rank;
  c->logFn = logFn;
  if (commName && *commName) copyStr(c->name, commName, sizeof(c->name));
  char nextTag[LAGOM_TAG_MAX], nextTable[LAGOM_TABLE_PATH_MAX];
  const char *tag = nextCommSettings(nextTag, sizeof(nextTag), nextTable, sizeof(nextTable))
                        ? nextTag
                        : getenv(LAGOM_TUNER_COMM_TAG_ENV);
  if (tag && validTag(tag)) copyStr(c->tag, tag, sizeof(c->tag));
  for (int i = 0; i < LAGOM_OBS_SLOTS; i++) {
    c->slots[i].kind = LAGOM_HANDLE_TASK;
    c->slots[i].comm = c;
  }
  lock(&gCommsLock);
  c->next = gComms;
  gComms = c;
  unlock(&gCommsLock);
  return c;
}

void observedFreeComm(LagomObsComm *c) {
  if (!c) return;
  lock(&gCommsLock);
  for (LagomObsComm **p = &gComms; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  unlock(&gCommsLock);
  free(c);
}

int observedNameFor(uint64_t commId, char *out, size_t cap) {
  int found = 0;
  lock(&gCommsLock);
  for (LagomObsComm *c = gComms; c && !found; c = c->next) {
    lock(&c->lock);
    if (c->commHash == commId && c->name[0]) {
      copyStr(out, c->name, cap);
      found = 1;
    }
    unlock(&c->lock);
  }
  unlock(&gCommsLock);
  return found;
}

int observedProfilerInits(void) { return __atomic_load_n(&gInits, __ATOMIC_RELAXED); }

/* 1 when NCCL would open this very library for NCCL_PROFILER_PLUGIN=`value`: a path to it, or a
 * name NCCL turns into it (the name itself, then libnccl-profiler-<name>.so: v2.30.7
 * src/plugin/plugin_open.cc). */
static int namesThisLibrary(const char *value) {
  Dl_info info;
  if (!dladdr((void *)&lagomProfilerState, &info) || !info.dli_fname) return 0;
  if (strchr(value, '/')) {
    char a[PATH_MAX], b[PATH_MAX];
    return realpath(value, a) && realpath(info.dli_fname, b) && strcmp(a, b) == 0;
  }
  const char *base = strrchr(info.dli_fname, '/');
  base = base ? base + 1 : info.dli_fname;
  char expanded[PATH_MAX];
  snprintf(expanded, sizeof(expanded), "libnccl-profiler-%s.so", value);
  return strcmp(base, value) == 0 || strcmp(base, expanded) == 0;
}

void observedCheckProfiler(ncclDebugLogger_t logFn) {
  if (observedProfilerInits() > 0) return;
  int expected = LAGOM_PROFILER_STATE_UNKNOWN;
  const char *value = getenv("NCCL_PROFILER_PLUGIN");
  int state = LAGOM_PROFILER_STATE_NONE;
  if (value && *value && strcasecmp(value, "none") != 0)
    state = namesThisLibrary(value) ? LAGOM_PROFILER_STATE_UNKNOWN : LAGOM_PROFILER_STATE_FOREIGN;
  if (state == LAGOM_PROFILER_STATE_FOREIGN) snprintf(gForeign, sizeof(gForeign), "%s", value);
  if (!__atomic_compare_exchange_n(&gState, &expected, state, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
  if (logFn && state == LAGOM_PROFILER_STATE_FOREIGN)
    logFn(NCCL_LOG_INFO, LAGOM_NCCL_SUBSYS_INIT, __FILE__, __LINE__, "LAGOM/tuner: NCCL_PROFILER_PLUGIN='%.200s' "
          "names another profiler plugin; lagom leaves it in place and keeps only its tuner row hit counts "
          "(no check of what NCCL ran)", value);
}

/* The bucket of a coll/p2p event (inserted when new), or -1 when the communicator has no room. */
static int findBucket(LagomObsComm *c, const LagomEvent *e) {
  char func[LAGOM_OBS_STR], dtype[LAGOM_OBS_STR], algo[LAGOM_OBS_STR], proto[LAGOM_OBS_STR];
  copyStr(func, e->func ? e->func : "?", sizeof(func));
  copyStr(dtype, e->dtype ? e->dtype : "?", sizeof(dtype));
  copyStr(algo, e->algo ? e->algo : "-", sizeof(algo));
  copyStr(proto, e->proto ? e->proto : "-", sizeof(proto));
  int found = -1;
  lock(&c->lock);
  for (int i = 0; i < c->nBuckets && found < 0; i++) {
    LagomBucket *b = &c->buckets[i];
    if (b->kind == e->type && b->count == e->count && b->nChannels == e->nChannels && b->nWarps == e->nWarps &&
        !strcmp(b->func, func) && !strcmp(b->dtype, dtype) && !strcmp(b->algo, algo) && !strcmp(b->proto, proto))
      found = i;
  }
  if (found < 0 && c->nBuckets < LAGOM_OBS_BUCKETS) {
    LagomBucket *b = &c->buckets[c->nBuckets];
    b->kind = e->type;
    b->count = e->count;
    b->nChannels = e->nChannels;
    b->nWarps = e->nWarps;
    strcpy(b->func, func);
    strcpy(b->dtype, dtype);
    strcpy(b->algo, algo);
    strcpy(b->proto, proto);
    found = c->nBuckets++;
  }
  unlock(&c->lock);
  if (found < 0) __atomic_fetch_add(&c->overflow, 1ULL, __ATOMIC_RELAXED);
  return found;
}

/* Adds the slot's kernel span to its bucket and frees the slot (its last reference is gone). */
static void releaseSlot(LagomSlot *s) {
  uint64_t lo = __atomic_load_n(&s->minStart, __ATOMIC_RELAXED);
  uint64_t hi = __atomic_load_n(&s->maxStop, __ATOMIC_RELAXED);
  if (s->bucket >= 0 && lo != UINT64_MAX && hi > lo) {
    LagomBucket *b = &s->comm->buckets[s->bucket];
    __atomic_fetch_add(&b->kernelNs, (unsigned long long)(hi - lo), __ATOMIC_RELAXED);
    __atomic_fetch_add(&b->kernelCalls, 1ULL, __ATOMIC_RELAXED);
  }
  __atomic_store_n(&s->busy, 0, __ATOMIC_RELEASE);
}

/* Drops one reference; the last one releases the slot. Never below zero (a surplus child). */
static void unrefSlot(LagomSlot *s) {
  int n = __atomic_load_n(&s->pending, __ATOMIC_ACQUIRE);
  while (n > 0 && !__atomic_compare_exchange_n(&s->pending, &n, n - 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
  }
  if (n == 1) releaseSlot(s);
}

/* The task slot a child event names as its parent; `live`: only while the task holds it (a
 * released slot keeps its bucket until the round robin hands it to a new task). */
static LagomSlot *taskOf(void *parent, int live) {
  LagomSlot *s = parent;
  if (!s || ((uintptr_t)s & LAGOM_HANDLE_TAGS) || s->kind != LAGOM_HANDLE_TASK) return NULL;
  return !live || __atomic_load_n(&s->busy, __ATOMIC_ACQUIRE) ? s : NULL;
}

void *observedStart(LagomObsComm *c, const LagomEvent *e) {
  if (!c) return NULL;
  if (e->type == LAGOM_PROFILE_GROUP) return &c->group; /* NCCL < 2.27 starts task events only inside one */
  if (e->type == LAGOM_PROFILE_COLL || e->type == LAGOM_PROFILE_P2P || e->type == LAGOM_PROFILE_CE_COLL) {
    if (!__atomic_load_n(&c->commHash, __ATOMIC_RELAXED) && (e->commHash || (e->commName && *e->commName))) {
      lock(&c->lock); /* v1-v3 give these here, not in init (once: the first task event) */
      if (!c->commHash) __atomic_store_n(&c->commHash, e->commHash, __ATOMIC_RELAXED);
      if (!c->name[0] && e->commName && *e->commName) copyStr(c->name, e->commName, sizeof(c->name));
      unlock(&c->lock);
    }
    int bucket = findBucket(c, e);
    if (bucket >= 0) __atomic_fetch_add(&c->buckets[bucket].calls, 1ULL, __ATOMIC_RELAXED);
    /* the mask in force is the one this task was enqueued with: the host starts the task events in
     * the launch of the group that enqueued it. A P2P task of 0 bytes still runs one channel with one
     * proxy op (src/enqueue.cc:916-917, :1073-1075); a self one has none (see the top). */
    int timers = __atomic_load_n(&gApplied, __ATOMIC_RELAXED) & LAGOM_PROFILE_KERNEL_CH;
    int expect = timers && !e->selfPeer && (e->type == LAGOM_PROFILE_P2P || e->count > 0) ? e->nChannels : 0;
    /* a CE collective has nChannels 0: no kernelCh; its slot goes at its stop, after its children */
    unsigned start = __atomic_fetch_add(&c->nextSlot, 1U, __ATOMIC_RELAXED);
    for (int i = 0; i < LAGOM_OBS_SLOTS; i++) {
      LagomSlot *s = &c->slots[(start + (unsigned)i) % LAGOM_OBS_SLOTS];
      int idle = 0;
      if (!__atomic_compare_exchange_n(&s->busy, &idle, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) continue;
      s->bucket = bucket;
      __atomic_store_n(&s->minStart, UINT64_MAX, __ATOMIC_RELAXED);
      __atomic_store_n(&s->maxStop, 0, __ATOMIC_RELAXED);
      __atomic_store_n(&s->pending, 1 + expect, __ATOMIC_RELEASE);
      return s;
    }
    __atomic_fetch_add(&c->dropped, 1ULL, __ATOMIC_RELAXED);
    return NULL;
  }
  LagomSlot *s = taskOf(e->parent, e->type == LAGOM_PROFILE_KERNEL_CH || e->type == LAGOM_PROFILE_CE_BATCH);
  if (!s) return NULL;
  if (e->type == LAGOM_PROFILE_CE_BATCH) { /* between its ceColl's start and stop, on the host thread */
    if (s->bucket >= 0) {
      LagomBucket *b = &c->buckets[s->bucket];
      __atomic_fetch_add(&b->copies, (unsigned long long)(e->copies > 0 ? e->copies : 0), __ATOMIC_RELAXED);
      __atomic_fetch_add(&b->copyBytes, (unsigned long long)e->copyBytes, __ATOMIC_RELAXED);
    }
    return NULL; /* nothing to do at its stop; a ceSync gets NULL too (below) */
  }
  if (e->type == LAGOM_PROFILE_PROXY_OP) { /* often after the host stopped the task */
    if (s->bucket >= 0 && e->chunkSize > 0) {
      int *chunk = &c->buckets[s->bucket].chunk;
      int old = __atomic_load_n(chunk, __ATOMIC_RELAXED);
      while (e->chunkSize > old &&
             !__atomic_compare_exchange_n(chunk, &old, e->chunkSize, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      }
    }
    return NULL; /* nothing to do at its stop */
  }
  if (e->type == LAGOM_PROFILE_KERNEL_CH) {
    if (e->hasTimer) {
      uint64_t old = __atomic_load_n(&s->minStart, __ATOMIC_RELAXED);
      while (e->pTimer < old &&
             !__atomic_compare_exchange_n(&s->minStart, &old, e->pTimer, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      }
    }
    return (char *)s + LAGOM_HANDLE_KERNEL;
  }
  return NULL;
}

void observedStop(void *h) {
  if (!h) return;
  if (((uintptr_t)h & LAGOM_HANDLE_TAGS) == LAGOM_HANDLE_KERNEL) {
    unrefSlot((LagomSlot *)((char *)h - LAGOM_HANDLE_KERNEL));
    return;
  }
  if (*(int *)h == LAGOM_HANDLE_TASK) unrefSlot(h); /* the host's own reference */
}

void observedRecord(void *h, int state, uint64_t pTimer) {
  if (!h || ((uintptr_t)h & LAGOM_HANDLE_TAGS) != LAGOM_HANDLE_KERNEL || state != LAGOM_PROFILER_KERNEL_CH_STOP)
    return;
  LagomSlot *s = (LagomSlot *)((char *)h - LAGOM_HANDLE_KERNEL);
  uint64_t old = __atomic_load_n(&s->maxStop, __ATOMIC_RELAXED);
  while (pTimer > old && !__atomic_compare_exchange_n(&s->maxStop, &old, pTimer, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

/* ---- what lagom reads in-process (ctypes, nccl/plugin_status.py) ---- */

/* 0: activation mask 0, no event at all; 1: what ran (coll, p2p, proxyOp), no GPU timers; 2: also
 * KernelCh, each task's GPU kernel time (see the top for its cost). NCCL copies the mask into each
 * task it enqueues, so tasks already enqueued keep the old one. */
LAGOM_EXPORT void lagomProfilerSetActive(int level) {
  __atomic_store_n(&gActive, level < 0 ? 0 : level > 2 ? 2 : level, __ATOMIC_RELAXED);
  applyMask();
}

/* The activation mask lagom hands NCCL now (NCCL's ncclProfileEventMask bits). */
LAGOM_EXPORT int lagomProfilerEventMask(void) { return __atomic_load_n(&gApplied, __ATOMIC_RELAXED); }

/* Forgets every bucket of every live communicator and frees every task slot, so the next phase's
 * records start at zero (call it with no collective in flight: a channel event of a task started
 * before it could otherwise reach a slot a new task took). */
LAGOM_EXPORT void lagomProfilerReset(void) {
  lock(&gCommsLock);
  for (LagomObsComm *c = gComms; c; c = c->next) {
    lock(&c->lock);
    memset(c->buckets, 0, sizeof(c->buckets));
    c->nBuckets = 0;
    for (int i = 0; i < LAGOM_OBS_SLOTS; i++) {
      c->slots[i].bucket = -1;
      __atomic_store_n(&c->slots[i].pending, 0, __ATOMIC_RELAXED);
      __atomic_store_n(&c->slots[i].busy, 0, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&c->overflow, 0ULL, __ATOMIC_RELAXED);
    __atomic_store_n(&c->dropped, 0ULL, __ATOMIC_RELAXED);
    unlock(&c->lock);
  }
  unlock(&gCommsLock);
}

LAGOM_EXPORT int lagomProfilerInitCount(void) { return observedProfilerInits(); }
/* LAGOM_PROFILER_STATE_*: 1 once NCCL initialised this profiler half; 2 when NCCL_PROFILER_PLUGIN
 * names another library (lagomProfilerForeign() gives its value); 3 when it is unset or "none";
 * 0 before the tuner half saw a communicator. */
LAGOM_EXPORT int lagomProfilerAbiVersion(void) { return __atomic_load_n(&gProfilerAbi, __ATOMIC_RELAXED); }
LAGOM_EXPORT int lagomProfilerState(void) { return __atomic_load_n(&gState, __ATOMIC_RELAXED); }
LAGOM_EXPORT const char *lagomProfilerForeign(void) { return gForeign; }

/* Writes the records as text lines into buf (NUL-terminated, cut at capacity) and returns the
 * length of the whole text, so a caller whose buffer was too small calls again with more:
 *   comm <i> hash=<hex> rank=<r> nranks=<n> nnodes=<n> abi=<v> tag=<tag|-> name=<name|-> dropped=<n> overflow=<n>
 *   coll|p2p|ce <i> func=<s> count=<n> dtype=<s> algo=<s> proto=<s> channels=<n> warps=<n> calls=<n>
 *            chunk=<bytes|0> kernel_ns=<n> kernel_calls=<n> [ce: copies=<n> copy_bytes=<n>]
 * `func`, `dtype`, `algo` and `proto` are NCCL's strings (ncclFuncToString and its kin,
 * src/collectives.cc); `-` where the event has none (p2p has no algorithm or protocol). A `ce` line
 * is a copy-engine collective (ABI v6+): algo=CE proto=- channels=0 warps=0, no kernel time, and the
 * copies and bytes of its ceBatch children. */
LAGOM_EXPORT int lagomProfilerSnapshot(char *buf, int capacity) {
  size_t cap = capacity > 0 ? (size_t)capacity : 0, len = 0;
  char line[512];
  if (buf && cap) buf[0] = '\0';
  lock(&gCommsLock);
  int i = 0;
  for (LagomObsComm *c = gComms; c; c = c->next, i++) {
    int n = snprintf(line, sizeof(line), "comm %d hash=%llx rank=%d nranks=%d nnodes=%d abi=%d tag=%s name=%s "
                     "dropped=%llu overflow=%llu\n", i, (unsigned long long)c->commHash, c->rank, c->nRanks,
                     c->nNodes, c->abi, c->tag[0] ? c->tag : "-", c->name[0] ? c->name : "-",
                     __atomic_load_n(&c->dropped, __ATOMIC_RELAXED), __atomic_load_n(&c->overflow, __ATOMIC_RELAXED));
    lock(&c->lock);
    for (int k = 0; k < c->nBuckets && n > 0; k++) {
      if (buf && len + (size_t)n < cap) memcpy(buf + len, line, (size_t)n + 1);
      len += (size_t)n;
      const LagomBucket *b = &c->buckets[k];
      int ce = b->kind == LAGOM_PROFILE_CE_COLL;
      n = snprintf(line, sizeof(line), "%s %d func=%s count=%zu dtype=%s algo=%s proto=%s channels=%d warps=%d "
                   "calls=%llu chunk=%d kernel_ns=%llu kernel_calls=%llu",
                   ce ? "ce" : b->kind == LAGOM_PROFILE_P2P ? "p2p" : "coll", i, b->func, b->count, b->dtype, b->algo,
                   b->proto, b->nChannels, b->nWarps, __atomic_load_n(&b->calls, __ATOMIC_RELAXED),
                   __atomic_load_n(&b->chunk, __ATOMIC_RELAXED), __atomic_load_n(&b->kernelNs, __ATOMIC_RELAXED),
                   __atomic_load_n(&b->kernelCalls, __ATOMIC_RELAXED));
      if (n > 0 && (size_t)n < sizeof(line))
        n += snprintf(line + n, sizeof(line) - (size_t)n, ce ? " copies=%llu copy_bytes=%llu\n" : "\n",
                      __atomic_load_n(&b->copies, __ATOMIC_RELAXED), __atomic_load_n(&b->copyBytes, __ATOMIC_RELAXED));
      if (n >= (int)sizeof(line)) n = (int)sizeof(line) - 1; /* never: every field is bounded */
    }
    unlock(&c->lock);
    if (n > 0) {
      if (buf && len + (size_t)n < cap) memcpy(buf + len, line, (size_t)n + 1);
      len += (size_t)n;
    }
  }
  unlock(&gCommsLock);
  return (int)len;
}
