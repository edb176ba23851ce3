/*
 * harness.h: what the sources of the tuner plugin's C test harness share.
 *
 *   test_plugin.c  main(), the list of tests, --query, and the helpers declared below (a mock of
 *                  NCCL's logger, the table file, cost tables, init/getCollInfo the way NCCL calls
 *                  them).
 *   test_calls.c   NCCL's calls: several live communicators, cost-table edits, bounds, the
 *                  numPipeOps/regBuff match, a NULL context, chunk sizes and ABI v3/v4/v5/v7.
 *   test_table.c   the plan table: malformed, empty, missing and unset tables, the fallback
 *                  variable and the explicit no-table values, communicator tags and a
 *                  20,000-row table.
 *   test_slices.c  chunk size by channel slice in NCCL's calling order, and the status exports
 *                  (ABI version, init count, per-row hit counters, table failures).
 *   test_profiler.c the profiler half driven in NCCL's order for ABI v1-v7 (helpers below).
 *   test_observed.c its cases: what it records when NCCL ran the plan, fewer channels, another
 *                  algorithm, a P2P, a nameless communicator, a call NCCL's split puts on fewer
 *                  channels, proxy events before the host's stops, a user's own profiler plugin.
 *   test_ce.c      copy-engine collectives (ABI v6-v7) in NCCL's order, and their SM fallback.
 */
#ifndef LAGOM_TEST_HARNESS_H_
#define LAGOM_TEST_HARNESS_H_

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../lagom_profiler.h"
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
extern const char *gLibPath;

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
void test_tuner_v7(void);

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

/* Profiler half, driven in NCCL's order (test_profiler.c). */
const void *profilerStruct(int v);
extern int gNcclMask;
extern int gProxyFirst;
void *profInit(int v, uint64_t hash, const char *commName, const char *tag);
void profFinalize(int v, void *ctx);
void driveColl(int v, void *ctx, uint64_t hash, const char *func, size_t count, const char *algo,
               const char *proto, int nChannels, int chunk);
void driveP2p(int v, void *ctx, uint64_t hash, const char *func, size_t count, int nChannels);
extern int gPeer;
void *startTask(int v, void *ctx, void *group, uint64_t hash, const char *func, size_t count, const char *dtype,
                const char *algo, const char *proto, int nChannels, int nWarps);
void stopTask(int v, void *h);
void proxyEvents(int v, void *ctx, void *task, int chunk, int nChannels);
char *snapshot(void);
void setActive(int on);
void resetRecords(void);
int profilerState(void);
int hasLine(const char *snap, const char *kind, const char *want);

/* Tests and modes (test_observed.c). */
extern const char *const kScenarios[6];
int printSnapshot(int v, const char *scenario);
int profilerChildMain(void);
void test_profiler_match_plan(void);
void test_profiler_clamped_channels(void);
void test_profiler_small_call(void);
void test_profiler_proxy_before_host_stop(void);
void test_profiler_other_algorithm(void);
void test_profiler_p2p(void);
void test_profiler_missing_comm_name(void);
void test_profiler_comm_name_keys_rows(void);
void test_next_comm_set_in_process(void);
void test_profiler_activation_mask(void);
void test_profiler_bounded(void);
void test_profiler_self_p2p_releases_its_slot(void);
void test_profiler_user_plugin(void);
void test_profiler_v7_fields(void);
extern int gPhaseHandles;

/* Copy-engine collectives, ABI v6-v7 (test_ce.c). */
void *driveCeAllGather(int v, void *ctx, size_t bytes);
int printCeSnapshot(int v, const char *scenario);
void test_profiler_ce_allgather(void);

#endif /* LAGOM_TEST_HARNESS_H_ */
