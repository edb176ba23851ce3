/*
 * Harness cases of the profiler half: what it records for each profiler ABI version (v1-v7),
 * driven in NCCL's order by test_profiler.c, and the tuner half keyed by the profiler's commName.
 *
 * Every scenario plays one communicator "dp" of 8 ranks whose plan table row asks for ring /
 * simple on 8 channels; NCCL then reports what it ran: the plan (match), fewer channels
 * (clamped), another algorithm and protocol (other_algo), a P2P send (p2p), the plan on a
 * communicator created without a name (no_name), or a 64 KiB all-reduce that NCCL's traffic
 * cells split over fewer channels than the tuner gave (small). `--snapshot V SCENARIO` prints the records one
 * scenario leaves (tests/nccl/test_observed.py compares them with a plan in Python).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static const char *const kPlanRow = "allreduce,0,-1,ring,simple,8,-1,8,-1,-1,262144,dp\n";
const char *const kScenarios[] = {"match", "clamped", "other_algo", "p2p", "no_name", "small"};

static void *gProf; /* the scenario's profiler context, finalized by endScenario */

/* The channels NCCL runs a lone 64 KiB ring / simple all-reduce on (8 ranks) when the tuner gave it
 * 8: ABI v1-v3 report nMaxChannels, the tuner's 8 (v2.26.6 src/plugin/profiler.cc:251, src/enqueue.cc
 * :1826); NCCL 2.27-2.28 (v4, v5) cut its 128 KiB of traffic into 16 KiB cells, 8 of them, one
 * channel each (v2.28.9 src/enqueue.cc:529-638); 2.29-2.31 (v6, v7) into 32 KiB cells, so 4
 * channels (v2.30.7 src/enqueue.cc:585, :659-704; 2.31.2 src/enqueue/enqueue.cc
 * scheduleCollTasksToPlan @8898068, the same rule). */
static int smallChannels(int v) { return v >= 6 ? 4 : 8; }

/* The proxy's chunk of the plan's 256 KiB ring / simple chunk: NCCL 2.23 (ABI v1) reports the chunk
 * (v2.23.4 src/misc/profiler.cc:361), 2.24+ chunk x sliceSteps, 2 here (v2.24.3 :475). */
static int chunkOf(int v) { return v == 1 ? 262144 : 2 * 262144; }

/* Plays `scenario` on ABI `v`; returns 1 when the tuner half matched the plan row. */
int playScenario(int v, const char *scenario) {
  writeTable(kPlanRow);
  resetRecords();
  setActive(2); /* the scenarios read kernel times too */
  uint64_t hash = 0x5eed00 + (uint64_t)v;
  int named = strcmp(scenario, "no_name") != 0;
  void *prof = gProf = profInit(v, hash, named ? "dp" : NULL, "dp");
  void *tuner = initComm("dp", 8, 1, hash);
  float t[NA][NP];
  fillTable(t);
  int hit = collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 8;
  if (!strcmp(scenario, "p2p"))
    driveP2p(v, prof, hash, "Send", 65536, 2);
  else if (!strcmp(scenario, "clamped"))
    driveColl(v, prof, hash, "AllReduce", 1 << 20, "RING", "SIMPLE", 4, chunkOf(v));
  else if (!strcmp(scenario, "small")) /* 16384 floats: the channels NCCL's split gives (smallChannels) */
    driveColl(v, prof, hash, "AllReduce", 16384, "RING", "SIMPLE", smallChannels(v), 0);
  else if (!strcmp(scenario, "other_algo"))
    driveColl(v, prof, hash, "AllReduce", 1 << 20, "TREE", "LL", 8, 0);
  else
    driveColl(v, prof, hash, "AllReduce", 1 << 20, "RING", "SIMPLE", 8, chunkOf(v));
  gV6->finalize(tuner);
  return hit;
}

/* After the snapshot was read: NCCL finalizes the communicator (its records go with it). */
static void endScenario(int v) {
  profFinalize(v, gProf);
  gProf = NULL;
  setActive(0);
}

