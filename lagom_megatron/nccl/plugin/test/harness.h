/*
 * harness.h: what the sources of the tuner plugin's C test harness share.
 *
 *   test_plugin.c  main(), the list of tests, --query, and the helpers declared below (a mock of
 *                  NCCL's logger, the table file, cost tables, init/getCollInfo the way NCCL calls
 *                  them).
 *   test_calls.c   NCCL's calls: several live communicators, cost-table edits, bounds, the
 *                  numPipeOps/regBuff match, a NULL context, chunk sizes and ABI v3/v4/v5.
 *   test_table.c   the plan table: malformed, empty, missing and unset tables, the fallback
 *                  variable and the explicit no-table values, communicator tags and a
 *                  20,000-row table.
 *   test_slices.c  chunk size by channel slice in NCCL's calling order, and the status exports
 *                  (ABI version, init count, per-row hit counters, table failures).
 */
#ifndef LAGOM_TEST_HARNESS_H_
#define LAGOM_TEST_HARNESS_H_

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../lagom_tuner.h"

#define NA LAGOM_NUM_ALGOS
#define NP LAGOM_NUM_PROTOS
#define IGN LAGOM_ALGO_PROTO_IGNORE

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      fprintf(stderr, "  FAIL %s:%d (%s): ", __func__, __LINE__, #cond);   \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
      gFailures++;                                                         \
      return;                                                              \
    }                                                                      \
  } while (0)

/* State shared by every test (defined in test_plugin.c). */
extern void *gLib;
extern const lagomTuner_v6_t *gV6;
extern char gLog[1 << 16];
extern int gFailures;
extern char gTablePath[512];

/* The table most tests use: two "dp" rows (8 ranks, 1 node), a "tp" row, a 4-rank row for any
 * tag and a 16-rank 2-node row. */
extern const char *const kMainTable;

/* Helpers (test_plugin.c). */
void mockLogger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                const char *fmt, ...);
void resetLog(void);
void writeTable(const char *text);
void fillTable(float t[NA][NP]);
int changedEntries(float t[NA][NP]);
void *initComm(const char *tag, size_t nRanks, size_t nNodes, uint64_t commId);
int collInfo(void *ctx, ncclFunc_t coll, size_t nBytes, float t[NA][NP]);

/* Tests (test_calls.c). */
void test_several_comms(void);
void test_disabled_entry_kept(void);
void test_bounds(void);
void test_match_fields(void);
void test_null_context(void);
void test_older_abis(void);

/* Tests (test_table.c). */
void test_malformed_tables(void);
void test_empty_table(void);
void test_missing_table(void);
void test_no_table_configured(void);
void test_fallback_env(void);
void test_explicit_no_table(void);
void test_group_tag_prefix(void);
void test_bad_tag_env(void);
void test_large_table(void);

/* Tests (test_slices.c). */
void test_chunk_by_slice(void);
void test_middle_slices_cover_every_middle_channel(void);
void test_status_exports(void);

#endif /* LAGOM_TEST_HARNESS_H_ */
