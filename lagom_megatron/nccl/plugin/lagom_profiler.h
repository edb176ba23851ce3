/*
 * lagom_profiler.h: the NCCL profiler-plugin ABI (versions 1 to 7) as lagom's plugin uses it.
 *
 * Declared for this project from NCCL's profiler interface (NVIDIA/nccl v2.30.7
 * src/include/plugin/profiler/profiler_v1.h .. profiler_v6.h; v2.23.4 and v2.25.1
 * src/include/nccl_profiler.h for v1 and v2; profiler_v7.h @8898068, NCCL 2.31.2): the field
 * order and types of every event
 * descriptor, state-argument union and plugin struct, so that each has NCCL's size and offsets
 * (tests/nccl/test_plugin_abi.py compares them). This is not a copy of NCCL's headers: members
 * lagom never reads keep NCCL's types and order under their own names.
 *
 * NCCL dlopen()s the library named by NCCL_PROFILER_PLUGIN and looks up the newest struct it
 * knows, ncclProfiler_v6 down to _v1 (v2.30.7 src/plugin/profiler.cc:73-88), ncclProfiler_v7 first
 * from 2.31 (src/plugin/profiler.cc:123-141 @8898068, 2.31.2). Versions by NCCL release: v1 (2.23),
 * v2 (2.24), v3 (2.26: kernelCh events), v4 (2.27: init gets commName, commHash, nNodes, nRanks,
 * rank, logger; descriptors lose name/commHash; coll.nChannels; kernelCh GPU timers), v5 (2.28:
 * commId first; API events), v6 (2.29: copy-engine events), v7 (2.31: a per-call userTag in the
 * collApi, p2pApi, coll, p2p and ceColl descriptors, coll.kernelVariant and coll.isSymColl, and
 * kernelPhase sub-events under a kernelCh event). NCCL 2.32.6 also carries a v8, whose header
 * lagom has not read: it is not declared here, and that NCCL still finds v7.
 */
#ifndef LAGOM_PROFILER_H_
#define LAGOM_PROFILER_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "lagom_tuner.h"

/* Event types (the eActivationMask bits and the descriptor's `type`; src/include/plugin/nccl_profiler.h:11-28). */
#define LAGOM_PROFILE_GROUP (1 << 0)
#define LAGOM_PROFILE_COLL (1 << 1)
#define LAGOM_PROFILE_P2P (1 << 2)
#define LAGOM_PROFILE_PROXY_OP (1 << 3)
#define LAGOM_PROFILE_PROXY_STEP (1 << 4)
#define LAGOM_PROFILE_PROXY_CTRL (1 << 5)
#define LAGOM_PROFILE_KERNEL_CH (1 << 6)
/* v6's copy-engine (CE) collective and its two children, a CE sync and a CE batch of copies
 * (v2.30.7 src/include/plugin/nccl_profiler.h:24-27; NCCL 2.29+). */
#define LAGOM_PROFILE_CE_COLL (1 << 12)
#define LAGOM_PROFILE_CE_SYNC (1 << 13)
#define LAGOM_PROFILE_CE_BATCH (1 << 14)
/* v7's kernel-phase sub-event (nccl_profiler.h:29 @8898068): lagom never asks for it. */
#define LAGOM_PROFILE_KERNEL_PHASE (1 << 15)
/* The state NCCL records on a kernelCh event with its stop timer (nccl_profiler.h:61). */
#define LAGOM_PROFILER_KERNEL_CH_STOP 22

typedef int lagomProfilerState_t; /* ncclProfilerEventState_t: an enum (int) in every version */

