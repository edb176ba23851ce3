/*
 * lagom's NCCL tuner plugin: applies a searched plan per communicator, collective and byte range.
 *
 * NCCL calls init() once per communicator. init reads the plan table (a CSV exported by
 * `lagom plan export --format nccl-tuner-csv`) from $LAGOM_TUNER_CONFIG and keeps the rows that
 * apply to this communicator: its nRanks and
 * nNodes, and its tag: $LAGOM_TUNER_COMM_TAG, which the Python side sets just before it creates a
 * pool entry (init runs synchronously in that thread for blocking communicators), else the
 * communicator's name when NCCL gave the profiler half one for the same commId (ABI v5+, observed.c).
 * $LAGOM_TUNER_CONFIG set to "" or "none" means no table, explicitly: the communicator keeps
 * NCCL's tuning and $NCCL_TUNER_CONFIG_FILE is not read (lagom's launch and pool set one of them
 * for every communicator they create). Only with $LAGOM_TUNER_CONFIG unset is the table read from
 * $NCCL_TUNER_CONFIG_FILE, the variable of NCCL's example plugin, for a plugin enabled by hand.
 *
 * For each collective call getCollInfo() takes the first matching row and
 *   - states a preference for the row's algorithm/protocol by setting that cost-table entry to
 *     0.0 (never touching an entry NCCL disabled with -1.0, never indexing out of bounds);
 *   - sets *nChannels when the row gives a channel count;
 *   - when NCCL disabled the row's algorithm/protocol (or has no such entry), applies nothing of
 *     the row: not its channels (chosen for that algorithm) and not its chunk size, and counts no
 *     hit.
 * A row tagged "dp" applies to communicators tagged "dp" and "dp/<anything>" (a process group
 * and its pool entries); an empty tag or "*" applies to every communicator.
 * On a miss it writes nothing at all, so NCCL keeps its own choice (unlike NCCL's example plugin,
 * which first writes one channel). Every match adds one to the row's hit counter (status.c).
 *
 * Chunk size by slice (ABI v6+, NCCL >= 2.30). NCCL does not ask getChunkSize about the
 * collective it asked getCollInfo about, but about each channel slice of it (NCCL v2.30.7
 * src/enqueue.cc): ncclPrepareTasks calls getCollInfo once per collective, or per group of
 * same-(function, op, type) collectives within 4x of each other with their bytes summed
 * (:430-441 -> ncclGetAlgoInfo :2147); later scheduleCollTasksToPlan calls calcCollChunking,
 * which calls getChunkSize (:2308-2318), once per slice of each collective with nChannels = 1 and
 * nBytes = one channel's share (countLo, then countHi, then countMid once for all middle
 * channels: :725, :730, :735), or once with the whole collective and its channels on the CollNet
 * path (:634). Both byte counts use the same scale (element size x NCCL's max send/recv count),
 * so the slices NCCL asks about never add up to more than the bytes getCollInfo saw. Both phases
 * run for one ncclGroupEnd on one communicator, prepare before launch (src/group.cc:674, :723 ->
 * enqueue.cc ncclLaunchPrepare :1617). Rows hold the whole collective's bytes, so a slice seldom
 * matches a row by itself. Instead getCollInfo remembers each call of the current group on its
 * communicator (collective, bytes, matched row or none), and a getCollInfo after a getChunkSize
 * starts a new group (forgets the old one). getChunkSize gives a slice to the remembered call of
 * the same collective NCCL is slicing (takeSlice: lo, hi, then one middle share standing for all
 * middle channels), deducts it, and applies that call's row's chunk size when NCCL's final
 * algorithm/protocol are the row's (or the row leaves them to NCCL). One collective per group, or one row per function in a group, is
 * exact; several same-function collectives of one group with different rows are told apart by
 * their bytes in NCCL's scheduling order. At most LAGOM_PENDING_MAX calls are remembered per
 * group (the oldest is forgotten first). NCCL's symmetric-kernel and allgatherv paths ask
 * getCollInfo without slicing (src/scheduler/symmetric_sched.cc:170, allgatherv_sched.cc:54):
 * such a call stays remembered until the next group starts, and could take the slices of a
 * same-function collective asked about after it in the same group.
 *
 * A table that cannot be read or parsed is reported through NCCL's logger ("LAGOM/tuner: ...")
 * and ignored as a whole: the communicator keeps NCCL's tuning; init always succeeds, so a bad
 * table never fails communicator creation.
 *
 * This file holds NCCL's entry points, the per-communicator state and the exported ABI structs
 * (v3 to v7; v7, which NCCL 2.32 looks up first, behaves exactly as v6: its only change is the
 * size of the constants table init receives, which lagom never touches); table.c reads and
 * parses the plan table (its format is described there).
 */