int printSnapshot(int v, const char *scenario) {
  playScenario(v, scenario);
  fputs(snapshot(), stdout);
  endScenario(v);
  return 0;
}

/* Kernel span of driveColl's channels: the last stop (5000 + 5 (n - 1)) minus the first start (1000). */
static const char *kernelOf(int v, int nChannels) {
  static char buf[64];
  if (v < 4) return "kernel_ns=0 kernel_calls=0"; /* no GPU timers before ABI v4 */
  snprintf(buf, sizeof(buf), "kernel_ns=%d kernel_calls=1", 5000 + 5 * (nChannels - 1) - 1000);
  return buf;
}

static void checkScenario(const char *scenario, const char *line, int nChannels) {
  for (int v = 1; v <= 7; v++) {
    int hit = playScenario(v, scenario);
    const char *snap = snapshot();
    char want[512];
    CHECK(hit, "v%d: the tuner half did not match the plan row", v);
    CHECK(hasLine(snap, "comm", "tag=dp"), "v%d: no communicator tagged dp in\n%s", v, snap);
    snprintf(want, sizeof(want), "%s %s", line, kernelOf(v, nChannels));
    CHECK(hasLine(snap, strstr(line, "algo=-") ? "p2p" : "coll", want), "v%d: want '%s' in\n%s", v, want, snap);
    snprintf(want, sizeof(want), "%s chunk=%d", line, chunkOf(v));
    CHECK(strstr(line, "chunk=") || hasLine(snap, "coll", want), "v%d: want '%s' in\n%s", v, want, snap);
    if (v >= 4) {
      CHECK(hasLine(snap, "comm", "rank=3 nranks=8 nnodes=1"), "v%d: init's rank and sizes:\n%s", v, snap);
      CHECK(hasLine(snap, "comm", strcmp(scenario, "no_name") ? "name=dp" : "name=-"), "v%d: name\n%s", v, snap);
    } else {
      CHECK(hasLine(snap, "comm", "rank=-1 name=-"), "v%d: v1-v3 init has no rank nor name\n%s", v, snap);
    }
    char hash[64];
    snprintf(hash, sizeof(hash), "hash=%llx abi=%d", 0x5eed00ULL + (unsigned long long)v, v);
    CHECK(hasLine(snap, "comm", hash), "v%d: '%s' (v1-v3: from the task descriptor) in\n%s", v, hash, snap);
    endScenario(v);
    CHECK(!strstr(snapshot(), "comm "), "v%d: records left after finalize", v);
  }
}

void test_profiler_match_plan(void) {
  checkScenario("match", "func=AllReduce count=1048576 dtype=ncclFloat32 algo=RING proto=SIMPLE channels=8 "
                "warps=16 calls=1", 8);
}

void test_profiler_clamped_channels(void) {
  checkScenario("clamped", "func=AllReduce algo=RING proto=SIMPLE channels=4 calls=1", 4);
}

void test_profiler_small_call(void) {
  for (int v = 1; v <= 7; v++) {
    playScenario(v, "small");
    const char *snap = snapshot();
    char want[256];
    snprintf(want, sizeof(want), "func=AllReduce count=16384 algo=RING proto=SIMPLE channels=%d calls=1 %s",
             smallChannels(v), kernelOf(v, smallChannels(v)));
    CHECK(hasLine(snap, "coll", want), "v%d: want '%s' in\n%s", v, want, snap);
    endScenario(v);
  }
}

/* The proxy thread's events before the host's stops (NCCL starts the proxy first, src/enqueue.cc
 * :1441 vs :1443): the same records, kernel time included. */
void test_profiler_proxy_before_host_stop(void) {
  gProxyFirst = 1;
  checkScenario("match", "func=AllReduce count=1048576 dtype=ncclFloat32 algo=RING proto=SIMPLE channels=8 "
                "warps=16 calls=1", 8);
  for (int v = 4; v <= 7; v++) {
    playScenario(v, "p2p");
    const char *snap = snapshot();
    CHECK(hasLine(snap, "p2p", "channels=2 calls=1 kernel_ns=4005 kernel_calls=1"), "v%d: p2p\n%s", v, snap);
    CHECK(hasLine(snap, "comm", "dropped=0"), "v%d: the slot was released\n%s", v, snap);
    endScenario(v);
  }
  gProxyFirst = 0;
}

