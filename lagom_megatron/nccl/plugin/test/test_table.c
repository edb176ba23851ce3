/*
 * Tuner plugin harness, the cases about the plan table: malformed tables (each one ignored as a
 * whole), empty, missing and unset tables, the NCCL_TUNER_CONFIG_FILE fallback (only when
 * LAGOM_TUNER_CONFIG is unset; "" and "none" mean no table), communicator tags
 * (group prefixes, an invalid $LAGOM_TUNER_COMM_TAG) and a 20,000-row table. Helpers and main()
 * are in test_plugin.c.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static void expectIgnored(const char *table, const char *logNeedle) {
  writeTable(table);
  resetLog();
  void *a = initComm("dp", 8, 1, 1);
  CHECK(a != NULL, "init must still give a context");
  CHECK(strstr(gLog, "LAGOM/tuner:") && strstr(gLog, logNeedle), "want '%s' in log:\n%s",
        logNeedle, gLog);
  /* init-time messages carry INIT (1) | TUNING (64): visible with NCCL's default subsystems */
  CHECK(!strstr(gLog, "/64] LAGOM/tuner: comm") && strstr(gLog, "/65] LAGOM/tuner:"),
        "init-time messages must carry the INIT subsystem:\n%s", gLog);
  float t[NA][NP];
  for (int coll = 0; coll < LAGOM_NUM_TUNED_FUNCS; coll++) {
    fillTable(t);
    CHECK(collInfo(a, (ncclFunc_t)coll, 4096, t) == 0 && changedEntries(t) == 0,
          "collective %d changed by an ignored table", coll);
  }
  size_t chunk = 99;
  gV6->getChunkSize(a, ncclFuncAllReduce, 4096, LAGOM_ALGO_RING, LAGOM_PROTO_LL, 4, &chunk);
  CHECK(chunk == 99, "chunk %zu", chunk);
  gV6->finalize(a);
}

void test_malformed_tables(void) {
  /* the first line is valid and would match: one bad line discards the whole table */
  const char *good = "allreduce,0,-1,ring,ll,4,-1,-1\n";
  struct { const char *bad, *needle; } cases[] = {
      {"allreduce,0,-1,rign,ll,4,-1,-1\n", "line 2: algorithm 'rign'"},
      {"allreduce,0,-1,ring,ll,4\n", "line 2: has 6 columns, expected 8 to 12"},
      {"allreduce,0,-1,ring,ll,4,-1,-1,-1,-1,-1,dp,extra\n", "more than 12 columns"},
      {"allreduce,100,10,ring,ll,4,-1,-1\n", "min_bytes (100) > max_bytes (10)"},
      {"allreduce,0,-1,ring,ll,65,-1,-1\n", "channels '65'"},
      {"allreduce,0,-1,ring,ll,0,-1,-1\n", "channels '0'"},
      {"allreduce,0,-1,ring,ll,4,-1,-1,-1,-1,abc\n", "chunkSize 'abc'"},
      {"all_reduce,0,-1,ring,ll,4,-1,-1\n", "collective_type 'all_reduce'"},
      {"allreduce,-5,-1,ring,ll,4,-1,-1\n", "min_bytes '-5'"},
      {"allreduce,0,1e6,ring,ll,4,-1,-1\n", "max_bytes '1e6'"},
      {"allreduce,0,-1,ring,ll,4,-1,-1,-1,2\n", "regBuff '2'"},
      {"allreduce,0,-1,ring,ll,4,-1,-1,-1,-1,-1,bad tag\n", "commTag 'bad tag'"},
      {"allreduce,0,-1,ring,LL129,4,-1,-1\n", "protocol 'LL129'"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    char table[512];
    snprintf(table, sizeof(table), "%s%s", good, cases[i].bad);
    int before = gFailures;
    expectIgnored(table, cases[i].needle);
    if (gFailures != before) fprintf(stderr, "    (case %zu: %s)", i, cases[i].bad);
  }
  /* binary garbage */
  expectIgnored("\x01\x02\x03,,,\n", "line 1");
}

void test_empty_table(void) {
  expectIgnored("# only comments\n\n   \n# nothing else\n", "0 of 0 rows");
}

void test_missing_table(void) {
  writeTable("");
  setenv(LAGOM_TUNER_CONFIG_ENV, "/nonexistent/lagom/plan.csv", 1);
  resetLog();
  void *a = initComm("dp", 8, 1, 1);
  CHECK(strstr(gLog, "[2/65] LAGOM/tuner: cannot open plan table '/nonexistent/lagom/plan.csv'"),
        "a WARN with the INIT subsystem, log:\n%s", gLog);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0 && changedEntries(t) == 0, "no change");
  gV6->finalize(a);
}

void test_no_table_configured(void) {
  unsetenv(LAGOM_TUNER_CONFIG_ENV);
  unsetenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV);
  resetLog();
  void *a = initComm("dp", 8, 1, 1);
  CHECK(strstr(gLog, "no plan table"), "log:\n%s", gLog);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0 && changedEntries(t) == 0, "no change");
  gV6->finalize(a);
}

