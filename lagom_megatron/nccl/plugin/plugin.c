/*
 * lagom's NCCL tuner plugin: applies a searched plan per communicator, collective and byte range.
 *
 * NCCL calls init() once per communicator. init reads the plan table (a CSV exported by
 * `lagom plan export --format nccl-tuner-csv`) from $LAGOM_TUNER_CONFIG (else
 * $NCCL_TUNER_CONFIG_FILE) and keeps the rows that apply to this communicator: its nRanks and
 * nNodes, and its tag, which the Python side puts in $LAGOM_TUNER_COMM_TAG just before it creates
 * the communicator (init runs synchronously in that thread for blocking communicators).
 *
 * For each collective call getCollInfo() takes the first matching row and
 *   - states a preference for the row's algorithm/protocol by setting that cost-table entry to
 *     0.0 (never touching an entry NCCL disabled with -1.0, never indexing out of bounds);
 *   - sets *nChannels when the row gives a channel count.
 * A row tagged "dp" applies to communicators tagged "dp" and "dp/<anything>" (a process group
 * and its pool entries); an empty tag or "*" applies to every communicator.
 * On a miss it writes nothing at all, so NCCL keeps its own choice (unlike NCCL's example plugin,
 * which first writes one channel). getChunkSize() (ABI v6) sets the row's chunk size in bytes.
 *
 * A table that cannot be read or parsed is reported through NCCL's logger ("LAGOM/tuner: ...")
 * and ignored as a whole: the communicator keeps NCCL's tuning; init always succeeds, so a bad
 * table never fails communicator creation.
 *
 * Table columns (the first ten are those of NCCL's example tuner plugin; the last two are lagom's):
 *   collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,
 *   numPipeOps,regBuff,chunkSize,commTag
 * 8 to 12 columns per line; missing trailing columns mean "any" / "NCCL's". Lines starting with
 * '#' and blank lines are skipped; spaces around fields are ignored.
 */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "lagom_tuner.h"

#define LAGOM_EXPORT __attribute__((visibility("default")))
#define LAGOM_MAX_FIELDS 12
#define LAGOM_MIN_FIELDS 8

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
  int noted;           /* set once the row's algorithm/protocol could not be applied (log once) */
} LagomRow;

/* Per-communicator state, allocated in init and freed in finalize. */
typedef struct {
  ncclDebugLogger_t logFn;
  uint64_t commId;
  size_t nRanks;
  size_t nNodes;
  char tag[LAGOM_TAG_MAX];
  LagomRow *rows; /* only the rows that apply to this communicator */
  int nRows;
} LagomContext;