void test_profiler_other_algorithm(void) {
  checkScenario("other_algo", "func=AllReduce algo=TREE proto=LL channels=8 calls=1 chunk=0", 8);
}

void test_profiler_p2p(void) {
  for (int v = 1; v <= 7; v++) {
    playScenario(v, "p2p");
    const char *snap = snapshot();
    /* P2P channels are in the descriptor from v4 (p2p.nChannels); v1-v3 have none */
    CHECK(hasLine(snap, "p2p", v >= 4 ? "func=Send count=65536 dtype=ncclBfloat16 algo=- proto=- channels=2 calls=1"
                                      : "func=Send count=65536 dtype=ncclBfloat16 channels=0 calls=1"),
          "v%d: p2p line in\n%s", v, snap);
    if (v >= 4) CHECK(hasLine(snap, "p2p", "kernel_ns=4005 kernel_calls=1"), "v%d: p2p kernel time\n%s", v, snap);
    CHECK(!strstr(snap, "\ncoll "), "v%d: a p2p is not a collective\n%s", v, snap);
    endScenario(v);
  }
}

/* ABI v7 (NCCL 2.31.2): NCCL reports a collective it ran on a symmetric kernel with isSymColl set,
 * its kernel variant, the part of that name after '_' as algo and "" as proto, and the kernelCh
 * count on the task (src/plugin/profiler.cc ncclProfilerStartTaskEvents @8898068); lagom records
 * the variant as the algorithm and no protocol. Two calls of one shape with different userTags
 * fill one bucket; the kernel phases the driven channels send under their kernelCh get no handle
 * and leave the kernel time as the kernelCh events give it. */
void test_profiler_v7_fields(void) {
  resetRecords();
  setActive(2);
  void *prof = profInit(7, 0x5e7, "dp", "dp");
  const lagomProfiler_v7_t *p7 = profilerStruct(7);
  for (uint64_t tag = 1; tag <= 2; tag++) {
    lagomProfilerDescr_v7_t d = {.type = LAGOM_PROFILE_COLL, .rank = 3};
    d.coll.func = "AllGather", d.coll.count = 4096, d.coll.datatype = "ncclInt8", d.coll.nChannels = 2;
    d.coll.nWarps = 16, d.coll.kernelVariant = "AGxLL_R", d.coll.algo = "LL_R", d.coll.proto = "";
    d.coll.isSymColl = true, d.coll.userTag = tag;
    void *h = NULL;
    p7->startEvent(prof, &h, &d);
    CHECK(h != NULL, "the symmetric collective gets a task handle");
    p7->stopEvent(h);
  }
  const char *snap = snapshot();
  CHECK(hasLine(snap, "coll", "func=AllGather count=4096 dtype=ncclInt8 algo=AGxLL_R proto=- channels=2 calls=2"),
        "symmetric kernel record:\n%s", snap);
  resetRecords();
  gPhaseHandles = 0;
  driveColl(7, prof, 0x5e7, "AllReduce", 1 << 20, "RING", "SIMPLE", 8, 0);
  snap = snapshot();
  CHECK(gPhaseHandles == 0, "%d kernel-phase events got a handle", gPhaseHandles);
  CHECK(hasLine(snap, "coll", "algo=RING proto=SIMPLE channels=8 calls=1 kernel_ns=4035 kernel_calls=1"),
        "kernel time from the kernelCh events only:\n%s", snap);
  resetRecords();
  profFinalize(7, prof);
  setActive(0);
}

void test_profiler_missing_comm_name(void) {
  checkScenario("no_name", "func=AllReduce algo=RING proto=SIMPLE channels=8 calls=1", 8);
}

/* ABI v5+: the tuner's init gets the commId the profiler's init got with the communicator's name.
 * lagom's tag ($LAGOM_TUNER_COMM_TAG, set around a pool entry's creation, so both inits see it) keys
 * the rows, also when NCCL's name differs: torch's nccl2 engine names every communicator after its
 * process group's group_name ("17"). Without the tag the name keys them; a name that is no valid tag
 * leaves only the rows tagged '*'. */
