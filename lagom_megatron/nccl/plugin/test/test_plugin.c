/*
 * Test harness for lagom's NCCL tuner plugin.
 *
 * Loads the built shared library with dlopen() and drives it the way NCCL does: looks up
 * ncclTunerPlugin_v6 (and v7, v5, v4, v3), calls init once per communicator (several communicators
 * alive at once, each with its own $LAGOM_TUNER_COMM_TAG read during init), getCollInfo on a
 * [numAlgo][numProto] cost table, getChunkSize (v6), then finalize/destroy.
 *
 * Usage:
 *   test_plugin LIB.so [TEST_NAME ...]      run all tests, or the named ones
 *   test_plugin LIB.so --list               list the tests
 *   test_plugin LIB.so --query TABLE TAG NRANKS NNODES COLL NBYTES
 *       prints "algo=<i> proto=<i> channels=<n> chunk=<bytes>" for one call on a cost table
 *       where every entry is enabled (-1 = NCCL's choice kept), and the plugin's log on stderr.
 *   test_plugin LIB.so --snapshot VERSION SCENARIO
 *       plays one profiler scenario of test_observed.c on profiler ABI VERSION and prints the
 *       records it leaves (lagomProfilerSnapshot's text); with VERSION 6 or 7 also SCENARIO ce or
 *       ce_fallback (test_ce.c: a CE all-gather, or the same call on SM kernels).
 * Exit status: 0 when every selected test passed.
 *
 * This file holds main(), the list of tests, --query and the shared helpers; the tests are in
 * test_calls.c, test_table.c and test_slices.c (harness.h lists what is where).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

void *gLib;
const lagomTuner_v6_t *gV6;
char gLog[1 << 16];
static size_t gLogLen;
int gFailures;
char gTablePath[512];
const char *gLibPath;

/* Stands in for NCCL's logger: keeps every message so tests can assert on them. */
void mockLogger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
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

void resetLog(void) {
  gLogLen = 0;
  gLog[0] = '\0';
}

void writeTable(const char *text) {
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
void fillTable(float t[NA][NP]) {
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) t[a][p] = 10.0f + 3.0f * a + p;
}

/* Number of entries that differ from fillTable's values. */
int changedEntries(float t[NA][NP]) {
  float ref[NA][NP];
  fillTable(ref);
  int n = 0;
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) n += memcmp(&t[a][p], &ref[a][p], sizeof(float)) != 0;
  return n;
}

/* Creates a communicator context the way NCCL does: the tag is in the environment during init. */
void *initComm(const char *tag, size_t nRanks, size_t nNodes, uint64_t commId) {
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
int collInfo(void *ctx, ncclFunc_t coll, size_t nBytes, float t[NA][NP]) {
  int nChannels = 0;
  ncclResult_t rc = gV6->getCollInfo(ctx, coll, nBytes, 1, (float **)t, NA, NP, 0, &nChannels);
  if (rc != ncclSuccess) {
    fprintf(stderr, "  FAIL getCollInfo returned %d\n", (int)rc);
    gFailures++;
  }
  return nChannels;
}

const char *const kMainTable =
    "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,"
    "regBuff,chunkSize,commTag\n"
    "allreduce,0,1048575,ring,ll,4,1,8,-1,-1,65536,dp\n"
    "allreduce,1048576,-1,ring,simple,8,1,8,-1,-1,524288,dp\n"
    "\n"
    "  allgather , 0 , -1 , nvls , simple , 2 , -1 , -1 , -1 , -1 , -1 , tp  \n"
    "reducescatter,0,-1,-1,simple,-1,-1,4,-1,-1,-1,*\n"
    "allreduce,0,-1,tree,-1,16,2,16\n";

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
    {"explicit_no_table", test_explicit_no_table},
    {"match_fields", test_match_fields},
    {"group_tag_prefix", test_group_tag_prefix},
    {"bad_tag_env", test_bad_tag_env},
    {"null_context", test_null_context},
    {"older_abis", test_older_abis},
    {"tuner_v7", test_tuner_v7},
    {"large_table", test_large_table},
    {"chunk_by_slice", test_chunk_by_slice},
    {"middle_slices", test_middle_slices_cover_every_middle_channel},
    {"status_exports", test_status_exports},
    {"profiler_match_plan", test_profiler_match_plan},
    {"profiler_clamped_channels", test_profiler_clamped_channels},
    {"profiler_small_call", test_profiler_small_call},
    {"profiler_proxy_before_host_stop", test_profiler_proxy_before_host_stop},
    {"profiler_other_algorithm", test_profiler_other_algorithm},
    {"profiler_p2p", test_profiler_p2p},
    {"profiler_missing_comm_name", test_profiler_missing_comm_name},
    {"profiler_comm_name_keys_rows", test_profiler_comm_name_keys_rows},
    {"next_comm_set_in_process", test_next_comm_set_in_process},
    {"profiler_activation_mask", test_profiler_activation_mask},
    {"profiler_bounded", test_profiler_bounded},
    {"profiler_self_p2p_releases_its_slot", test_profiler_self_p2p_releases_its_slot},
    {"profiler_user_plugin", test_profiler_user_plugin},
    {"profiler_v7_fields", test_profiler_v7_fields},
    {"profiler_ce_allgather", test_profiler_ce_allgather},
};

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s LIB.so [--list | --query TABLE TAG NRANKS NNODES COLL NBYTES | "
            "TEST...]\n", argv[0]);
    return 2;
  }
  gLibPath = argv[1];
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
  if (argc == 3 && !strcmp(argv[2], "--foreign-child")) {
    int rc = profilerChildMain();
    unlink(gTablePath);
    return rc;
  }
  if (argc >= 3 && !strcmp(argv[2], "--snapshot")) {
    int v = argc == 5 ? atoi(argv[3]) : 0, known = 0;
    if (argc == 5 && (v == 6 || v == 7) && (!strcmp(argv[4], "ce") || !strcmp(argv[4], "ce_fallback"))) {
      int rc = printCeSnapshot(v, argv[4]); /* test_ce.c: copy engines need ABI v6+ */
      unlink(gTablePath);
      return rc;
    }
    for (int i = 0; argc == 5 && i < 6; i++) known |= !strcmp(argv[4], kScenarios[i]);
    if (v < 1 || v > 7 || !known) {
      fprintf(stderr, "--snapshot needs a profiler ABI version 1-7 and one of match, clamped, other_algo, p2p, "
              "no_name, small (6-7: also ce, ce_fallback)\n");
      return 2;
    }
    int rc = printSnapshot(v, argv[4]);
    unlink(gTablePath);
    return rc;
  }
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