/* ---- v1 (NCCL 2.23): enums as uint8_t, op and trafficBytes, init(context, mask) ---- */
typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    struct {
      const char *name;
      uint64_t commHash;
      uint64_t seqNumber;
      uint8_t func;
      const void *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      uint8_t datatype;
      uint32_t op;
      size_t trafficBytes;
      uint8_t nMaxChannels;
      uint8_t nWarps;
      uint8_t algo;
      uint8_t proto;
      int isCollnet;
      int isNvls;
    } coll;
    struct {
      const char *name;
      uint64_t commHash;
      uint8_t func;
      void *buff;
      uint8_t datatype;
      size_t count;
      int peer;
    } p2p;
    struct {
      pid_t pid;
      uint8_t channelId;
      int peer;
      int nSteps;
      int chunkSize;
      int isSend;
    } proxyOp;
    struct {
      int step;
    } proxyStep;
  };
} lagomProfilerDescr_v1_t;

/* v1-v3 state arguments (the same union in each). */
typedef union {
  struct {
    size_t transSize;
    int steps;
  } proxyOp;
  struct {
    int appendedProxyOps;
  } proxyCtrl;
} lagomProfilerStateArgs_v1_t;

/* ---- v2 (NCCL 2.24): strings for func, datatype, algo and proto ---- */
typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    struct {
      const char *name;
      uint64_t commHash;
      uint64_t seqNumber;
      const char *func;
      const void *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      size_t trafficBytes;
      uint8_t nMaxChannels;
      uint8_t nWarps;
      const char *algo;
      const char *proto;
    } coll;
    struct {
      const char *name;
      uint64_t commHash;
      const char *func;
      void *buff;
      const char *datatype;
      size_t count;
      int peer;
    } p2p;
    struct {
      pid_t pid;
      uint8_t channelId;
      int peer;
      int nSteps;
      int chunkSize;
      int isSend;
    } proxyOp;
    struct {
      int step;
    } proxyStep;
  };
} lagomProfilerDescr_v2_t;

/* ---- v3 (NCCL 2.26): no trafficBytes; kernelCh and netPlugin events ---- */
typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    struct {
      const char *name;
      uint64_t commHash;
      uint64_t seqNumber;
      const char *func;
      const void *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      uint8_t nMaxChannels;
      uint8_t nWarps;
      const char *algo;
      const char *proto;
    } coll;
    struct {
      const char *name;
      uint64_t commHash;
      const char *func;
      void *buff;
      const char *datatype;
      size_t count;
      int peer;
    } p2p;
    struct {
      pid_t pid;
      uint8_t channelId;
      int peer;
      int nSteps;
      int chunkSize;
      int isSend;
    } proxyOp;
    struct {
      int step;
    } proxyStep;
    struct {
      uint8_t channelId;
    } kernelCh;
    struct {
      int64_t id;
      void *data;
    } netPlugin;
  };
} lagomProfilerDescr_v3_t;

/* The coll / p2p / proxyOp / proxyStep / kernelCh / netPlugin members of v4 to v6. */
#define LAGOM_PROFILER_TASK_MEMBERS_V4(PARENT)                                                  \
  struct {                                                                                      \
    uint64_t seqNumber;                                                                         \
    const char *func;                                                                           \
    const void *sendBuff;                                                                       \
    void *recvBuff;                                                                             \
    size_t count;                                                                               \
    int root;                                                                                   \
    const char *datatype;                                                                       \
    uint8_t nChannels;                                                                          \
    uint8_t nWarps;                                                                             \
    const char *algo;                                                                           \
    const char *proto;                                                                          \
    PARENT                                                                                      \
  } coll;                                                                                       \
  struct {                                                                                      \
    const char *func;                                                                           \
    void *buff;                                                                                 \
    const char *datatype;                                                                       \
    size_t count;                                                                               \
    int peer;                                                                                   \
    uint8_t nChannels;                                                                          \
    PARENT                                                                                      \
  } p2p;                                                                                        \
  struct {                                                                                      \
    pid_t pid;                                                                                  \
    uint8_t channelId;                                                                          \
    int peer;                                                                                   \
    int nSteps;                                                                                 \
    int chunkSize;                                                                              \
    int isSend;                                                                                 \
  } proxyOp;                                                                                    \
  struct {                                                                                      \
    int step;                                                                                   \
  } proxyStep;                                                                                  \
  struct {                                                                                      \
    uint8_t channelId;                                                                          \
    uint64_t pTimer; /* GPU globaltimer at the channel's start, ns */                           \
  } kernelCh;                                                                                   \
  struct {                                                                                      \
    int64_t id;                                                                                 \
    void *data;                                                                                 \
  } netPlugin;