#include <stdlib.h>
#include <string.h>

#include "plugin_internal.h"

#define LAGOM_EXPORT __attribute__((visibility("default")))

static ncclResult_t lagomInit(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                              ncclDebugLogger_t logFn, int abiVersion) {
  *context = NULL;
  statusNoteInit(abiVersion);
  LagomContext *ctx = calloc(1, sizeof(LagomContext));
  if (!ctx) {
    /* No context: every call then keeps NCCL's choice. Never fail communicator creation. */
    if (logFn)
      logFn(NCCL_LOG_WARN, LAGOM_NCCL_SUBSYS_INIT | LAGOM_NCCL_SUBSYS_TUNING, __FILE__, __LINE__,
            "LAGOM/tuner: out of memory in init; NCCL keeps its own choices");
    return ncclSuccess;
  }
  ctx->logFn = logFn;
  ctx->commId = commId;
  ctx->abiVersion = abiVersion;
  ctx->nRanks = nRanks;
  ctx->nNodes = nNodes;
  ctx->current = -1;
  char name[LAGOM_OBS_NAME], nextTag[LAGOM_TAG_MAX], nextTable[LAGOM_TABLE_PATH_MAX];
  const int inProcess = nextCommSettings(nextTag, sizeof(nextTag), nextTable, sizeof(nextTable));
  const char *tag = inProcess ? nextTag : getenv(LAGOM_TUNER_COMM_TAG_ENV);
  observedCheckProfiler(logFn);
  if (tag && *tag) {
    /* lagom sets the tag only around the creation of its own pool entries; it wins over the name, which
     * torch's nccl2 engine always sets to the process group's group_name (NCCLBootstrap::createNcclComm) */
    if (validTag(tag)) {
      strcpy(ctx->tag, tag);
    } else {
      LOG_INIT(ctx, NCCL_LOG_WARN, "ignoring %s='%.80s': longer than %d characters or has characters "
          "other than letters, digits and _.:/*-[]", LAGOM_TUNER_COMM_TAG_ENV, tag,
          LAGOM_TAG_MAX - 1);
    }
  } else if (commId && observedNameFor(commId, name, sizeof(name))) {
    /* the profiler half's init ran first for the same commHash (src/init.cc:1520 vs :1641) and
     * NCCL gave it the communicator's name (ncclConfig_t.commName): rows are keyed by that name */
    if (validTag(name)) {
      strcpy(ctx->tag, name);
    } else {
      LOG_INIT(ctx, NCCL_LOG_INFO, "communicator name '%.80s' is not a valid tag (at most %d letters, digits and "
          "_.:/*-[]); only rows tagged '*' apply", name, LAGOM_TAG_MAX - 1);
    }
  }
  const char *path = inProcess ? nextTable : getenv(LAGOM_TUNER_CONFIG_ENV);
  const char *var = inProcess ? "lagomSetNextComm" : LAGOM_TUNER_CONFIG_ENV;
  if (!path) {
    path = getenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV);
    var = LAGOM_TUNER_CONFIG_FALLBACK_ENV;
  }
  LOG_INIT(ctx, NCCL_LOG_INFO, "ABI v%d init: comm 0x%llx tag '%s' nRanks %zu nNodes %zu", abiVersion,
      (unsigned long long)commId, ctx->tag, nRanks, nNodes);
  if (path && (!*path || strcmp(path, LAGOM_TUNER_NO_TABLE) == 0)) {
    LOG_INIT(ctx, NCCL_LOG_INFO, "no plan table (%s='%s'); NCCL keeps its own choices", var, path);
  } else if (!path) {
    LOG_INIT(ctx, NCCL_LOG_INFO, "no plan table (%s and %s unset); NCCL keeps its own choices",
        LAGOM_TUNER_CONFIG_ENV, LAGOM_TUNER_CONFIG_FALLBACK_ENV);
  } else {
    loadTable(ctx, path);
  }
  *context = ctx;
  return ncclSuccess;
}

