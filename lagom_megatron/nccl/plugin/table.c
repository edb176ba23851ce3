/*
 * table.c: reading lagom's plan table for the NCCL tuner plugin (see plugin.c for how the rows
 * are applied).
 *
 * loadTable() reads the CSV exported by `lagom plan export --format nccl-tuner-csv` and keeps the
 * rows that apply to one communicator (its nRanks, nNodes and tag). A line that does not parse
 * makes the whole table ignored: the warning names the line, the column and the value.
 *
 * Table columns (the first ten are those of NCCL's example tuner plugin; the last two are lagom's):
 *   collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,
 *   numPipeOps,regBuff,chunkSize,commTag
 * 8 to 12 columns per line; missing trailing columns mean "any" / "NCCL's". Lines starting with
 * '#' and blank lines are skipped; spaces around fields are ignored.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "plugin_internal.h"

#define LAGOM_MAX_FIELDS 12
#define LAGOM_MIN_FIELDS 8

static const char *const kCollNames[LAGOM_NUM_TUNED_FUNCS] = {
    "broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
static const char *const kAlgoNames[LAGOM_NUM_ALGOS] = {
    "tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
static const char *const kProtoNames[LAGOM_NUM_PROTOS] = {"ll", "ll128", "simple"};

const char *collName(int coll) {
  return (coll >= 0 && coll < LAGOM_NUM_TUNED_FUNCS) ? kCollNames[coll] : "?";
}
const char *algoName(int algo) {
  return (algo >= 0 && algo < LAGOM_NUM_ALGOS) ? kAlgoNames[algo] : "any";
}
const char *protoName(int proto) {
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

int validTag(const char *s) {
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
void loadTable(LagomContext *ctx, const char *path) {
  FILE *fp = fopen(path, "r");
  if (!fp) {
    LOG_INIT(ctx, NCCL_LOG_WARN, "cannot open plan table '%s' (%s); NCCL keeps its own choices",
        path, strerror(errno));
    statusNoteTableFailure();
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
    row.index = nTotal++;
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
  if (!failed) {
    ctx->hits = statusTableHits(path, fileno(fp), nTotal);
    if (!ctx->hits) {
      LOG_INIT(ctx, NCCL_LOG_WARN, "out of memory for the hit counters of plan table '%s'; NCCL "
          "keeps its own choices", path);
      failed = 1;
    }
  }
  fclose(fp);
  if (failed) {
    statusNoteTableFailure();
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
