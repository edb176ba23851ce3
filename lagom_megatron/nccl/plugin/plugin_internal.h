/*
 * plugin_internal.h: what the plugin's two sources share (not part of the ABI, never installed
 * into NCCL): the logging macros, the table row and per-communicator context types, and the
 * table-reading functions table.c provides to plugin.c.
 *
 *   table.c   reads and parses the plan table, keeps the rows that apply to a communicator.
 *   plugin.c  NCCL's entry points (init, getCollInfo, getChunkSize, finalize) and ABI v3-v7 structs.
 *   status.c  process-wide status (ABI version, init count, per-row hit counters) and the
 *             lagomTuner* functions that export it to the process that loaded the plugin.
 *   profiler.c NCCL's profiler entry points and ABI v1-v7 structs (the same library).
 *   observed.c what the profiler events report, per communicator, and the lagomProfiler*
 *             functions that export it.
 *
 * Everything declared here is internal to the shared library: hidden from its dynamic symbol
 * table whatever -fvisibility the build uses; only the ncclTunerPlugin_v* and ncclProfiler_v*
 * structs and the lagomTuner* / lagomProfiler* status functions are exported.
 */
#ifndef LAGOM_PLUGIN_INTERNAL_H_
#define LAGOM_PLUGIN_INTERNAL_H_

#include <stddef.h>
#include <stdint.h>

#include "lagom_profiler.h"
#include "lagom_tuner.h"

#define LAGOM_INTERNAL __attribute__((visibility("hidden")))

/* NCCL filters every message, warnings included, by subsystem (NCCL_DEBUG_SUBSYS, default
 * INIT,BOOTSTRAP,ENV): init-time messages carry INIT so that a bad table is visible with plain
 * NCCL_DEBUG=WARN; per-call messages carry TUNING only. */