static int rowMatchesCall(const LagomRow *row, int coll, size_t nBytes) {
  return row->coll == coll && nBytes >= row->minBytes && nBytes <= row->maxBytes;
}

/* Remembers a getCollInfo call until getChunkSize has seen all of its slices (ABI v6 and v7). */
static void rememberCall(LagomContext *ctx, int coll, size_t nBytes, const LagomRow *row) {
  if (ctx->abiVersion < 6 || nBytes == 0) return;
  if (ctx->sliced) { /* getChunkSize ran since the last getCollInfo: a new group starts */
    ctx->nPending = 0;
    ctx->sliced = 0;
    ctx->current = -1;
  }
  if (ctx->nPending == LAGOM_PENDING_MAX) { /* drop the oldest: NCCL never sliced it */
    memmove(&ctx->pending[0], &ctx->pending[1], (LAGOM_PENDING_MAX - 1) * sizeof(LagomPending));
    ctx->nPending--;
    ctx->current = -1;
  }
  ctx->pending[ctx->nPending++] = (LagomPending){.coll = coll, .remaining = nBytes, .row = row};
}

/* The remembered call a slice of `nBytes` of `coll` belongs to: deducts the slice and returns the
 * call's row (NULL when it matched none); *found is 0 when no remembered call can own the slice.
 * NCCL slices one collective at a time (scheduleCollTasksToPlan, src/enqueue.cc:725-737): its
 * lowest channel's share, then its highest's, then the middle share asked once for all of the
 * nMid middle channels (a middle share is only asked when a highest share was). So a slice goes
 * to the call whose slices are under way while that call has the bytes, else to the first call
 * of the collective not yet sliced that has them, else to the first that has them; and the third
 * slice of a call is its middle share, which covers every byte it has left (nMid x the share). */
static const LagomRow *takeSlice(LagomContext *ctx, int coll, size_t nBytes, int *found) {
  LagomPending *p = NULL;
  if (ctx->current >= 0 && ctx->current < ctx->nPending) {
    LagomPending *c = &ctx->pending[ctx->current];
    if (c->coll == coll && c->remaining >= nBytes && c->remaining > 0) p = c;
  }
  for (int pass = 0; pass < 2 && !p; pass++) {
    for (int i = 0; i < ctx->nPending; i++) {
      LagomPending *q = &ctx->pending[i];
      if (q->coll != coll || q->remaining < nBytes || (pass == 0 && q->slices > 0)) continue;
      p = q;
      ctx->current = i;
      break;
    }
  }
  if (!p) {
    *found = 0;
    return NULL;
  }
  p->slices++;
  if (p->slices >= 3 && nBytes > 0 && p->remaining % nBytes == 0)
    p->remaining = 0; /* the middle share, for all nMid middle channels */
  else
    p->remaining -= nBytes;
  if (p->remaining == 0) ctx->current = -1;
  *found = 1;
  return p->row;
}

/* Index of the cheapest entry NCCL left enabled among `count` entries `stride` apart, or -1. */
static int cheapestEnabled(const float *table, int start, int stride, int count) {
  int best = -1;
  for (int i = 0; i < count; i++) {
    float c = table[start + i * stride];
    if (c < 0.0f) continue; /* NCCL_ALGO_PROTO_IGNORE */
    if (best < 0 || c < table[start + best * stride]) best = i;
  }
  return best;
}