void test_profiler_comm_name_keys_rows(void) {
  writeTable(kPlanRow);
  for (int v = 5; v <= 7; v++) {
    float t[NA][NP];
    void *prof = profInit(v, 0xa11ce, "17", "dp");
    resetLog();
    void *tuner = initComm("dp", 8, 1, 0xa11ce);
    fillTable(t);
    CHECK(collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 8, "v%d: rows keyed by the tag dp:\n%s", v, gLog);
    CHECK(strstr(gLog, "tag 'dp'"), "v%d: the tuner logs lagom's tag, not nccl2's name:\n%s", v, gLog);
    gV6->finalize(tuner);
    profFinalize(v, prof);
    prof = profInit(v, 0xa11cf, "dp", NULL);
    resetLog();
    tuner = initComm(NULL, 8, 1, 0xa11cf);
    fillTable(t);
    CHECK(collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 8, "v%d: no tag: rows keyed by the name dp:\n%s", v,
          gLog);
    gV6->finalize(tuner);
    profFinalize(v, prof);
    prof = profInit(v, 0xa11d0, "dp,tp", NULL);
    resetLog();
    tuner = initComm(NULL, 8, 1, 0xa11d0);
    fillTable(t);
    CHECK(collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 0, "v%d: a name that is no tag keys nothing:\n%s", v,
          gLog);
    CHECK(strstr(gLog, "is not a valid tag"), "v%d: says why the name was not used:\n%s", v, gLog);
    gV6->finalize(tuner);
    profFinalize(v, prof);
  }
}

/* lagomSetNextComm names the next communicators without setenv (which races with getenv in torch's and
 * NCCL's threads): both halves take its tag, the tuner its table, over the environment's; cleared, the
 * environment applies again. */
void test_next_comm_set_in_process(void) {
  int (*setNext)(const char *, const char *) = (int (*)(const char *, const char *))dlsym(gLib, "lagomSetNextComm");
  CHECK(setNext != NULL, "lagomSetNextComm is exported");
  if (!setNext) return;
  writeTable(kPlanRow);
  unsetenv(LAGOM_TUNER_CONFIG_ENV); /* only the in-process table names the file */
  CHECK(setNext("dp", gTablePath) == 0, "set");
  resetRecords();
  setActive(1);
  void *prof = profInit(6, 0xa11d1, "17", NULL);
  resetLog();
  void *tuner = initComm(NULL, 8, 1, 0xa11d1);
  float t[NA][NP];
  fillTable(t);
  CHECK(collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 8, "rows of the in-process table, keyed dp:\n%s", gLog);
  CHECK(strstr(gLog, "tag 'dp'"), "the tuner's tag is the in-process one:\n%s", gLog);
  CHECK(hasLine(snapshot(), "comm", "tag=dp name=17"), "the profiler half's record:\n%s", snapshot());
  gV6->finalize(tuner);
  profFinalize(6, prof);
  char tooLong[LAGOM_TABLE_PATH_MAX + 1];
  memset(tooLong, 'x', sizeof(tooLong) - 1);
  tooLong[sizeof(tooLong) - 1] = 0;
  CHECK(setNext("dp", tooLong) == -1, "a path that does not fit is refused");
  CHECK(setNext(NULL, NULL) == 0, "cleared");
  resetLog();
  tuner = initComm(NULL, 8, 1, 0xa11d2);
  fillTable(t);
  CHECK(collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 0, "cleared: the environment (no table) applies:\n%s", gLog);
  gV6->finalize(tuner);
  resetRecords();
  setActive(0);
}

/* The activation mask: 0 while lagom reads no records; level 1 (what ran) without KernelCh, so NCCL
 * adds no profiler proxy op and opens no profiler proxy connection (ncclProfilerNeedsProxy tests
 * that bit, src/plugin/profiler.cc:771-775); level 2 adds KernelCh from ABI v4 (v3's kernelCh has no
 * timer). lagomProfilerEventMask says what NCCL was handed. */