static const char *const kCollNames[LAGOM_NUM_TUNED_FUNCS] = {
    "broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
static const char *const kAlgoNames[LAGOM_NUM_ALGOS] = {
    "tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
static const char *const kProtoNames[LAGOM_NUM_PROTOS] = {"ll", "ll128", "simple"};

static const char *collName(int coll) {
  return (coll >= 0 && coll < LAGOM_NUM_TUNED_FUNCS) ? kCollNames[coll] : "?";
}
static const char *algoName(int algo) {
  return (algo >= 0 && algo < LAGOM_NUM_ALGOS) ? kAlgoNames[algo] : "any";
}
static const char *protoName(int proto) {
  return (proto >= 0 && proto < LAGOM_NUM_PROTOS) ? kProtoNames[proto] : "any";
}

/* Index of `s` in `names` (case-insensitive), -1 for the wildcard "-1", -2 when unknown. */
static int parseName(const char *s, const char *const *names, int n) {
  if (strcmp(s, "-1") == 0) return -1;
  for (int i = 0; i < n; i++)
    if (strcasecmp(s, names[i]) == 0) return i;
  return -2;
}

/* Whole-string integer parse; returns 0 on success. */
static int parseLongLong(const char *s, long long *out) {
  char *end = NULL;
  if (*s == '\0') return -1;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno != 0 || *end != '\0') return -1;
  *out = v;
  return 0;
}

/* Wildcard-or-range check for an int column: -1, or lo <= v <= hi. */
static int parseIntField(const char *s, long long lo, long long hi, int *out) {
  long long v;
  if (parseLongLong(s, &v) != 0) return -1;
  if (v != -1 && (v < lo || v > hi)) return -1;
  *out = (int)v;
  return 0;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  char *e = s + strlen(s);
  while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
  return s;
}

/* Splits `line` in place at commas (empty fields kept); returns the number of fields, or
 * LAGOM_MAX_FIELDS + 1 when there are too many. */
static int splitFields(char *line, char **fields) {
  int n = 0;
  char *p = line;
  for (;;) {
    if (n == LAGOM_MAX_FIELDS) return LAGOM_MAX_FIELDS + 1;
    char *comma = strchr(p, ',');
    if (comma) *comma = '\0';
    fields[n++] = trim(p);
    if (!comma) return n;
    p = comma + 1;
  }
}

static int validTag(const char *s) {
  if (strlen(s) >= LAGOM_TAG_MAX) return 0;
  for (; *s; s++)
    if (!(isalnum((unsigned char)*s) || strchr("_.:/*-[]", *s))) return 0;
  return 1;
}

/* Parses one data line into `row`. On error writes a message naming the bad column and value
 * into `err` and returns -1. */
static int parseRow(char *line, LagomRow *row, char *err, size_t errLen) {
  char *f[LAGOM_MAX_FIELDS];
  int n = splitFields(line, f);
  if (n < LAGOM_MIN_FIELDS || n > LAGOM_MAX_FIELDS) {
    if (n > LAGOM_MAX_FIELDS)
      snprintf(err, errLen, "has more than %d columns", LAGOM_MAX_FIELDS);
    else
      snprintf(err, errLen, "has %d columns, expected %d to %d", n, LAGOM_MIN_FIELDS,
               LAGOM_MAX_FIELDS);
    return -1;
  }
  memset(row, 0, sizeof(*row));
  row->numPipeOps = row->regBuff = -1;
  row->chunkSize = -1;

  row->coll = parseName(f[0], kCollNames, LAGOM_NUM_TUNED_FUNCS);
  if (row->coll < 0) {
    snprintf(err, errLen, "collective_type '%s' is not one of broadcast, reduce, allgather, "
             "reducescatter, allreduce", f[0]);
    return -1;
  }
  long long lo, hi;
  if (parseLongLong(f[1], &lo) != 0 || lo < 0) {
    snprintf(err, errLen, "min_bytes '%s' is not an integer >= 0", f[1]);
    return -1;
  }
  if (parseLongLong(f[2], &hi) != 0 || (hi < 0 && hi != -1)) {
    snprintf(err, errLen, "max_bytes '%s' is not an integer >= 0 or -1 (no limit)", f[2]);
    return -1;
  }
  row->minBytes = (size_t)lo;
  row->maxBytes = hi == -1 ? (size_t)-1 : (size_t)hi;
  if (row->minBytes > row->maxBytes) {
    snprintf(err, errLen, "min_bytes (%s) > max_bytes (%s)", f[1], f[2]);
    return -1;
  }
  row->algo = parseName(f[3], kAlgoNames, LAGOM_NUM_ALGOS);
  if (row->algo == -2) {
    snprintf(err, errLen, "algorithm '%s' is not one of tree, ring, collnet_direct, "
             "collnet_chain, nvls, nvls_tree, pat, -1", f[3]);
    return -1;
  }
  row->proto = parseName(f[4], kProtoNames, LAGOM_NUM_PROTOS);
  if (row->proto == -2) {
    snprintf(err, errLen, "protocol '%s' is not one of ll, ll128, simple, -1", f[4]);
    return -1;
  }
  if (parseIntField(f[5], 1, LAGOM_MAX_CHANNELS, &row->channels) != 0) {
    snprintf(err, errLen, "channels '%s' is not -1 or 1..%d", f[5], LAGOM_MAX_CHANNELS);
    return -1;
  }
  if (parseIntField(f[6], 1, 1 << 20, &row->nNodes) != 0) {
    snprintf(err, errLen, "nNodes '%s' is not -1 or a positive integer", f[6]);
    return -1;
  }
  if (parseIntField(f[7], 1, 1 << 24, &row->nRanks) != 0) {
    snprintf(err, errLen, "nRanks '%s' is not -1 or a positive integer", f[7]);
    return -1;
  }
  if (n > 8 && parseIntField(f[8], 1, 1 << 20, &row->numPipeOps) != 0) {
    snprintf(err, errLen, "numPipeOps '%s' is not -1 or a positive integer", f[8]);
    return -1;
  }
  if (n > 9 && parseIntField(f[9], 0, 1, &row->regBuff) != 0) {
    snprintf(err, errLen, "regBuff '%s' is not -1, 0 or 1", f[9]);
    return -1;
  }
  if (n > 10 && (parseLongLong(f[10], &row->chunkSize) != 0 ||
                 (row->chunkSize != -1 && row->chunkSize <= 0))) {
    snprintf(err, errLen, "chunkSize '%s' is not -1 or a positive number of bytes", f[10]);
    return -1;
  }
  if (n > 11) {
    if (!validTag(f[11])) {
      snprintf(err, errLen, "commTag '%s' is longer than %d characters or has characters other "
               "than letters, digits and _.:/*-[]", f[11], LAGOM_TAG_MAX - 1);
      return -1;
    }
    if (strcmp(f[11], "*") != 0) strcpy(row->tag, f[11]);
  }
  return 0;
}

/* A row's tag names a communicator ("dp/entry3") or a process group ("dp"): it applies to the
 * communicator with exactly that tag and to every communicator tagged "<row tag>/...", i.e. the
 * group's own communicator and its pool entries. */
static int tagMatches(const char *rowTag, const char *commTag) {
  if (rowTag[0] == '\0') return 1;
  size_t n = strlen(rowTag);
  return strncmp(rowTag, commTag, n) == 0 && (commTag[n] == '\0' || commTag[n] == '/');
}

static int rowAppliesToComm(const LagomContext *ctx, const LagomRow *row) {
  if (row->nRanks != -1 && (size_t)row->nRanks != ctx->nRanks) return 0;
  if (row->nNodes != -1 && (size_t)row->nNodes != ctx->nNodes) return 0;
  return tagMatches(row->tag, ctx->tag);
}

/* Reads the table at `path` and keeps the rows that apply to ctx's communicator. Any error
 * leaves ctx->rows empty (NCCL's choices everywhere) and is logged as a warning. */
static void loadTable(LagomContext *ctx, const char *path) {
  FILE *fp = fopen(path, "r");
  if (!fp) {
    LOG_INIT(ctx, NCCL_LOG_WARN, "cannot open plan table '%s' (%s); NCCL keeps its own choices",
        path, strerror(errno));
    return;
  }
  char *line = NULL;
  size_t cap = 0;
  int lineNo = 0, nTotal = 0, capRows = 0;
  LagomRow *rows = NULL;
  char err[256];
  int failed = 0;
  while (getline(&line, &cap, fp) != -1) {
    lineNo++;
    char *s = trim(line);
    if (*s == '\0' || *s == '#') continue;
    LagomRow row;
    if (parseRow(s, &row, err, sizeof(err)) != 0) {
      LOG_INIT(ctx, NCCL_LOG_WARN, "plan table '%s' line %d: %s; the whole table is ignored and "
          "NCCL keeps its own choices", path, lineNo, err);
      failed = 1;
      break;
    }
    row.line = lineNo;
    nTotal++;
    if (!rowAppliesToComm(ctx, &row)) continue;
    if (ctx->nRows == capRows) {
      int newCap = capRows ? 2 * capRows : 16;
      LagomRow *grown = realloc(rows, (size_t)newCap * sizeof(LagomRow));
      if (!grown) {
        LOG_INIT(ctx, NCCL_LOG_WARN, "out of memory reading plan table '%s'; NCCL keeps its own "
            "choices", path);
        failed = 1;
        break;
      }
      rows = grown;
      capRows = newCap;
    }
    rows[ctx->nRows++] = row;
  }
  if (!failed && ferror(fp)) {
    LOG_INIT(ctx, NCCL_LOG_WARN, "error reading plan table '%s'; NCCL keeps its own choices", path);
    failed = 1;
  }
  free(line);
  fclose(fp);
  if (failed) {
    free(rows);
    ctx->rows = NULL;
    ctx->nRows = 0;
    return;
  }
  ctx->rows = rows;
  LOG_INIT(ctx, NCCL_LOG_INFO, "comm 0x%llx tag '%s' nRanks %zu nNodes %zu: %d of %d rows of '%s' apply",
      (unsigned long long)ctx->commId, ctx->tag, ctx->nRanks, ctx->nNodes, ctx->nRows, nTotal,
      path);
}

static ncclResult_t lagomInit(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                              ncclDebugLogger_t logFn, int abiVersion) {
  *context = NULL;
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
  ctx->nRanks = nRanks;
  ctx->nNodes = nNodes;
  const char *tag = getenv(LAGOM_TUNER_COMM_TAG_ENV);
  if (tag && *tag) {
    if (validTag(tag)) {
      strcpy(ctx->tag, tag);
    } else {
      LOG_INIT(ctx, NCCL_LOG_WARN, "ignoring %s='%.80s': longer than %d characters or has characters "
          "other than letters, digits and _.:/*-[]", LAGOM_TUNER_COMM_TAG_ENV, tag,
          LAGOM_TAG_MAX - 1);
    }
  }
  const char *path = getenv(LAGOM_TUNER_CONFIG_ENV);
  if (!path || !*path) path = getenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV);
  LOG_INIT(ctx, NCCL_LOG_INFO, "ABI v%d init: comm 0x%llx tag '%s' nRanks %zu nNodes %zu", abiVersion,
      (unsigned long long)commId, ctx->tag, nRanks, nNodes);
  if (!path || !*path) {
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
    LOG_CALL(ctx, NCCL_LOG_TRACE, "tag '%s' %s %zu bytes: no row; NCCL's choice", ctx->tag,
        collName((int)collType), nBytes);
    return ncclSuccess;
  }
  float *table = (float *)collCostTable;
  int a = row->algo, p = row->proto;
  const char *why = NULL;
  if (table && (a >= 0 || p >= 0)) {
    if (a >= numAlgo || p >= numProto) {
      why = "is outside NCCL's cost table";
    } else {
      if (a >= 0 && p < 0) p = cheapestEnabled(table, a * numProto, 1, numProto);
      if (a < 0 && p >= 0) a = cheapestEnabled(table, p, numProto, numAlgo);
      if (a < 0 || p < 0 || table[a * numProto + p] < 0.0f)
        why = "is disabled by NCCL"; /* NCCL_ALGO_PROTO_IGNORE: never re-enable it */
      else
        table[a * numProto + p] = 0.0f; /* preferred: NCCL takes the cheapest entry */
    }
    /* Logged once per row: this repeats on every call of the same shape. */
    if (why && !__atomic_exchange_n(&((LagomRow *)row)->noted, 1, __ATOMIC_RELAXED))
      LOG_CALL(ctx, NCCL_LOG_INFO, "line %d: %s/%s %s for %s %zu bytes; keeping NCCL's algorithm and "
          "protocol (logged once per row)", row->line, algoName(row->algo), protoName(row->proto),
          why, collName((int)collType), nBytes);
  }
  if (row->channels > 0 && nChannels) *nChannels = row->channels;
  LOG_CALL(ctx, NCCL_LOG_TRACE, "tag '%s' %s %zu bytes: line %d -> %s/%s channels %d", ctx->tag,
      collName((int)collType), nBytes, row->line, algoName(row->algo), protoName(row->proto),
      row->channels);
  return ncclSuccess;
}

static ncclResult_t lagomGetChunkSize(void *context, ncclFunc_t collType, size_t nBytes, int algo,
                                      int proto, int nChannels, size_t *chunkSize) {
  (void)nChannels;
  LagomContext *ctx = context;
  if (!ctx || !chunkSize) return ncclSuccess;
  for (int i = 0; i < ctx->nRows; i++) {
    const LagomRow *r = &ctx->rows[i];
    if (!rowMatchesCall(r, (int)collType, nBytes)) continue;
    if (r->algo != -1 && r->algo != algo) continue;
    if (r->proto != -1 && r->proto != proto) continue;
    if (r->chunkSize > 0) *chunkSize = (size_t)r->chunkSize;
    return ncclSuccess;
  }
  return ncclSuccess;
}

static ncclResult_t lagomFinalize(void *context) {
  LagomContext *ctx = context;
  if (!ctx) return ncclSuccess;
  free(ctx->rows);
  free(ctx);
  return ncclSuccess;
}

/* ABI adapters: v5 and v6 share lagomInit's argument order; v3/v4 have no commId. */
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
