/*
 * Tuner plugin harness, the cases about chunk size by slice and the status exports.
 *
 * NCCL >= 2.30 asks getCollInfo once per collective (or per aggregated group of same-function
 * collectives) with the collective's bytes, and later asks getChunkSize once per channel slice
 * with the slice's bytes and nChannels = 1: first the lowest channel's share (countLo), then the
 * highest (countHi), then once for all middle channels (countMid); CollNet asks once with the
 * whole collective and its channel count (NCCL v2.30.7 src/enqueue.cc:430-441, :2147, :634,
 * :725-737, :2308-2318). sliceCalls() below makes the calls in that order.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* getChunkSize for the lo, hi and mid slices of a collective of `nBytes` spread evenly over
 * `nChannels` >= 3 channels (as NCCL calls it); returns 1 when every slice got `want`. */
static int sliceCalls(void *ctx, ncclFunc_t coll, size_t nBytes, int nChannels, int algo, int proto,
                      size_t nccl, size_t want) {
  size_t share = nBytes / (size_t)nChannels;
  size_t slices[3] = {share, nBytes - share * (size_t)(nChannels - 1), share}; /* lo, hi, mid */
  int ok = 1;
  for (int i = 0; i < 3; i++) {
    size_t chunk = nccl;
    gV6->getChunkSize(ctx, coll, slices[i], algo, proto, 1, &chunk);
    if (chunk != want) {
      fprintf(stderr, "    slice %d (%zu bytes): chunk %zu, want %zu\n", i, slices[i], chunk, want);
      ok = 0;
    }
  }
  return ok;
}

static const char *const kSliceTable =
    "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,"
    "regBuff,chunkSize,commTag\n"
    "allreduce,8388608,8388608,ring,simple,8,-1,8,-1,-1,131072,dp\n"
    "allreduce,4194304,4194304,ring,simple,8,-1,8,-1,-1,65536,dp\n"
    "reducescatter,33554432,33554432,-1,simple,8,-1,8,-1,-1,262144,dp\n";

void test_chunk_by_slice(void) {
  writeTable(kSliceTable);
  void *a = initComm("dp", 8, 1, 0x51);
  float t[NA][NP];
  const int R = LAGOM_ALGO_RING, S = LAGOM_PROTO_SIMPLE;

  /* one collective per group: its slices (1 MiB each) get the row's chunk */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 8388608, t) == 8, "8 MiB all-reduce row");
  CHECK(sliceCalls(a, ncclFuncAllReduce, 8388608, 8, R, S, 2097152, 131072), "8 MiB slices");

  /* the next group is another collective: its own row, not the previous one */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4194304, t) == 8, "4 MiB all-reduce row");
  CHECK(sliceCalls(a, ncclFuncAllReduce, 4194304, 8, R, S, 2097152, 65536), "4 MiB slices");

  /* a collective without a row whose slice has a row's byte count: NCCL's chunk stays */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 67108864, t) == 0, "64 MiB all-reduce has no row");
  CHECK(sliceCalls(a, ncclFuncAllReduce, 67108864, 8, R, S, 2097152, 2097152),
        "slices of an unplanned collective keep NCCL's chunk (8 MiB slice = a row's bytes)");

  /* two collectives in one group (prepare both, then schedule both) */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 8388608, t) == 8, "group: all-reduce");
  fillTable(t);
  CHECK(collInfo(a, ncclFuncReduceScatter, 33554432, t) == 8, "group: reduce-scatter");
  CHECK(sliceCalls(a, ncclFuncAllReduce, 8388608, 8, R, S, 2097152, 131072), "group AR slices");
  CHECK(sliceCalls(a, ncclFuncReduceScatter, 33554432, 8, LAGOM_ALGO_PAT, S, 2097152, 262144),
        "group RS slices (row leaves the algorithm to NCCL)");

  /* NCCL ended with another algorithm than the row's: its chunk stays */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 8388608, t) == 8, "all-reduce again");
  CHECK(sliceCalls(a, ncclFuncAllReduce, 8388608, 8, LAGOM_ALGO_TREE, S, 524288, 524288),
        "tree keeps NCCL's chunk");

  /* CollNet: one call with the whole collective and its channels */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4194304, t) == 8, "collnet all-reduce");
  size_t chunk = 262144;
  gV6->getChunkSize(a, ncclFuncAllReduce, 4194304, R, S, 8, &chunk);
  CHECK(chunk == 65536, "whole-collective call %zu", chunk);

  /* a slice with no collective asked about before it: NCCL's chunk */
  chunk = 4096;
  gV6->getChunkSize(a, ncclFuncAllReduce, 1048576, R, S, 1, &chunk);
  CHECK(chunk == 4096, "unasked slice %zu", chunk);
  gV6->finalize(a);
}

/* Two all-reduces of one NCCL group that NCCL does not aggregate (16 MiB is not below 4 x 4 MiB,
 * src/enqueue.cc:430), each with its own row: 4 MiB on 8 channels, 16 MiB on 32. NCCL asks
 * getCollInfo for both (smallest first), then slices them in that order: the 4 MiB one as lo,
 * hi and one middle share of 512 KiB standing for its 6 middle channels, then the 16 MiB one the
 * same way (30 middle channels). Charging the middle share once would leave 3 MiB on the first
 * call, and the second call's 512 KiB slices would take its chunk (enqueue.cc:725-737). */