void test_profiler_activation_mask(void) {
  int (*handed)(void) = (int (*)(void))dlsym(gLib, "lagomProfilerEventMask");
  for (int v = 1; v <= 7; v++) {
    gNcclMask = -1;
    setActive(0);
    void *prof = profInit(v, 0x77, NULL, NULL);
    CHECK(gNcclMask == 0, "v%d: mask %d after init while inactive; want 0 (no event at all)", v, gNcclMask);
    /* from v6 also the copy-engine collective and its batches (test_ce.c) */
    int calls = LAGOM_PROFILE_COLL | LAGOM_PROFILE_P2P | LAGOM_PROFILE_PROXY_OP |
                (v >= 6 ? LAGOM_PROFILE_CE_COLL | LAGOM_PROFILE_CE_BATCH : 0);
    setActive(1);
    CHECK(gNcclMask == calls && handed() == calls, "v%d: level 1 mask %d (said %d); want %d", v, gNcclMask, handed(),
          calls);
    setActive(2);
    /* never v7's kernel phases (LAGOM_PROFILE_KERNEL_PHASE): the kernelCh span is the kernel time */
    int want = calls | (v >= 4 ? LAGOM_PROFILE_KERNEL_CH : 0);
    CHECK(gNcclMask == want && handed() == want, "v%d: level 2 mask %d; want %d", v, gNcclMask, want);
    setActive(0);
    CHECK(gNcclMask == 0 && handed() == 0, "v%d: mask %d after deactivation", v, gNcclMask);
    profFinalize(v, prof);
  }
}

/* One all-to-all of rank 3 on 8 ranks as NCCL enqueues it: a send and a receive task per peer, the
 * rank itself included (src/enqueue.cc:3070-3082); the host starts every task event of the plan,
 * starts the proxy, stops them (src/plugin/profiler.cc:476-560, src/enqueue.cc:1436-1445); then the
 * proxy thread's events come for every task but the two to itself, which get no proxy op (:882). */
static void driveAlltoAll(int v, void *ctx, size_t count, int nChannels) {
  void *tasks[16];
  for (int r = 0; r < 8; r++) {
    gPeer = r;
    tasks[2 * r] = startTask(v, ctx, NULL, 0, "Send", count, "ncclBfloat16", NULL, NULL, nChannels, 0);
    tasks[2 * r + 1] = startTask(v, ctx, NULL, 0, "Recv", count, "ncclBfloat16", NULL, NULL, nChannels, 0);
  }
  gPeer = 1;
  for (int i = 0; i < 16; i++) stopTask(v, tasks[i]);
  for (int i = 0; i < 16; i++)
    if (i / 2 != 3) proxyEvents(v, ctx, tasks[i], 0, nChannels);
}

/* Self send/recv keeps no slot: 300 all-to-alls (600 self tasks, more than the 256 slots) in one
 * recording phase drop nothing, every other task's kernel time is kept, and so is a later
 * collective's. */
void test_profiler_self_p2p_releases_its_slot(void) {
  for (int v = 4; v <= 7; v++) {
    resetRecords();
    setActive(2);
    void *prof = profInit(v, 0x5e1f, "ep", "ep");
    for (int i = 0; i < 300; i++) driveAlltoAll(v, prof, 4096, 2);
    driveColl(v, prof, 0x5e1f, "AllReduce", 1 << 20, "RING", "SIMPLE", 8, 0);
    const char *snap = snapshot();
    CHECK(hasLine(snap, "comm", "dropped=0"), "v%d: no call dropped:\n%.400s", v, snap);
    /* 7 of each call's 8 sends have channel events: 2100 x (5005 - 1000) ns */
    CHECK(hasLine(snap, "p2p", "func=Send count=4096 channels=2 calls=2400 kernel_ns=8410500 kernel_calls=2100"),
          "v%d: sends\n%.600s", v, snap);
    CHECK(hasLine(snap, "p2p", "func=Recv count=4096 channels=2 calls=2400 kernel_calls=2100"), "v%d: recvs", v);
    CHECK(hasLine(snap, "coll", "func=AllReduce calls=1 kernel_ns=4035 kernel_calls=1"),
          "v%d: the later collective keeps its kernel time\n%.600s", v, snap);
    resetRecords();
    profFinalize(v, prof);
    setActive(0);
  }
}