static ncclResult_t lagomGetCollInfo(void *context, ncclFunc_t collType, size_t nBytes,
                                     int numPipeOps, float **collCostTable, int numAlgo,
                                     int numProto, int regBuff, int *nChannels) {
  LagomContext *ctx = context;
  if (!ctx || ctx->nRows == 0) return ncclSuccess;
  const LagomRow *row = NULL;
  for (int i = 0; i < ctx->nRows; i++) {
    const LagomRow *r = &ctx->rows[i];
    if (!rowMatchesCall(r, (int)collType, nBytes)) continue;
    if (r->numPipeOps != -1 && r->numPipeOps != numPipeOps) continue;
    if (r->regBuff != -1 && regBuff >= 0 && r->regBuff != regBuff) continue;
    row = r;
    break;
  }
  if (!row) {
    rememberCall(ctx, (int)collType, nBytes, NULL);
    LOG_CALL(ctx, NCCL_LOG_TRACE, "tag '%s' %s %zu bytes: no row; NCCL's choice", ctx->tag,
        collName((int)collType), nBytes);
    return ncclSuccess;
  }
  float *table = (float *)collCostTable;
  int a = row->algo, p = row->proto;
  const char *why = NULL;
  if (a >= 0 || p >= 0) {
    if (!table) {
      why = "has no cost table to prefer it in";
    } else if (a >= numAlgo || p >= numProto) {
      why = "is outside NCCL's cost table";
    } else {
      if (a >= 0 && p < 0) p = cheapestEnabled(table, a * numProto, 1, numProto);
      if (a < 0 && p >= 0) a = cheapestEnabled(table, p, numProto, numAlgo);
      if (a < 0 || p < 0 || table[a * numProto + p] < 0.0f)
        why = "is disabled by NCCL"; /* NCCL_ALGO_PROTO_IGNORE: never re-enable it */
      else
        table[a * numProto + p] = 0.0f; /* preferred: NCCL takes the cheapest entry */
    }
  }
  if (why) {
    /* The row's decision does not hold: its channel count and chunk size were chosen for its
     * algorithm and protocol, and NCCL's own algorithm would run with them (*nChannels replaces
     * NCCL's channel count, src/enqueue.cc:2178). The call keeps NCCL's choice entirely, is not
     * counted as a hit, and its slices keep NCCL's chunk. Logged once per row: this repeats on
     * every call of the same shape. */
    rememberCall(ctx, (int)collType, nBytes, NULL);
    if (!__atomic_exchange_n(&((LagomRow *)row)->noted, 1, __ATOMIC_RELAXED))
      LOG_CALL(ctx, NCCL_LOG_INFO, "line %d: %s/%s %s for %s %zu bytes; keeping NCCL's algorithm, "
          "protocol, channels and chunk size (logged once per row)", row->line, algoName(row->algo),
          protoName(row->proto), why, collName((int)collType), nBytes);
    return ncclSuccess;
  }
  rememberCall(ctx, (int)collType, nBytes, row);
  statusCountHit(ctx->hits, row->index);
  if (row->channels > 0 && nChannels) *nChannels = row->channels;
  LOG_CALL(ctx, NCCL_LOG_TRACE, "tag '%s' %s %zu bytes: line %d -> %s/%s channels %d", ctx->tag,
      collName((int)collType), nBytes, row->line, algoName(row->algo), protoName(row->proto),
      row->channels);
  return ncclSuccess;
}

/* nBytes is one channel slice of a collective (see the top of this file), not the collective. */
static ncclResult_t lagomGetChunkSize(void *context, ncclFunc_t collType, size_t nBytes, int algo,
                                      int proto, int nChannels, size_t *chunkSize) {
  LagomContext *ctx = context;
  if (!ctx || !chunkSize || ctx->nRows == 0) return ncclSuccess;
  int found;
  ctx->sliced = 1;
  const LagomRow *r = takeSlice(ctx, (int)collType, nBytes, &found);
  if (!found) {
    LOG_CALL(ctx, NCCL_LOG_TRACE, "tag '%s' %s slice of %zu bytes: no collective of that size "
        "pending; NCCL's chunk size", ctx->tag, collName((int)collType), nBytes);
    return ncclSuccess;
  }
  if (!r || r->chunkSize <= 0) return ncclSuccess;
  if ((r->algo != -1 && r->algo != algo) || (r->proto != -1 && r->proto != proto)) return ncclSuccess;
  *chunkSize = (size_t)r->chunkSize;
  LOG_CALL(ctx, NCCL_LOG_TRACE, "tag '%s' %s slice of %zu bytes on %d channel(s): line %d -> chunk "
      "%lld", ctx->tag, collName((int)collType), nBytes, nChannels, r->line, r->chunkSize);
  return ncclSuccess;
}