void test_middle_slices_cover_every_middle_channel(void) {
  writeTable("allreduce,4194304,4194304,ring,simple,8,-1,8,-1,-1,65536,dp\n"
             "allreduce,16777216,16777216,ring,simple,32,-1,8,-1,-1,131072,dp\n");
  void *a = initComm("dp", 8, 1, 0x71);
  float t[NA][NP];
  const int R = LAGOM_ALGO_RING, S = LAGOM_PROTO_SIMPLE;
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4194304, t) == 8, "4 MiB row");
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 16777216, t) == 32, "16 MiB row");
  size_t want[6] = {65536, 65536, 65536, 131072, 131072, 131072};
  for (int i = 0; i < 6; i++) { /* lo, hi, mid of each, 512 KiB per channel */
    size_t chunk = 2097152;
    gV6->getChunkSize(a, ncclFuncAllReduce, 524288, R, S, 1, &chunk);
    CHECK(chunk == want[i], "slice %d: chunk %zu, want %zu", i, chunk, want[i]);
  }
  /* a collective on two channels: lo and hi only, no middle share */
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 4194304, t) == 8, "4 MiB again (a new group)");
  fillTable(t);
  CHECK(collInfo(a, ncclFuncAllReduce, 16777216, t) == 32, "16 MiB again");
  size_t two[2] = {2097152, 2097152}; /* the 4 MiB call on 2 channels */
  for (int i = 0; i < 2; i++) {
    size_t chunk = 1;
    gV6->getChunkSize(a, ncclFuncAllReduce, two[i], R, S, 1, &chunk);
    CHECK(chunk == 65536, "two-channel slice %d: %zu", i, chunk);
  }
  size_t chunk = 1;
  gV6->getChunkSize(a, ncclFuncAllReduce, 524288, R, S, 1, &chunk);
  CHECK(chunk == 131072, "next call's first slice: %zu", chunk);
  gV6->finalize(a);
}

void test_status_exports(void) {
  int (*abi)(void) = (int (*)(void))dlsym(gLib, "lagomTunerAbiVersion");
  int (*inits)(void) = (int (*)(void))dlsym(gLib, "lagomTunerInitCount");
  int (*fails)(void) = (int (*)(void))dlsym(gLib, "lagomTunerTableFailures");
  int (*hits)(unsigned long long *, int) =
      (int (*)(unsigned long long *, int))dlsym(gLib, "lagomTunerRowHits");
  CHECK(abi && inits && fails && hits, "status exports missing");
  /* a table of its own: fresh counters (another file identity than earlier tests' tables) */
  writeTable("# comment and blank lines are not rows\n\n"
             "allreduce,100,100,ring,simple,2,-1,-1,-1,-1,-1,dp\n"
             "allgather,100,100,ring,simple,3,-1,-1,-1,-1,-1,dp\n"
             "allreduce,200,200,tree,simple,4,-1,-1,-1,-1,-1,*\n");
  int before = inits();
  void *a = initComm("dp", 8, 1, 0x61);
  void *b = initComm("tp", 8, 1, 0x62);
  CHECK(inits() == before + 2 && abi() == 6, "inits %d (before %d), abi %d", inits(), before, abi());
  float t[NA][NP];
  for (int i = 0; i < 3; i++) {
    fillTable(t);
    collInfo(a, ncclFuncAllReduce, 100, t);
  }
  fillTable(t);
  collInfo(b, ncclFuncAllReduce, 100, t); /* tp: the dp row does not apply, no count */
  fillTable(t);
  collInfo(a, ncclFuncAllReduce, 200, t);
  fillTable(t);
  collInfo(b, ncclFuncAllReduce, 200, t);
  unsigned long long out[4] = {9, 9, 9, 9};
  CHECK(hits(out, 4) == 3, "row count %d", hits(out, 4));
  CHECK(out[0] == 3 && out[1] == 0 && out[2] == 2 && out[3] == 9, "hits %llu %llu %llu %llu",
        out[0], out[1], out[2], out[3]);
  CHECK(hits(out, 1) == 3 && out[0] == 3 && out[1] == 0, "capacity 1 copies one row");
  CHECK(hits(NULL, 0) == 3, "row count without a buffer");

  /* an unreadable table is counted, and the last good table stays reported */
  int failsBefore = fails();
  setenv(LAGOM_TUNER_CONFIG_ENV, "/nonexistent/lagom/plan.csv", 1);
  void *c = initComm("dp", 8, 1, 0x63);
  CHECK(fails() == failsBefore + 1, "failures %d", fails());
  CHECK(hits(out, 4) == 3, "still the last loaded table");

  /* v5 init reports ABI 5 */
  const lagomTuner_v5_t *v5 = dlsym(gLib, "ncclTunerPlugin_v5");
  void *d = NULL;
  v5->init(&d, 1, 8, 1, mockLogger, NULL, NULL);
  CHECK(abi() == 5, "abi %d after a v5 init", abi());
  v5->finalize(d);
  gV6->finalize(a);
  gV6->finalize(b);
  gV6->finalize(c);
}