/* ---- v4 (NCCL 2.27): no name/commHash in descriptors; nChannels; GPU timers ---- */
typedef struct {
  uint8_t type;
  void *parentObj;
  int rank;
  union {
    LAGOM_PROFILER_TASK_MEMBERS_V4()
  };
} lagomProfilerDescr_v4_t;

/* v4-v6 state arguments. */
typedef union {
  struct {
    size_t transSize;
  } proxyStep;
  struct {
    int appendedProxyOps;
  } proxyCtrl;
  struct {
    void *data;
  } netPlugin;
  struct {
    uint64_t pTimer; /* GPU globaltimer at the channel's stop, ns (state LAGOM_PROFILER_KERNEL_CH_STOP) */
  } kernelCh;
} lagomProfilerStateArgs_v4_t;

/* The API-event members v5 added before coll (groupApi, collApi, p2pApi, kernelLaunch). */
#define LAGOM_PROFILER_API_MEMBERS_V5                                                           \
  struct {                                                                                      \
    bool graphCaptured;                                                                         \
    int groupDepth;                                                                             \
  } groupApi;                                                                                   \
  struct {                                                                                      \
    const char *func;                                                                           \
    size_t count;                                                                               \
    const char *datatype;                                                                       \
    int root;                                                                                   \
    void *stream;                                                                               \
    bool graphCaptured;                                                                         \
  } collApi;                                                                                    \
  struct {                                                                                      \
    const char *func;                                                                           \
    size_t count;                                                                               \
    const char *datatype;                                                                       \
    void *stream;                                                                               \
    bool graphCaptured;                                                                         \
  } p2pApi;                                                                                     \
  struct {                                                                                      \
    void *stream;                                                                               \
  } kernelLaunch;

/* ---- v5 (NCCL 2.28): 64-bit type, API events, coll/p2p parentGroup ---- */
typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    LAGOM_PROFILER_API_MEMBERS_V5
    LAGOM_PROFILER_TASK_MEMBERS_V4(void *parentGroup;)
  };
} lagomProfilerDescr_v5_t;

/* ---- v6 (NCCL 2.29): copy-engine collective events ---- */
typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    LAGOM_PROFILER_API_MEMBERS_V5
    LAGOM_PROFILER_TASK_MEMBERS_V4(void *parentGroup;)
    struct {
      uint64_t seqNumber;
      const char *func;
      const void *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      const char *syncStrategy;
      bool intraBatchSync;
      uint32_t batchSize;
      uint32_t numBatches;
      uint32_t ceSeqNum;
      void *stream;
    } ceColl;
    struct {
      bool isComplete;
      int nRanks;
    } ceCollSync;
    struct {
      int numOps;
      size_t totalBytes;
      bool useIntraSync;
    } ceCollBatch;
  };
} lagomProfilerDescr_v6_t;

/* ---- v7 (NCCL 2.31): per-call userTag, symmetric-kernel facts, kernelPhase sub-events ----
 * NVIDIA/nccl src/include/plugin/profiler/profiler_v7.h:13-136 @8898068 (2.31.2). Every member
 * before the ones v7 appends keeps v6's offset; coll and p2p grow past v6's end, so the
 * descriptor is 136 bytes (v6: 112). */
