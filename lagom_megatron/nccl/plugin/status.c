/*
 * status.c: what lagom's tuner plugin reports about itself to the process that loaded it.
 *
 * NCCL gives a tuner plugin no way to report back, and the NCCL_TUNER_PLUGIN variable says
 * nothing about what NCCL really loaded (a wrong path or "none" only shows in NCCL's INFO log).
 * So the plugin keeps process-wide counters and exports three plain C functions; the Python side
 * (lagom_megatron/nccl/plugin_status.py) opens the already mapped library with RTLD_NOLOAD and
 * calls them through ctypes:
 *
 *   int lagomTunerAbiVersion(void);   ABI version NCCL last initialised the plugin with (3-7),
 *                                     0 before any init
 *   int lagomTunerInitCount(void);    communicators NCCL initialised the plugin for
 *   int lagomTunerRowHits(unsigned long long *out, int capacity);
 *                                     copies min(capacity, rows) per-row match counts of the table
 *                                     loaded last (data rows in file order, comments and blank
 *                                     lines not counted) and returns its row count; -1 when no
 *                                     table was loaded
 *   int lagomTunerTableFailures(void); inits whose table could not be read or parsed
 *
 * A row's count is the number of getCollInfo calls (one per collective, or per group of
 * same-function collectives NCCL aggregates) it was the matching row for, summed over every
 * communicator that loaded the same table file. A table file rewritten in place or replaced
 * (new inode, size or mtime) starts new counters; the old ones stay valid for the communicators
 * that still use them and are freed when the library is unloaded (a few bytes per row).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "plugin_internal.h"

#define LAGOM_EXPORT __attribute__((visibility("default")))

struct LagomTableHits {
  char *path;
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime;
  int nRows;
  unsigned long long *counts;
  LagomTableHits *next;
};

static int gAbiVersion;
static int gInitCount;
static int gTableFailures;
static LagomTableHits *gTables;  /* every table loaded in this process, newest first */
static LagomTableHits *gCurrent; /* the one lagomTunerRowHits reports */
static char gLock;               /* guards gTables; taken only in init (rare, never per call) */

static void lock(void) {
  while (__atomic_test_and_set(&gLock, __ATOMIC_ACQUIRE)) {
  }
}
static void unlock(void) { __atomic_clear(&gLock, __ATOMIC_RELEASE); }

void statusNoteInit(int abiVersion) {
  __atomic_store_n(&gAbiVersion, abiVersion, __ATOMIC_RELAXED);
  __atomic_fetch_add(&gInitCount, 1, __ATOMIC_RELAXED);
}

void statusNoteTableFailure(void) { __atomic_fetch_add(&gTableFailures, 1, __ATOMIC_RELAXED); }

static int sameFile(const LagomTableHits *t, const char *path, const struct stat *st, int nRows) {
  return t->nRows == nRows && t->dev == st->st_dev && t->ino == st->st_ino &&
         t->size == st->st_size && t->mtime.tv_sec == st->st_mtim.tv_sec &&
         t->mtime.tv_nsec == st->st_mtim.tv_nsec && strcmp(t->path, path) == 0;
}

LagomTableHits *statusTableHits(const char *path, int fd, int nRows) {
  struct stat st;
  if (fstat(fd, &st) != 0) memset(&st, 0, sizeof(st));
  lock();
  LagomTableHits *t = gTables;
  while (t && !sameFile(t, path, &st, nRows)) t = t->next;
  if (!t) {
    t = calloc(1, sizeof(*t));
    if (t) {
      t->path = strdup(path);
      t->counts = calloc(nRows > 0 ? (size_t)nRows : 1, sizeof(unsigned long long));
      if (!t->path || !t->counts) {
        free(t->path);
        free(t->counts);
        free(t);
        t = NULL;
      }
    }
    if (t) {
      t->dev = st.st_dev;
      t->ino = st.st_ino;
      t->size = st.st_size;
      t->mtime = st.st_mtim;
      t->nRows = nRows;
      t->next = gTables;
      gTables = t;
    }
  }
  if (t) __atomic_store_n(&gCurrent, t, __ATOMIC_RELEASE);
  unlock();
  return t;
}

void statusCountHit(LagomTableHits *hits, int index) {
  if (hits && index >= 0 && index < hits->nRows)
    __atomic_fetch_add(&hits->counts[index], 1ULL, __ATOMIC_RELAXED);
}

static char gNextTag[LAGOM_TAG_MAX];
static char gNextTable[LAGOM_TABLE_PATH_MAX];
static int gNextSet; /* guarded by gLock, like gTables: taken at communicator creation only */

/* Names the communicators created from now on (tag: their rows' key; table: the plan table, "none" for
 * none) until called with two NULLs; -1 (nothing changed) for a value that does not fit. */
LAGOM_EXPORT int lagomSetNextComm(const char *tag, const char *table) {
  if ((tag && strlen(tag) >= sizeof(gNextTag)) || (table && strlen(table) >= sizeof(gNextTable))) return -1;
  lock();
  gNextSet = tag != NULL || table != NULL;
  snprintf(gNextTag, sizeof(gNextTag), "%s", tag ? tag : "");
  snprintf(gNextTable, sizeof(gNextTable), "%s", table ? table : "");
  unlock();
  return 0;
}

int nextCommSettings(char *tag, size_t tagCap, char *table, size_t tableCap) {
  lock();
  int set = gNextSet;
  if (set) {
    snprintf(tag, tagCap, "%s", gNextTag);
    snprintf(table, tableCap, "%s", gNextTable);
  }
  unlock();
  return set;
}

LAGOM_EXPORT int lagomTunerAbiVersion(void) { return __atomic_load_n(&gAbiVersion, __ATOMIC_RELAXED); }

LAGOM_EXPORT int lagomTunerInitCount(void) { return __atomic_load_n(&gInitCount, __ATOMIC_RELAXED); }

LAGOM_EXPORT int lagomTunerTableFailures(void) {
  return __atomic_load_n(&gTableFailures, __ATOMIC_RELAXED);
}

LAGOM_EXPORT int lagomTunerRowHits(unsigned long long *out, int capacity) {
  const LagomTableHits *t = __atomic_load_n(&gCurrent, __ATOMIC_ACQUIRE);
  if (!t) return -1;
  int n = t->nRows < capacity ? t->nRows : capacity;
  for (int i = 0; out && i < n; i++) out[i] = __atomic_load_n(&t->counts[i], __ATOMIC_RELAXED);
  return t->nRows;
}

/* Frees the counters when the library is unloaded (dlclose or process exit): no communicator can
 * use them any more, since NCCL finalizes every context before it closes the plugin. */
__attribute__((destructor)) static void freeTables(void) {
  lock();
  while (gTables) {
    LagomTableHits *next = gTables->next;
    free(gTables->path);
    free(gTables->counts);
    free(gTables);
    gTables = next;
  }
  gCurrent = NULL;
  unlock();
}