/* Memory stays bounded: 64 shapes per communicator, 256 tasks awaiting their channels. */
void test_profiler_bounded(void) {
  resetRecords();
  setActive(2);
  void *prof = profInit(6, 0xb0, "dp", "dp");
  for (int i = 0; i < 70; i++) driveColl(6, prof, 0xb0, "AllGather", 1000 + (size_t)i, "RING", "LL", 1, 0);
  const char *snap = snapshot();
  CHECK(hasLine(snap, "comm", "dropped=0 overflow=6"), "70 shapes: 64 kept, 6 counted as overflow:\n%.300s", snap);
  resetRecords();
  for (int i = 0; i < 300; i++) { /* tasks whose channels never report: each keeps its slot */
    lagomProfilerDescr_v6_t d = {.type = LAGOM_PROFILE_COLL};
    d.coll.func = "AllReduce", d.coll.count = 8, d.coll.datatype = "ncclInt8", d.coll.nChannels = 1;
    d.coll.algo = "RING", d.coll.proto = "LL";
    void *h = NULL;
    ((const lagomProfiler_v6_t *)profilerStruct(6))->startEvent(prof, &h, &d);
    ((const lagomProfiler_v6_t *)profilerStruct(6))->stopEvent(h);
  }
  snap = snapshot();
  CHECK(hasLine(snap, "comm", "dropped=44 overflow=0"), "300 tasks, 256 slots:\n%.300s", snap);
  CHECK(hasLine(snap, "coll", "count=8 calls=300"), "every call is counted, dropped or not:\n%.300s", snap);
  resetRecords();
  profFinalize(6, prof);
  setActive(0);
}

/* Runs in a child process of its own (the state is per process): NCCL_PROFILER_PLUGIN names
 * another library, so NCCL never initialises lagom's profiler half; the tuner half says so once
 * and still counts its row hits. */
static int foreignChild(void) {
  writeTable(kPlanRow);
  void *tuner = initComm("dp", 8, 1, 0xf0);
  float t[NA][NP];
  fillTable(t);
  int hit = collInfo(tuner, ncclFuncAllReduce, 4 << 20, t) == 8;
  void *second = initComm("dp", 8, 1, 0xf1);
  gV6->finalize(second);
  gV6->finalize(tuner);
  const char *value = getenv("NCCL_PROFILER_PLUGIN");
  const char *foreign = ((const char *(*)(void))dlsym(gLib, "lagomProfilerForeign"))();
  int state = profilerState();
  const char *said = strstr(gLog, "names another profiler plugin");
  int once = said && !strstr(said + 1, "names another profiler plugin");
  if (!strcmp(value, "none")) return !(state == 3 && hit && !said);
  if (!strcmp(value, gLibPath)) return !(state == 0 && hit && !said); /* lagom's own: not foreign */
  int ok = state == 2 && !strcmp(foreign, value) && hit && once;
  if (!ok) fprintf(stderr, "  child: state %d foreign '%s' hit %d log:\n%s", state, foreign, hit, gLog);
  return !ok;
}

static int runChild(const char *env) {
  pid_t pid = fork();
  if (pid == 0) {
    setenv("NCCL_PROFILER_PLUGIN", env, 1);
    execl("/proc/self/exe", "test_plugin", gLibPath, "--foreign-child", (char *)NULL);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

void test_profiler_user_plugin(void) {
  CHECK(runChild("/opt/site/lib/libnccl-profiler-user.so") == 0, "another library: state, message, hit counts");
  CHECK(runChild("none") == 0, "NCCL_PROFILER_PLUGIN=none: no profiler, no warning, hit counts kept");
  CHECK(runChild(gLibPath) == 0, "NCCL_PROFILER_PLUGIN naming lagom's library is not another plugin");
}

int profilerChildMain(void) { return foreignChild(); }
