/*
 * Test harness for lagom's NCCL tuner plugin.
 *
 * Loads the built shared library with dlopen() and drives it the way NCCL does: looks up
 * ncclTunerPlugin_v6 (and v5, v4, v3), calls init once per communicator (several communicators
 * alive at once, each with its own $LAGOM_TUNER_COMM_TAG read during init), getCollInfo on a
 * [numAlgo][numProto] cost table, getChunkSize (v6), then finalize/destroy.
 *
 * Usage:
 *   test_plugin LIB.so [TEST_NAME ...]      run all tests, or the named ones
 *   test_plugin LIB.so --list               list the tests
 *   test_plugin LIB.so --query TABLE TAG NRANKS NNODES COLL NBYTES
 *       prints "algo=<i> proto=<i> channels=<n> chunk=<bytes>" for one call on a cost table
 *       where every entry is enabled (-1 = NCCL's choice kept), and the plugin's log on stderr.
 * Exit status: 0 when every selected test passed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../lagom_tuner.h"

#define NA LAGOM_NUM_ALGOS
#define NP LAGOM_NUM_PROTOS
#define IGN LAGOM_ALGO_PROTO_IGNORE

static void *gLib;
static const lagomTuner_v6_t *gV6;
static char gLog[1 << 16];
static size_t gLogLen;
static int gFailures;
static char gTablePath[512];

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

/* Stands in for NCCL's logger: keeps every message so tests can assert on them. */
static void mockLogger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                       const char *fmt, ...) {
  (void)file;
  (void)line;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  /* "[level/subsystem flags] message": NCCL shows a message only when its flags meet
   * NCCL_DEBUG_SUBSYS (default INIT,BOOTSTRAP,ENV), warnings included */
  int n = snprintf(gLog + gLogLen, sizeof(gLog) - gLogLen, "[%d/%lu] %s\n", (int)level, flags, msg);
  if (n > 0 && gLogLen + (size_t)n < sizeof(gLog)) gLogLen += (size_t)n;
  if (getenv("LAGOM_TEST_VERBOSE")) fprintf(stderr, "    log[%d] %s\n", (int)level, msg);
}

static void resetLog(void) {
  gLogLen = 0;
  gLog[0] = '\0';
}

static void writeTable(const char *text) {
  FILE *fp = fopen(gTablePath, "w");
  if (!fp) {
    perror("writing the test table");
    exit(2);
  }
  fputs(text, fp);
  fclose(fp);
  setenv(LAGOM_TUNER_CONFIG_ENV, gTablePath, 1);
  unsetenv(LAGOM_TUNER_CONFIG_FALLBACK_ENV);
}

/* A cost table with every entry enabled and distinct: cost(a, p) = 10 + 3a + p. */
static void fillTable(float t[NA][NP]) {
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) t[a][p] = 10.0f + 3.0f * a + p;
}

/* Number of entries that differ from fillTable's values. */
static int changedEntries(float t[NA][NP]) {
  float ref[NA][NP];
  fillTable(ref);
  int n = 0;
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) n += memcmp(&t[a][p], &ref[a][p], sizeof(float)) != 0;
  return n;
}

/* Creates a communicator context the way NCCL does: the tag is in the environment during init. */
static void *initComm(const char *tag, size_t nRanks, size_t nNodes, uint64_t commId) {
  if (tag)
    setenv(LAGOM_TUNER_COMM_TAG_ENV, tag, 1);
  else
    unsetenv(LAGOM_TUNER_COMM_TAG_ENV);
  double constants[512] = {0}; /* stands in for NCCL's tuning constants; must stay untouched */
  int nvl[3] = {1, 8, 8};
  void *ctx = (void *)0x1;
  ncclResult_t rc = gV6->init(&ctx, commId, nRanks, nNodes, mockLogger, (lagomNvlDomainInfo_t *)nvl,
                              (lagomTunerConstants_t *)constants);
  unsetenv(LAGOM_TUNER_COMM_TAG_ENV);
  for (int i = 0; i < 512; i++)
    if (constants[i] != 0.0) {
      fprintf(stderr, "  FAIL init wrote NCCL's tuning constants\n");
      gFailures++;
      break;
    }
  if (rc != ncclSuccess) {
    fprintf(stderr, "  FAIL init returned %d\n", (int)rc);
    gFailures++;
  }
  return ctx;
}