static ncclResult_t lagomFinalize(void *context) {
  LagomContext *ctx = context;
  if (!ctx) return ncclSuccess;
  free(ctx->rows);
  free(ctx);
  return ncclSuccess;
}

/* ABI adapters: v5 to v7 share lagomInit's argument order; v3/v4 have no commId. */
static ncclResult_t initV7(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                           ncclDebugLogger_t logFn, lagomNvlDomainInfo_t *nvl,
                           lagomTunerConstants_t *constants) {
  (void)nvl;
  (void)constants; /* five compute-capability rows from v7 on: left as they are, like v6's four */
  return lagomInit(context, commId, nRanks, nNodes, logFn, 7);
}

static ncclResult_t initV6(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                           ncclDebugLogger_t logFn, lagomNvlDomainInfo_t *nvl,
                           lagomTunerConstants_t *constants) {
  (void)nvl;
  (void)constants; /* NCCL's model constants are left as they are */
  return lagomInit(context, commId, nRanks, nNodes, logFn, 6);
}

static ncclResult_t initV5(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                           ncclDebugLogger_t logFn, lagomNvlDomainInfo_t *nvl,
                           lagomTunerConstants_t *constants) {
  (void)nvl;
  (void)constants;
  return lagomInit(context, commId, nRanks, nNodes, logFn, 5);
}

static ncclResult_t initV4(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFn, void **context) {
  return lagomInit(context, 0, nRanks, nNodes, logFn, 4);
}

static ncclResult_t initV3(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFn, void **context) {
  return lagomInit(context, 0, nRanks, nNodes, logFn, 3);
}

static ncclResult_t getCollInfoV3(void *context, ncclFunc_t collType, size_t nBytes,
                                  int numPipeOps, float **collCostTable, int numAlgo,
                                  int numProto, int *nChannels) {
  /* v3 has no regBuff: -1 means unknown, so rows match whatever their regBuff column says */
  return lagomGetCollInfo(context, collType, nBytes, numPipeOps, collCostTable, numAlgo, numProto,
                          -1, nChannels);
}

LAGOM_EXPORT const lagomTuner_v7_t ncclTunerPlugin_v7 = {
    .name = "lagom",
    .init = initV7,
    .getCollInfo = lagomGetCollInfo,
    .finalize = lagomFinalize,
    .getChunkSize = lagomGetChunkSize,
};

LAGOM_EXPORT const lagomTuner_v6_t ncclTunerPlugin_v6 = {
    .name = "lagom",
    .init = initV6,
    .getCollInfo = lagomGetCollInfo,
    .finalize = lagomFinalize,
    .getChunkSize = lagomGetChunkSize,
};

LAGOM_EXPORT const lagomTuner_v5_t ncclTunerPlugin_v5 = {
    .name = "lagom",
    .init = initV5,
    .getCollInfo = lagomGetCollInfo,
    .finalize = lagomFinalize,
};

LAGOM_EXPORT const lagomTuner_v4_t ncclTunerPlugin_v4 = {
    .name = "lagom",
    .init = initV4,
    .getCollInfo = lagomGetCollInfo,
    .destroy = lagomFinalize,
};

LAGOM_EXPORT const lagomTuner_v3_t ncclTunerPlugin_v3 = {
    .name = "lagom",
    .init = initV3,
    .getCollInfo = getCollInfoV3,
    .destroy = lagomFinalize,
};
