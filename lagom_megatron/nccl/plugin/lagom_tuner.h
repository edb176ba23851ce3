/*
 * lagom_tuner.h: the NCCL tuner-plugin ABI (versions 3 to 7) as lagom's plugin uses it.
 *
 * Declared for this project from NCCL's documented tuner interface (the field order and argument
 * lists of ncclTunerPlugin_v3..v7 and the enum values NCCL passes in); this is not a copy of
 * NCCL's headers. The plugin never links against NCCL: NCCL dlopen()s the shared library and
 * looks up the exported structs by name, newest first (ncclTunerPlugin_v7, _v6 .. _v2: NVIDIA/nccl
 * src/plugin/tuner.cc:76-91 @2449986f, 2.32 code; v6 first in 2.30-2.31).
 *
 * Version history of the calls (NCCL release that introduced each version):
 *   v3 (2.22): init(nRanks, nNodes, logFn, &ctx); getCollInfo edits a cost table instead of
 *              returning an algorithm/protocol pair; destroy(ctx).
 *   v4 (2.24): getCollInfo gains `regBuff` (the user buffer can be registered).
 *   v5 (2.28): init(&ctx, commId, nRanks, nNodes, logFn, nvlDomainInfo, constants);
 *              destroy is renamed finalize.
 *   v6 (2.30): optional getChunkSize(ctx, collType, nBytes, algo, proto, nChannels, &chunkSize).
 *   v7 (2.32): v6's members and calls; only the constants init may edit grow a fifth
 *              compute-capability row (Rubin: NCCL_NUM_COMPCAPS_V7 5, v5/v6 4; NVIDIA/nccl
 *              src/include/plugin/tuner/tuner_v7.h:17, :19-29, struct :55-117 @2449986f).
 */
#ifndef LAGOM_TUNER_H_
#define LAGOM_TUNER_H_

#include <stddef.h>
#include <stdint.h>

/* Result codes NCCL understands; the plugin only ever returns ncclSuccess or a failure that makes
 * NCCL fall back to its own tuning for that call. */
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

/* Log levels and subsystem flags of NCCL's logger (NCCL_DEBUG / NCCL_DEBUG_SUBSYS). */
typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

#define LAGOM_NCCL_SUBSYS_INIT 1UL
#define LAGOM_NCCL_SUBSYS_TUNING 64UL

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file,
                                  int line, const char *fmt, ...);

/* Collective types passed as `collType` (only the first five reach a tuner). */
typedef enum {
  ncclFuncBroadcast = 0,
  ncclFuncReduce = 1,
  ncclFuncAllGather = 2,
  ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4,
} ncclFunc_t;
#define LAGOM_NUM_TUNED_FUNCS 5

/* Row (algorithm) and column (protocol) indices of the cost table NCCL hands to getCollInfo.
 * The table is a contiguous float array [numAlgo][numProto] of predicted times in microseconds;
 * an entry NCCL has disabled for this call holds -1.0 (NCCL_ALGO_PROTO_IGNORE). */
#define LAGOM_ALGO_TREE 0
#define LAGOM_ALGO_RING 1
#define LAGOM_ALGO_COLLNET_DIRECT 2
#define LAGOM_ALGO_COLLNET_CHAIN 3
#define LAGOM_ALGO_NVLS 4
#define LAGOM_ALGO_NVLS_TREE 5
#define LAGOM_ALGO_PAT 6
#define LAGOM_NUM_ALGOS 7

#define LAGOM_PROTO_LL 0
#define LAGOM_PROTO_LL128 1
#define LAGOM_PROTO_SIMPLE 2
#define LAGOM_NUM_PROTOS 3

#define LAGOM_ALGO_PROTO_IGNORE (-1.0f)

/* Channels (CTAs) one collective may use: MAXCHANNELS is 64 from NCCL 2.25 (32 before); NCCL
 * also caps a plugin's request at the channels the communicator set up. */
#define LAGOM_MAX_CHANNELS 64

/* The plugin never reads the NVLink-domain info or the tuning constants NCCL passes to v5-v7
 * init, so they are declared as incomplete types: a pointer is all that crosses the ABI (which is
 * why v7's larger constants table needs no code of its own). */
typedef struct lagomNvlDomainInfo lagomNvlDomainInfo_t;
typedef struct lagomTunerConstants lagomTunerConstants_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **context);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int *nChannels);
  ncclResult_t (*destroy)(void *context);
} lagomTuner_v3_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **context);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff,
                              int *nChannels);
  ncclResult_t (*destroy)(void *context);
} lagomTuner_v4_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                       ncclDebugLogger_t logFunction, lagomNvlDomainInfo_t *nvlDomainInfo,
                       lagomTunerConstants_t *constants);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff,
                              int *nChannels);
  ncclResult_t (*finalize)(void *context);
} lagomTuner_v5_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                       ncclDebugLogger_t logFunction, lagomNvlDomainInfo_t *nvlDomainInfo,
                       lagomTunerConstants_t *constants);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff,
                              int *nChannels);
  ncclResult_t (*finalize)(void *context);
  /* Optional in NCCL (NULL = keep NCCL's chunk size); chunkSize is in/out, in bytes, and NCCL
   * clamps the result to what its buffers allow. */
  ncclResult_t (*getChunkSize)(void *context, ncclFunc_t collType, size_t nBytes, int algo,
                               int proto, int nChannels, size_t *chunkSize);
} lagomTuner_v6_t;

/* v7: the same members, types and order as v6 (tuner_v7.h:55-117 @2449986f). */
typedef lagomTuner_v6_t lagomTuner_v7_t;

/* Environment variables the plugin reads in init (once per communicator). */
#define LAGOM_TUNER_CONFIG_ENV "LAGOM_TUNER_CONFIG"
#define LAGOM_TUNER_CONFIG_FALLBACK_ENV "NCCL_TUNER_CONFIG_FILE" /* read only when the first is unset */
#define LAGOM_TUNER_NO_TABLE "none" /* $LAGOM_TUNER_CONFIG value (like ""): no table, no fallback */
#define LAGOM_TUNER_COMM_TAG_ENV "LAGOM_TUNER_COMM_TAG"
#define LAGOM_TAG_MAX 64
#define LAGOM_TABLE_PATH_MAX 4096 /* longest plan-table path lagomSetNextComm takes, with its NUL */

#endif /* LAGOM_TUNER_H_ */