#define LOG_FLAGS(ctx, flags, level, fmt, ...)                                                 \
  do {                                                                                         \
    if ((ctx)->logFn)                                                                          \
      (ctx)->logFn(level, flags, __FILE__, __LINE__, "LAGOM/tuner: " fmt, ##__VA_ARGS__);      \
  } while (0)
#define LOG_INIT(ctx, level, fmt, ...)                                                         \
  LOG_FLAGS(ctx, LAGOM_NCCL_SUBSYS_INIT | LAGOM_NCCL_SUBSYS_TUNING, level, fmt, ##__VA_ARGS__)
#define LOG_CALL(ctx, level, fmt, ...)                                                         \
  LOG_FLAGS(ctx, LAGOM_NCCL_SUBSYS_TUNING, level, fmt, ##__VA_ARGS__)

/* One table row; -1 in an int field means "any" (match) or "NCCL's" (output). */
typedef struct {
  int coll;            /* ncclFunc_t */
  size_t minBytes;     /* inclusive */
  size_t maxBytes;     /* inclusive */
  int algo;            /* LAGOM_ALGO_* or -1 */
  int proto;           /* LAGOM_PROTO_* or -1 */
  int channels;        /* 1..LAGOM_MAX_CHANNELS or -1 */
  int nNodes;          /* >= 1 or -1 */
  int nRanks;          /* >= 1 or -1 */
  int numPipeOps;      /* >= 1 or -1 */
  int regBuff;         /* 0, 1 or -1 */
  long long chunkSize; /* bytes > 0, or -1 */
  char tag[LAGOM_TAG_MAX];
  int line;            /* line number in the table, for logs */
  int index;           /* data-row index in file order (0-based), for the hit counters */
  int noted;           /* set once the row's algorithm/protocol could not be applied (log once) */
} LagomRow;

/* Hit counters of one table file, shared by every communicator that loaded it (status.c). */
typedef struct LagomTableHits LagomTableHits;

/* A collective NCCL asked getCollInfo about in the current group; getChunkSize has not yet seen
 * slices for `remaining` of its bytes (ABI v6+; see plugin.c). */
typedef struct {
  int coll;
  size_t remaining;
  int slices;          /* getChunkSize calls charged to it so far (lo, hi, mid) */
  const LagomRow *row; /* the row getCollInfo matched, or NULL (NCCL's chunk for its slices) */
} LagomPending;
#define LAGOM_PENDING_MAX 32

/* Per-communicator state, allocated in init and freed in finalize. */
typedef struct {
  ncclDebugLogger_t logFn;
  uint64_t commId;
  size_t nRanks;
  size_t nNodes;
  char tag[LAGOM_TAG_MAX];
  LagomRow *rows; /* only the rows that apply to this communicator */
  int nRows;
  int abiVersion;         /* ABI version NCCL initialised this communicator with (3-7) */
  LagomTableHits *hits;   /* counters of the loaded table, or NULL when none is loaded */
  LagomPending pending[LAGOM_PENDING_MAX]; /* getCollInfo calls of the current group */
  int nPending;
  int current; /* index of the pending call whose slices are under way, or -1 */
  int sliced; /* getChunkSize ran since the last getCollInfo (the next one starts a new group) */
} LagomContext;

/* Names for logs: the table's spelling, "?" / "any" out of range (table.c). */
LAGOM_INTERNAL const char *collName(int coll);
LAGOM_INTERNAL const char *algoName(int algo);
LAGOM_INTERNAL const char *protoName(int proto);

/* 1 when `s` is a valid communicator tag: shorter than LAGOM_TAG_MAX characters, made of
 * letters, digits and _ . : / * - [ ] only (table.c). */
LAGOM_INTERNAL int validTag(const char *s);

/* Reads the table at `path` and keeps the rows that apply to ctx's communicator. Any error
 * leaves ctx->rows empty (NCCL's choices everywhere) and is logged as a warning (table.c). */
LAGOM_INTERNAL void loadTable(LagomContext *ctx, const char *path);

/* Process-wide status (status.c). statusNoteInit records one init with its ABI version;
 * statusTableHits returns the counters for the table file `path` (identified by device, inode,
 * size and modification time, so a rewritten table gets fresh counters) with `nRows` data rows,
 * making it the table lagomTunerRowHits reports; NULL when out of memory. statusCountHit adds one
 * match of data row `index`; statusNoteTableFailure counts a table that could not be used. */
LAGOM_INTERNAL void statusNoteInit(int abiVersion);
LAGOM_INTERNAL LagomTableHits *statusTableHits(const char *path, int fd, int nRows);
LAGOM_INTERNAL void statusCountHit(LagomTableHits *hits, int index);
LAGOM_INTERNAL void statusNoteTableFailure(void);

/* The tag and plan table of the communicators created next, as lagomSetNextComm (status.c) set them:
 * 1 with both copied (tag may be ""), 0 when none is set and the environment applies. The Python side
 * sets them through ctypes rather than setenv, which races with getenv in torch's and NCCL's threads. */
LAGOM_INTERNAL int nextCommSettings(char *tag, size_t tagCap, char *table, size_t tableCap);

/* ---- the profiler half (profiler.c, observed.c) ---- */

/* One event as every profiler ABI version describes it (profiler.c converts each descriptor). */
typedef struct {
  int type;             /* LAGOM_PROFILE_* */
  void *parent;         /* the descriptor's parentObj: a handle this library returned, or NULL */
  const char *func;     /* NCCL's names (v1's enum values are turned into the same strings) */
  const char *dtype;
  const char *algo;     /* NULL for p2p */
  const char *proto;
  size_t count;         /* elements, as the call gave them (all-gather: per rank) */
  int nChannels;        /* channels the task runs on (v1-v3: nMaxChannels) */
  int nWarps;
  int chunkSize;        /* proxyOp: args->chunkSize x sliceSteps */
  uint64_t commHash;    /* v1-v3 coll/p2p only */
  const char *commName; /* v1-v3 coll/p2p only (NULL in every NCCL release lagom knows) */
  uint64_t pTimer;      /* kernelCh: GPU start timer, ns */
  int hasTimer;
  int selfPeer;         /* p2p (v4+): a send or receive of the rank to itself */
  int copies;           /* ceBatch (v6+): the copies of the batch (numOps) */
  size_t copyBytes;     /* ceBatch (v6+): their bytes (totalBytes) */
} LagomEvent;

/* The algorithm a copy-engine collective is recorded with (no channel, no protocol). */
#define LAGOM_CE_ALGO "CE"

#define LAGOM_OBS_BUCKETS 64
#define LAGOM_OBS_SLOTS 256
#define LAGOM_OBS_STR 24
#define LAGOM_OBS_NAME 64

#define LAGOM_HANDLE_TASK 0x7a5c  /* first int of a task slot */
#define LAGOM_HANDLE_GROUP 0x7a5d /* first int of a communicator's group token */
#define LAGOM_HANDLE_KERNEL 1     /* low bits of a kernelCh handle: its task slot + 1 */
#define LAGOM_HANDLE_TAGS 7

/* NCCL_PROFILER_PLUGIN as the tuner half sees it (lagomProfilerState). */
#define LAGOM_PROFILER_STATE_UNKNOWN 0 /* NCCL has not initialised lagom's profiler (yet) */
#define LAGOM_PROFILER_STATE_LAGOM 1   /* NCCL initialised lagom's profiler half */
#define LAGOM_PROFILER_STATE_FOREIGN 2 /* NCCL_PROFILER_PLUGIN names another library: left in place */
#define LAGOM_PROFILER_STATE_NONE 3    /* NCCL_PROFILER_PLUGIN=none, or unset: no profiler of lagom's */

typedef struct {
  int kind; /* LAGOM_PROFILE_COLL, LAGOM_PROFILE_P2P or LAGOM_PROFILE_CE_COLL */
  char func[LAGOM_OBS_STR];
  char dtype[LAGOM_OBS_STR];
  char algo[LAGOM_OBS_STR];
  char proto[LAGOM_OBS_STR];
  size_t count;
  int nChannels;
  int nWarps;
  unsigned long long calls;
  unsigned long long kernelNs;
  unsigned long long kernelCalls;
  int chunk;
  unsigned long long copies;    /* CE: copies of its batches (ceBatch numOps) */
  unsigned long long copyBytes; /* CE: their bytes (ceBatch totalBytes) */
} LagomBucket;

struct LagomObsComm;
typedef struct {
  int kind; /* LAGOM_HANDLE_TASK */
  int busy;
  int pending; /* the host's reference + the channel events still to stop */
  int bucket;  /* -1: counted nowhere */
  uint64_t minStart;
  uint64_t maxStop;
  struct LagomObsComm *comm;
} LagomSlot;

typedef struct LagomObsComm {
  struct { int kind; } group; /* the handle of its group events */
  int abi;
  uint64_t commHash;
  int nNodes, nRanks, rank;
  ncclDebugLogger_t logFn;
  char tag[LAGOM_TAG_MAX];
  char name[LAGOM_OBS_NAME];
  char lock;
  int nBuckets;
  unsigned nextSlot;
  unsigned long long dropped;
  unsigned long long overflow;
  LagomBucket buckets[LAGOM_OBS_BUCKETS];
  LagomSlot slots[LAGOM_OBS_SLOTS];
  struct LagomObsComm *next;
} LagomObsComm;

/* observed.c: a communicator's records (NULL when out of memory); `mask` is NCCL's activation
 * mask, kept to switch events on and off. */
LAGOM_INTERNAL LagomObsComm *observedNewComm(int abi, int *mask, uint64_t commHash, const char *commName,
                                             int nNodes, int nRanks, int rank, ncclDebugLogger_t logFn);
LAGOM_INTERNAL void observedFreeComm(LagomObsComm *c);
LAGOM_INTERNAL void *observedStart(LagomObsComm *c, const LagomEvent *e);
LAGOM_INTERNAL void observedStop(void *handle);
LAGOM_INTERNAL void observedRecord(void *handle, int state, uint64_t pTimer);
/* The profiler's commName of the live communicator with commHash `commId` into `out`; 0 if none. */
LAGOM_INTERNAL int observedNameFor(uint64_t commId, char *out, size_t cap);
LAGOM_INTERNAL int observedProfilerInits(void);
/* Called by the tuner's init: when NCCL never initialised this library's profiler half, records
 * (once) why from NCCL_PROFILER_PLUGIN: unset or "none", or another library, which lagom never
 * replaces; logged once through `logFn`. */
LAGOM_INTERNAL void observedCheckProfiler(ncclDebugLogger_t logFn);

#endif /* LAGOM_PLUGIN_INTERNAL_H_ */