/* One getCollInfo call on a fresh full table; returns the channel count written (0 = none). */
static int collInfo(void *ctx, ncclFunc_t coll, size_t nBytes, float t[NA][NP]) {
  int nChannels = 0;
  ncclResult_t rc = gV6->getCollInfo(ctx, coll, nBytes, 1, (float **)t, NA, NP, 0, &nChannels);
  if (rc != ncclSuccess) {
    fprintf(stderr, "  FAIL getCollInfo returned %d\n", (int)rc);
    gFailures++;
  }
  return nChannels;
}

static const char *kMainTable =
    "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,"
    "regBuff,chunkSize,commTag\n"
    "allreduce,0,1048575,ring,ll,4,1,8,-1,-1,65536,dp\n"
    "allreduce,1048576,-1,ring,simple,8,1,8,-1,-1,524288,dp\n"
    "\n"
    "  allgather , 0 , -1 , nvls , simple , 2 , -1 , -1 , -1 , -1 , -1 , tp  \n"
    "reducescatter,0,-1,-1,simple,-1,-1,4,-1,-1,-1,*\n"
    "allreduce,0,-1,tree,-1,16,2,16\n";

static void test_several_comms(void) {
  writeTable(kMainTable);
  resetLog();
  void *a = initComm("dp", 8, 1, 0xa);
  void *b = initComm("tp", 4, 1, 0xb);
  void *c = initComm(NULL, 16, 2, 0xc);
  void *d = initComm("dp", 4, 1, 0xd);
  CHECK(strstr(gLog, "comm 0xa tag 'dp' nRanks 8 nNodes 1: 2 of 5 rows"), "log:\n%s", gLog);
  CHECK(strstr(gLog, "comm 0xb tag 'tp' nRanks 4 nNodes 1: 2 of 5 rows"), "log:\n%s", gLog);
  CHECK(strstr(gLog, "comm 0xc tag '' nRanks 16 nNodes 2: 1 of 5 rows"), "log:\n%s", gLog);
  float t[NA][NP];
  size_t chunk;

  /* comm a, small all-reduce: ring/LL preferred, 4 channels, 64 KiB chunks */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 4, "channels for dp small all-reduce");
  CHECK(t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] == 0.0f && changedEntries(t) == 1,
        "ring/ll = %f, %d entries changed", t[LAGOM_ALGO_RING][LAGOM_PROTO_LL], changedEntries(t));
  chunk = 12345;
  gV6->getChunkSize(a, ncclFuncAllReduce, 4096, LAGOM_ALGO_RING, LAGOM_PROTO_LL, 4, &chunk);
  CHECK(chunk == 65536, "chunk %zu", chunk);
  chunk = 12345; /* NCCL ended up with another algorithm: the row's chunk size does not apply */
  gV6->getChunkSize(a, ncclFuncAllReduce, 4096, LAGOM_ALGO_TREE, LAGOM_PROTO_LL, 4, &chunk);
  CHECK(chunk == 12345, "chunk %zu for tree must stay NCCL's", chunk);

  /* interleave another communicator before continuing with a */
  fillTable(t);
  CHECK(collInfo(b, ncclFuncAllGather, 1 << 20, t) == 2, "channels for tp all-gather");
  CHECK(t[LAGOM_ALGO_NVLS][LAGOM_PROTO_SIMPLE] == 0.0f && changedEntries(t) == 1, "nvls/simple");
  chunk = 777;
  gV6->getChunkSize(b, ncclFuncAllGather, 1 << 20, LAGOM_ALGO_NVLS, LAGOM_PROTO_SIMPLE, 2, &chunk);
  CHECK(chunk == 777, "row without chunkSize must keep NCCL's chunk, got %zu", chunk);

  /* byte range boundaries are inclusive */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 1048575, t) == 4, "last byte of the first range");
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 1048576, t) == 8, "first byte of the second range");
  CHECK(t[LAGOM_ALGO_RING][LAGOM_PROTO_SIMPLE] == 0.0f && changedEntries(t) == 1, "ring/simple");
  chunk = 1;
  gV6->getChunkSize(a, ncclFuncAllReduce, 1048576, LAGOM_ALGO_RING, LAGOM_PROTO_SIMPLE, 8, &chunk);
  CHECK(chunk == 524288, "chunk %zu", chunk);

  /* misses write nothing: a's all-gather (tp row), a's reduce-scatter (nRanks 4 row), d entirely */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllGather, 1 << 20, t) == 0 && changedEntries(t) == 0, "a allgather");
  fillTable(t);
  CHECK(collInfo(a, ncclFuncReduceScatter, 1 << 20, t) == 0 && changedEntries(t) == 0, "a rs");
  fillTable(t);
  CHECK(collInfo(d, ncclFuncAllReduce, 4096, t) == 0 && changedEntries(t) == 0, "d all-reduce");
  fillTable(t);
  CHECK(collInfo(b, ncclFuncBroadcast, 64, t) == 0 && changedEntries(t) == 0, "b broadcast");

  /* wildcard tag row, protocol only: the cheapest algorithm NCCL left enabled for Simple */
  fillTable(t);
  for (int al = 0; al < NA; al++) t[al][LAGOM_PROTO_SIMPLE] = IGN;
  t[LAGOM_ALGO_RING][LAGOM_PROTO_SIMPLE] = 50.0f;
  t[LAGOM_ALGO_NVLS][LAGOM_PROTO_SIMPLE] = 30.0f;
  t[LAGOM_ALGO_PAT][LAGOM_PROTO_SIMPLE] = 40.0f;
  CHECK(collInfo(b, ncclFuncReduceScatter, 1 << 20, t) == 0, "row has channels -1");
  CHECK(t[LAGOM_ALGO_NVLS][LAGOM_PROTO_SIMPLE] == 0.0f, "nvls/simple %f",
        t[LAGOM_ALGO_NVLS][LAGOM_PROTO_SIMPLE]);
  CHECK(t[LAGOM_ALGO_RING][LAGOM_PROTO_SIMPLE] == 50.0f && t[LAGOM_ALGO_TREE][LAGOM_PROTO_SIMPLE] == IGN,
        "other entries untouched");

  /* untagged 2-node communicator, algorithm only: the cheapest enabled Tree protocol */
  fillTable(t);
  t[LAGOM_ALGO_TREE][LAGOM_PROTO_LL] = IGN;
  CHECK(collInfo(c, ncclFuncAllReduce, 1 << 24, t) == 16, "c channels");
  CHECK(t[LAGOM_ALGO_TREE][LAGOM_PROTO_LL128] == 0.0f && t[LAGOM_ALGO_TREE][LAGOM_PROTO_LL] == IGN,
        "tree/ll128 %f", t[LAGOM_ALGO_TREE][LAGOM_PROTO_LL128]);

  CHECK(gV6->finalize(a) == ncclSuccess && gV6->finalize(b) == ncclSuccess, "finalize");
  CHECK(gV6->finalize(c) == ncclSuccess && gV6->finalize(d) == ncclSuccess, "finalize");
}

