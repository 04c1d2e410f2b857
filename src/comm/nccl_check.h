// The one check of an NCCL call's result: throws m3msa::Error(kInternal) naming the expression
// and NCCL's message, with file:line (M3MSA_THROW). For CUDA builds (includes nccl.h).
#pragma once

#include <nccl.h>

#include "m3msa/error.h"

#define M3MSA_NCCL_CHECK(expr)                                                    \
  do {                                                                            \
    const ncclResult_t m3msa_nccl_status_ = (expr);                               \
    if (m3msa_nccl_status_ != ncclSuccess) {                                      \
      M3MSA_THROW(::m3msa::ErrorCode::kInternal, "NCCL call failed: " #expr ": ", \
                  ncclGetErrorString(m3msa_nccl_status_));                        \
    }                                                                             \
  } while (0)