typedef struct {
  uint64_t type;
  void *parentObj;
  int rank;
  union {
    struct {
      bool graphCaptured;
      int groupDepth;
    } groupApi;
    struct {
      const char *func;
      size_t count;
      const char *datatype;
      int root;
      void *stream;
      bool graphCaptured;
      uint64_t userTag;
    } collApi;
    struct {
      const char *func;
      size_t count;
      const char *datatype;
      void *stream;
      bool graphCaptured;
      uint64_t userTag;
    } p2pApi;
    struct {
      void *stream;
    } kernelLaunch;
    struct {
      uint64_t seqNumber;
      const char *func;
      const void *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      uint8_t nChannels;
      uint8_t nWarps;
      const char *algo;  /* a symmetric kernel: the part of its variant name after '_' */
      const char *proto; /* a symmetric kernel: "" */
      void *parentGroup;
      const char *kernelVariant; /* NULL unless isSymColl */
      bool isSymColl;
      uint64_t userTag;
    } coll;
    struct {
      const char *func;
      void *buff;
      const char *datatype;
      size_t count;
      int peer;
      uint8_t nChannels;
      void *parentGroup;
      uint64_t userTag;
    } p2p;
    struct {
      pid_t pid;
      uint8_t channelId;
      int peer;
      int nSteps;
      int chunkSize;
      int isSend;
    } proxyOp;
    struct {
      int step;
    } proxyStep;
    struct {
      uint8_t channelId;
      uint64_t pTimer;
    } kernelCh;
    struct {
      int64_t id;
      void *data;
    } netPlugin;
    struct {
      uint64_t seqNumber;
      const char *func;
      const void *sendBuff;
      void *recvBuff;
      size_t count;
      int root;
      const char *datatype;
      const char *syncStrategy;
      bool intraBatchSync;
      uint32_t batchSize;
      uint32_t numBatches;
      uint32_t ceSeqNum;
      void *stream;
      uint64_t userTag;
    } ceColl;
    struct {
      bool isComplete;
      int nRanks;
    } ceCollSync;
    struct {
      int numOps;
      size_t totalBytes;
      bool useIntraSync;
    } ceCollBatch;
    struct {
      uint8_t channelId;
      uint8_t phaseId;
      const char *phaseName;
      uint64_t pTimer;
    } kernelPhase;
  };
} lagomProfilerDescr_v7_t;

/* v7's state arguments have v4's members (profiler_v7.h:138-157 @8898068; a phase's stop timer
 * travels in kernelCh.pTimer too). */
typedef lagomProfilerStateArgs_v4_t lagomProfilerStateArgs_v7_t;

/* ---- the plugin structs NCCL looks up by name ---- */
#define LAGOM_PROFILER_COMMON_CALLS(DESCR, ARGS)                                                \
  ncclResult_t (*startEvent)(void *context, void **eHandle, DESCR *eDescr);                     \
  ncclResult_t (*stopEvent)(void *eHandle);                                                     \
  ncclResult_t (*recordEventState)(void *eHandle, lagomProfilerState_t eState, ARGS *eStateArgs); \
  ncclResult_t (*finalize)(void *context);

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, int *eActivationMask);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v1_t, lagomProfilerStateArgs_v1_t)
} lagomProfiler_v1_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, int *eActivationMask);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v2_t, lagomProfilerStateArgs_v1_t)
} lagomProfiler_v2_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, int *eActivationMask);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v3_t, lagomProfilerStateArgs_v1_t)
} lagomProfiler_v3_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, int *eActivationMask, const char *commName, uint64_t commHash,
                       int nNodes, int nRanks, int rank, ncclDebugLogger_t logFn);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v4_t, lagomProfilerStateArgs_v4_t)
} lagomProfiler_v4_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName,
                       int nNodes, int nRanks, int rank, ncclDebugLogger_t logFn);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v5_t, lagomProfilerStateArgs_v4_t)
} lagomProfiler_v5_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName,
                       int nNodes, int nRanks, int rank, ncclDebugLogger_t logFn);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v6_t, lagomProfilerStateArgs_v4_t)
} lagomProfiler_v6_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName,
                       int nNodes, int nRanks, int rank, ncclDebugLogger_t logFn);
  LAGOM_PROFILER_COMMON_CALLS(lagomProfilerDescr_v7_t, lagomProfilerStateArgs_v7_t)
} lagomProfiler_v7_t;

#endif /* LAGOM_PROFILER_H_ */