static void test_disabled_entry_kept(void) {
  writeTable(kMainTable);
  void *a = initComm("dp", 8, 1, 1);
  float t[NA][NP];
  fillTable(t);
  t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] = IGN;
  resetLog();
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 4, "channels still applied");
  CHECK(t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] == IGN, "a disabled entry must stay -1");
  t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] = 10.0f + 3.0f * LAGOM_ALGO_RING;
  CHECK(changedEntries(t) == 0, "nothing else changed");
  CHECK(strstr(gLog, "[3/64] LAGOM/tuner: line 2: ring/ll is disabled by NCCL"), "log:\n%s", gLog);
  resetLog();
  fillTable(t);
  t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] = IGN;
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 4, "second call");
  CHECK(!strstr(gLog, "disabled by NCCL"), "logged once per row, got again:\n%s", gLog);
  gV6->finalize(a);
}

static void test_bounds(void) {
  writeTable(kMainTable);
  void *a = initComm("dp", 8, 1, 1);
  float t[NA][NP];
  fillTable(t);
  int nChannels = 0;
  /* a cost table with fewer algorithms than the row's ring (index 1): nothing written into it */
  resetLog();
  gV6->getCollInfo(a, ncclFuncAllReduce, 4096, 1, (float **)t, 1, NP, 0, &nChannels);
  CHECK(changedEntries(t) == 0, "out-of-bounds row must not touch the table");
  CHECK(strstr(gLog, "line 2: ring/ll is outside NCCL's cost table"), "log:\n%s", gLog);
  CHECK(nChannels == 4, "channels %d", nChannels);
  fillTable(t);
  nChannels = 0;
  gV6->getCollInfo(a, ncclFuncAllReduce, 4096, 1, NULL, NA, NP, 0, &nChannels);
  CHECK(nChannels == 4, "a NULL table is skipped, channels still set");
  gV6->finalize(a);
}

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

