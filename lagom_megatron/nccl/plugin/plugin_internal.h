/*
 * plugin_internal.h: what the plugin's two sources share (not part of the ABI, never installed
 * into NCCL): the logging macros, the table row and per-communicator context types, and the
 * table-reading functions table.c provides to plugin.c.
 *
 *   table.c   reads and parses the plan table, keeps the rows that apply to a communicator.
 *   plugin.c  NCCL's entry points (init, getCollInfo, getChunkSize, finalize) and ABI v3-v6 structs.
 *   status.c  process-wide status (ABI version, init count, per-row hit counters) and the
 *             lagomTuner* functions that export it to the process that loaded the plugin.
 *
 * Everything declared here is internal to the shared library: hidden from its dynamic symbol
 * table whatever -fvisibility the build uses; only the ncclTunerPlugin_v* structs and the
 * lagomTuner* status functions are exported.
 */
#ifndef LAGOM_PLUGIN_INTERNAL_H_
#define LAGOM_PLUGIN_INTERNAL_H_

#include <stddef.h>
#include <stdint.h>

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
 * slices for `remaining` of its bytes (ABI v6 only; see plugin.c). */
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
  int abiVersion;         /* ABI version NCCL initialised this communicator with (3-6) */
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

#endif /* LAGOM_PLUGIN_INTERNAL_H_ */
