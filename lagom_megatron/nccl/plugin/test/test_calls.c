/*
 * Tuner plugin harness, the cases about NCCL's calls: several live communicators, cost-table
 * edits (preferences, disabled entries, bounds), the numPipeOps/regBuff match, chunk sizes, a
 * NULL context, and the older ABI structs v5/v4/v3. Helpers and main() are in test_plugin.c.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

void test_several_comms(void) {
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

/* NCCL disabled the row's algorithm/protocol (-1 in the cost table): the row applies nothing. NCCL's
 * topoGetAlgoInfo then picks its own algorithm and protocol and its own nc, and a non-zero plugin
 * *nChannels would replace that nc (src/enqueue.cc:2178): the row's channels, chosen for ring/ll,
 * would run NCCL's choice. *nChannels stays 0, the slices keep NCCL's chunk, no hit is counted. */
void test_disabled_entry_kept(void) {
  writeTable(kMainTable);
  void *a = initComm("dp", 8, 1, 1);
  float t[NA][NP];
  fillTable(t);
  t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] = IGN;
  resetLog();
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0, "channels of a rejected row applied");
  CHECK(t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] == IGN, "a disabled entry must stay -1");
  t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] = 10.0f + 3.0f * LAGOM_ALGO_RING;
  CHECK(changedEntries(t) == 0, "nothing else changed");
  CHECK(strstr(gLog, "[3/64] LAGOM/tuner: line 2: ring/ll is disabled by NCCL"), "log:\n%s", gLog);
  /* NCCL runs its cheapest enabled entry; its slices keep NCCL's chunk, not the row's 65536 */
  size_t chunk = 16384;
  gV6->getChunkSize(a, ncclFuncAllReduce, 512, LAGOM_ALGO_TREE, LAGOM_PROTO_LL, 1, &chunk);
  CHECK(chunk == 16384, "rejected row's chunk applied: %zu", chunk);
  resetLog();
  fillTable(t);
  t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] = IGN;
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 0, "second call");
  CHECK(!strstr(gLog, "disabled by NCCL"), "logged once per row, got again:\n%s", gLog);
  /* the same row where NCCL enabled ring/ll: applied, channels and all */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4096, t) == 4, "an enabled row's channels");
  CHECK(t[LAGOM_ALGO_RING][LAGOM_PROTO_LL] == 0.0f, "preferred");
  gV6->finalize(a);
}

void test_bounds(void) {
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
  CHECK(nChannels == 0, "channels of a row that could not be applied: %d", nChannels);
  fillTable(t);
  nChannels = 0;
  gV6->getCollInfo(a, ncclFuncAllReduce, 4096, 1, NULL, NA, NP, 0, &nChannels);
  CHECK(nChannels == 0, "a NULL table cannot prefer ring/ll: no channels either (%d)", nChannels);
  /* a row that sets channels only needs no cost table */
  writeTable("allreduce,0,-1,-1,-1,6,-1,-1,-1,-1,-1,dp\n");
  void *b = initComm("dp", 8, 1, 2);
  nChannels = 0;
  gV6->getCollInfo(b, ncclFuncAllReduce, 4096, 1, NULL, NA, NP, 0, &nChannels);
  CHECK(nChannels == 6, "channels-only row with a NULL table: %d", nChannels);
  gV6->finalize(b);
  gV6->finalize(a);
}

void test_match_fields(void) {
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

void test_null_context(void) {
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(NULL, ncclFuncAllReduce, 4096, t) == 0 && changedEntries(t) == 0, "NULL ctx");
  size_t chunk = 5;
  CHECK(gV6->getChunkSize(NULL, ncclFuncAllReduce, 1, 0, 0, 1, &chunk) == ncclSuccess && chunk == 5,
        "chunk");
  CHECK(gV6->finalize(NULL) == ncclSuccess, "finalize(NULL)");
}

void test_older_abis(void) {
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

/* ABI v7, the struct NCCL 2.32 looks up first (src/plugin/tuner.cc:76-91 @2449986f), in NCCL's
 * order for one communicator: init with v7's constants (tuner_v7.h:19-29: latencies [7][3] and
 * [3][7][3], then five [5 compute capabilities][3 scales] bandwidth tables, 159 doubles), then
 * getCollInfo, getChunkSize on the call's slices (1 channel each), finalize. It behaves as v6, and
 * the status reports ABI 7. */
void test_tuner_v7(void) {
  const lagomTuner_v7_t *v7 = dlsym(gLib, "ncclTunerPlugin_v7");
  CHECK(v7 && !strcmp(v7->name, "lagom") && v7->init && v7->getCollInfo && v7->finalize && v7->getChunkSize,
        "ncclTunerPlugin_v7 missing or incomplete");
  int (*abi)(void) = (int (*)(void))dlsym(gLib, "lagomTunerAbiVersion");
  writeTable("allreduce,4194304,4194304,ring,simple,4,-1,8,-1,-1,131072,dp\n");
  enum { kConstants = 7 * 3 + 3 * 7 * 3 + 5 * 5 * 3 };
  double constants[kConstants];
  for (int i = 0; i < kConstants; i++) constants[i] = 1.5 * i;
  int nvl[3] = {1, 8, 8};
  void *ctx = NULL;
  setenv(LAGOM_TUNER_COMM_TAG_ENV, "dp", 1);
  CHECK(v7->init(&ctx, 0x77, 8, 1, mockLogger, (lagomNvlDomainInfo_t *)nvl, (lagomTunerConstants_t *)constants) ==
            ncclSuccess && ctx, "v7 init");
  unsetenv(LAGOM_TUNER_COMM_TAG_ENV);
  for (int i = 0; i < kConstants; i++) CHECK(constants[i] == 1.5 * i, "constant %d changed to %f", i, constants[i]);
  CHECK(abi() == 7, "abi %d after a v7 init", abi());
  float t[NA][NP];
  fillTable(t);
  int nChannels = 0;
  CHECK(v7->getCollInfo(ctx, ncclFuncAllReduce, 4194304, 1, (float **)t, NA, NP, 0, &nChannels) == ncclSuccess,
        "getCollInfo");
  CHECK(nChannels == 4 && t[LAGOM_ALGO_RING][LAGOM_PROTO_SIMPLE] == 0.0f && changedEntries(t) == 1,
        "channels %d, ring/simple %f, %d entries changed", nChannels, t[LAGOM_ALGO_RING][LAGOM_PROTO_SIMPLE],
        changedEntries(t));
  for (int c = 0; c < 3; c++) { /* 4 channels of 1 MiB: lo, hi, then the middle share once for both */
    size_t chunk = 262144;
    v7->getChunkSize(ctx, ncclFuncAllReduce, 1048576, LAGOM_ALGO_RING, LAGOM_PROTO_SIMPLE, 1, &chunk);
    CHECK(chunk == 131072, "slice %d: chunk %zu", c, chunk);
  }
  CHECK(v7->finalize(ctx) == ncclSuccess, "v7 finalize");
}