static void test_malformed_tables(void) {
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

static void test_empty_table(void) {
  expectIgnored("# only comments\n\n   \n# nothing else\n", "0 of 0 rows");
}

static void test_missing_table(void) {
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

static void test_no_table_configured(void) {
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

static void test_fallback_env(void) {
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

static void test_match_fields(void) {
  writeTable("allreduce,0,-1,ring,simple,3,-1,-1,2,1\n"
             "allreduce,0,-1,tree,simple,5,-1,-1\n");
  void *a = initComm(NULL, 8, 1, 1);
  float t[NA][NP];
  int nChannels = 0;
  fillTable(t);
  gV6->getCollInfo(a, ncclFuncAllReduce, 64, 2, (float **)t, NA, NP, 1, &nChannels);
  CHECK(nChannels == 3 && t[LAGOM_ALGO_RING][LAGOM_PROTO_SIMPLE] == 0.0f, "pipeOps 2, regBuff 1");
  fillTable(t);
  nChannels = 0;
  gV6->getCollInfo(a, ncclFuncAllReduce, 64, 2, (float **)t, NA, NP, 0, &nChannels);
  CHECK(nChannels == 5 && t[LAGOM_ALGO_TREE][LAGOM_PROTO_SIMPLE] == 0.0f, "regBuff 0: 2nd row");
  fillTable(t);
  nChannels = 0;
  gV6->getCollInfo(a, ncclFuncAllReduce, 64, 1, (float **)t, NA, NP, 1, &nChannels);
  CHECK(nChannels == 5, "numPipeOps 1: 2nd row");
  gV6->finalize(a);
}

static void test_group_tag_prefix(void) {
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

static void test_bad_tag_env(void) {
  writeTable(kMainTable);
  resetLog();
  void *a = initComm("dp; rm -rf", 8, 1, 1);
  CHECK(strstr(gLog, "ignoring LAGOM_TUNER_COMM_TAG"), "log:\n%s", gLog);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0, "an invalid tag is treated as no tag");
  gV6->finalize(a);
}

static void test_null_context(void) {
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(NULL, ncclFuncAllReduce, 4096, t) == 0 && changedEntries(t) == 0, "NULL ctx");
  size_t chunk = 5;
  CHECK(gV6->getChunkSize(NULL, ncclFuncAllReduce, 1, 0, 0, 1, &chunk) == ncclSuccess && chunk == 5,
        "chunk");
  CHECK(gV6->finalize(NULL) == ncclSuccess, "finalize(NULL)");
}

static void test_older_abis(void) {
  const lagomTuner_v5_t *v5 = dlsym(gLib, "ncclTunerPlugin_v5");
  const lagomTuner_v4_t *v4 = dlsym(gLib, "ncclTunerPlugin_v4");
  const lagomTuner_v3_t *v3 = dlsym(gLib, "ncclTunerPlugin_v3");
  CHECK(v5 && v4 && v3, "v5 %p v4 %p v3 %p", (void *)v5, (void *)v4, (void *)v3);
  CHECK(!strcmp(v5->name, "lagom") && !strcmp(v4->name, "lagom") && !strcmp(v3->name, "lagom"),
        "names");
  writeTable("allgather,0,-1,ring,ll128,6,-1,4,-1,1\n");
  float t[NA][NP];
  int nChannels;
  void *ctx = NULL;

  setenv(LAGOM_TUNER_COMM_TAG_ENV, "x", 1);
  CHECK(v5->init(&ctx, 7, 4, 1, mockLogger, NULL, NULL) == ncclSuccess && ctx, "v5 init");
  fillTable(t);
  nChannels = 0;
  v5->getCollInfo(ctx, ncclFuncAllGather, 100, 1, (float **)t, NA, NP, 1, &nChannels);
  CHECK(nChannels == 6 && t[LAGOM_ALGO_RING][LAGOM_PROTO_LL128] == 0.0f, "v5");
  CHECK(v5->finalize(ctx) == ncclSuccess, "v5 finalize");

  ctx = NULL;
  CHECK(v4->init(4, 1, mockLogger, &ctx) == ncclSuccess && ctx, "v4 init");
  fillTable(t);
  nChannels = 0;
  v4->getCollInfo(ctx, ncclFuncAllGather, 100, 1, (float **)t, NA, NP, 0, &nChannels);
  CHECK(nChannels == 0 && changedEntries(t) == 0, "v4 regBuff 0 does not match a regBuff 1 row");
  v4->getCollInfo(ctx, ncclFuncAllGather, 100, 1, (float **)t, NA, NP, 1, &nChannels);
  CHECK(nChannels == 6, "v4 regBuff 1");
  CHECK(v4->destroy(ctx) == ncclSuccess, "v4 destroy");

  ctx = NULL;
  CHECK(v3->init(4, 1, mockLogger, &ctx) == ncclSuccess && ctx, "v3 init");
  fillTable(t);
  nChannels = 0;
  v3->getCollInfo(ctx, ncclFuncAllGather, 100, 1, (float **)t, NA, NP, &nChannels);
  CHECK(nChannels == 6 && t[LAGOM_ALGO_RING][LAGOM_PROTO_LL128] == 0.0f, "v3 (regBuff unknown)");
  void *ctx8 = NULL; /* a second live communicator with 8 ranks: the row is for 4 */
  CHECK(v3->init(8, 1, mockLogger, &ctx8) == ncclSuccess && ctx8, "v3 init 8 ranks");
  fillTable(t);
  nChannels = 0;
  v3->getCollInfo(ctx8, ncclFuncAllGather, 100, 1, (float **)t, NA, NP, &nChannels);
  CHECK(nChannels == 0 && changedEntries(t) == 0, "v3 8-rank comm");
  CHECK(v3->destroy(ctx) == ncclSuccess && v3->destroy(ctx8) == ncclSuccess, "v3 destroy");
  unsetenv(LAGOM_TUNER_COMM_TAG_ENV);
}

static void test_large_table(void) {
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

static int query(char **argv) {
  setenv(LAGOM_TUNER_CONFIG_ENV, argv[0], 1);
  const char *tag = argv[1];
  size_t nRanks = strtoull(argv[2], NULL, 10), nNodes = strtoull(argv[3], NULL, 10);
  int coll = -1;
  const char *names[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
  for (int i = 0; i < 5; i++)
    if (!strcmp(argv[4], names[i])) coll = i;
  if (coll < 0) {
    fprintf(stderr, "unknown collective %s\n", argv[4]);
    return 2;
  }
  size_t nBytes = strtoull(argv[5], NULL, 10);
  setenv("LAGOM_TEST_VERBOSE", "1", 1);
  void *ctx = initComm(strcmp(tag, "-") ? tag : NULL, nRanks, nNodes, 1);
  float t[NA][NP];
  fillTable(t);
  int nChannels = collInfo(ctx, (ncclFunc_t)coll, nBytes, t);
  int algo = -1, proto = -1;
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++)
      if (t[a][p] == 0.0f) algo = a, proto = p;
  size_t chunk = 0;
  if (algo >= 0) gV6->getChunkSize(ctx, (ncclFunc_t)coll, nBytes, algo, proto, nChannels, &chunk);
  printf("algo=%d proto=%d channels=%d chunk=%lld\n", algo, proto, nChannels,
         chunk ? (long long)chunk : -1LL);
  gV6->finalize(ctx);
  return gFailures ? 1 : 0;
}

static const struct {
  const char *name;
  void (*fn)(void);
} kTests[] = {
    {"several_comms", test_several_comms},
    {"disabled_entry_kept", test_disabled_entry_kept},
    {"bounds", test_bounds},
    {"malformed_tables", test_malformed_tables},
    {"empty_table", test_empty_table},
    {"missing_table", test_missing_table},
    {"no_table_configured", test_no_table_configured},
    {"fallback_env", test_fallback_env},
    {"match_fields", test_match_fields},
    {"group_tag_prefix", test_group_tag_prefix},
    {"bad_tag_env", test_bad_tag_env},
    {"null_context", test_null_context},
    {"older_abis", test_older_abis},
    {"large_table", test_large_table},
};

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s LIB.so [--list | --query TABLE TAG NRANKS NNODES COLL NBYTES | "
            "TEST...]\n", argv[0]);
    return 2;
  }
  gLib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!gLib) {
    fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  gV6 = dlsym(gLib, "ncclTunerPlugin_v6");
  if (!gV6 || !gV6->init || !gV6->getCollInfo || !gV6->finalize || !gV6->getChunkSize) {
    fprintf(stderr, "ncclTunerPlugin_v6 missing or incomplete in %s\n", argv[1]);
    return 2;
  }
  if (argc >= 3 && !strcmp(argv[2], "--query")) {
    if (argc != 9) {
      fprintf(stderr, "--query needs TABLE TAG NRANKS NNODES COLL NBYTES\n");
      return 2;
    }
    return query(argv + 3);
  }
  const char *tmp = getenv("TMPDIR");
  snprintf(gTablePath, sizeof(gTablePath), "%s/lagom_tuner_test_%d.csv", tmp ? tmp : "/tmp",
           (int)getpid());
  int nRun = 0, nFailed = 0;
  for (size_t i = 0; i < sizeof(kTests) / sizeof(kTests[0]); i++) {
    if (argc >= 3 && !strcmp(argv[2], "--list")) {
      printf("%s\n", kTests[i].name);
      continue;
    }
    int selected = argc == 2;
    for (int j = 2; j < argc; j++) selected |= !strcmp(argv[j], kTests[i].name);
    if (!selected) continue;
    int before = gFailures;
    kTests[i].fn();
    nRun++;
    int failed = gFailures != before;
    nFailed += failed;
    printf("%s %s\n", failed ? "FAIL" : "PASS", kTests[i].name);
  }
  unlink(gTablePath);
  if (argc >= 3 && !strcmp(argv[2], "--list")) return 0;
  printf("%d tests, %d failed\n", nRun, nFailed);
  dlclose(gLib);
  return nFailed || nRun == 0 ? 1 : 0;
}