void test_fallback_env(void) {
  writeTable(kMainTable);
  unsetenv(LAGOM_TUNER_CONFIG_ENV);
  setenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV, gTablePath, 1);
  void *a = initComm("dp", 8, 1, 1);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 4, "NCCL_TUNER_CONFIG_FILE is read");
  gV6->finalize(a);
  unsetenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV);
}

void test_explicit_no_table(void) {
  /* "" and "none" in $LAGOM_TUNER_CONFIG mean no table: $NCCL_TUNER_CONFIG_FILE, which would
   * match, is not read (lagom's pool gives every communicator it creates one of these or its table) */
  writeTable(kMainTable);
  const char *values[] = {"", LAGOM_TUNER_NO_TABLE};
  for (int i = 0; i < 2; i++) {
    setenv(LAGOM_TUNER_CONFIG_ENV, values[i], 1);
    setenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV, gTablePath, 1);
    resetLog();
    void *a = initComm("dp", 8, 1, 1);
    char want[128];
    snprintf(want, sizeof(want), "no plan table (%s='%s')", LAGOM_TUNER_CONFIG_ENV, values[i]);
    CHECK(strstr(gLog, want) && !strstr(gLog, "rows"), "value '%s', log:\n%s", values[i], gLog);
    float t[NA][NP];
    fillTable(t);
    CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0 && changedEntries(t) == 0,
          "value '%s': NCCL_TUNER_CONFIG_FILE must not be read", values[i]);
    gV6->finalize(a);
  }
  /* the table itself, named explicitly, still applies with the fallback variable set */
  setenv(LAGOM_TUNER_CONFIG_ENV, gTablePath, 1);
  void *b = initComm("dp", 8, 1, 2);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(b, ncclFuncAllReduce, 4096, t) == 4, "an explicit table is read");
  gV6->finalize(b);
  unsetenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV);
}

void test_group_tag_prefix(void) {
  writeTable("allreduce,0,-1,ring,simple,3,-1,-1,-1,-1,-1,dp\n"
             "allreduce,0,-1,tree,simple,5,-1,-1,-1,-1,-1,dp/entry1\n");
  float t[NA][NP];
  void *group = initComm("dp", 8, 1, 1);
  void *entry = initComm("dp/entry1", 8, 1, 2);
  void *other = initComm("dp_cp/entry1", 8, 1, 3);
  void *longer = initComm("dpx", 8, 1, 4);
  fillTable(t);
  CHECK(collInfo(group, ncclFuncAllReduce, 64, t) == 3, "the group's own communicator");
  fillTable(t);
  CHECK(collInfo(entry, ncclFuncAllReduce, 64, t) == 3, "the group row comes first for its entry");
  fillTable(t);
  CHECK(collInfo(other, ncclFuncAllReduce, 64, t) == 0 && changedEntries(t) == 0, "dp_cp is not dp");
  fillTable(t);
  CHECK(collInfo(longer, ncclFuncAllReduce, 64, t) == 0, "dpx is not dp");
  gV6->finalize(group);
  gV6->finalize(entry);
  gV6->finalize(other);
  gV6->finalize(longer);
  writeTable("allreduce,0,-1,tree,simple,5,-1,-1,-1,-1,-1,dp/entry1\n");
  group = initComm("dp", 8, 1, 1);
  entry = initComm("dp/entry1", 8, 1, 2);
  fillTable(t);
  CHECK(collInfo(group, ncclFuncAllReduce, 64, t) == 0, "an entry's row is not the group's");
  fillTable(t);
  CHECK(collInfo(entry, ncclFuncAllReduce, 64, t) == 5, "the entry's own row");
  gV6->finalize(group);
  gV6->finalize(entry);
}

void test_bad_tag_env(void) {
  writeTable(kMainTable);
  resetLog();
  void *a = initComm("dp; rm -rf", 8, 1, 1);
  CHECK(strstr(gLog, "ignoring LAGOM_TUNER_COMM_TAG"), "log:\n%s", gLog);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0, "an invalid tag is treated as no tag");
  gV6->finalize(a);
}

void test_large_table(void) {
  FILE *fp = fopen(gTablePath, "w");
  CHECK(fp, "open");
  for (int i = 0; i < 20000; i++)
    fprintf(fp, "allreduce,%d,%d,ring,simple,%d,-1,-1,-1,-1,%d,site%d\n", i * 100, i * 100 + 99,
            1 + i % 64, 4096 * (1 + i % 8), i % 10);
  fclose(fp);
  setenv(LAGOM_TUNER_CONFIG_ENV, gTablePath, 1);
  resetLog();
  void *a = initComm("site3", 8, 1, 1);
  CHECK(strstr(gLog, "2000 of 20000 rows"), "log:\n%s", gLog);
  float t[NA][NP];
  fillTable(t);
  int i = 19993; /* tag site3, bytes 1999300..1999399 */
  CHECK(collInfo(a, ncclFuncAllReduce, 1999350, t) == 1 + i % 64, "last rows reachable");
  size_t chunk = 0;
  gV6->getChunkSize(a, ncclFuncAllReduce, 1999350, LAGOM_ALGO_RING, LAGOM_PROTO_SIMPLE, 1, &chunk);
  CHECK(chunk == (size_t)(4096 * (1 + i % 8)), "chunk %zu", chunk);
  gV6->finalize(a);
}
