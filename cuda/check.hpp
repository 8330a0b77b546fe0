// Status codes of the CUDA runtime, cuBLAS and NCCL as brigade::Error (host .cpp files of
// brigade::cuda only: this header uses fmt, which nvcc's C++20 mode cannot compile).
#pragma once

#include "brigade/core/error.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

namespace brigade::cuda::detail {

/// Throws Error{Cuda} for a failed CUDA runtime call: the call's text, the error's name and
/// description, and where it happened.
[[noreturn]] inline void fail_cuda(cudaError_t e, const char* what, const char* file, int line) {
  brigade::detail::fail(Errc::Cuda, "{} failed: {} ({}) [{}:{}]", what, cudaGetErrorName(e),
                        cudaGetErrorString(e), file, line);
}

/// Throws Error{Cuda} for a failed cuBLAS call.
[[noreturn]] inline void fail_cublas(cublasStatus_t s, const char* what, const char* file,
                                     int line) {
  brigade::detail::fail(Errc::Cuda, "{} failed: {} ({}) [{}:{}]", what, cublasGetStatusName(s),
                        cublasGetStatusString(s), file, line);
}

/// Throws Error{Nccl} for a failed NCCL call, with ncclGetLastError's detail when there is one.
[[noreturn]] inline void fail_nccl(ncclResult_t r, ncclComm_t comm, const char* what,
                                   const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  brigade::detail::fail(Errc::Nccl, "{} failed: {}{}{} [{}:{}]", what, ncclGetErrorString(r),
                        (last && *last) ? ": " : "", (last && *last) ? last : "", file, line);
}

}  // namespace brigade::cuda::detail

/// Evaluates a CUDA runtime call; throws brigade::Error{Cuda} unless it returns cudaSuccess.
#define BRIGADE_CUDA_CHECK(expr)                                                           \
  do {                                                                                     \
    const cudaError_t brigade_cuda_status_ = (expr);                                       \
    if (brigade_cuda_status_ != cudaSuccess)                                               \
      ::brigade::cuda::detail::fail_cuda(brigade_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (false)

/// Evaluates a cuBLAS call; throws brigade::Error{Cuda} unless it returns CUBLAS_STATUS_SUCCESS.
#define BRIGADE_CUBLAS_CHECK(expr)                                                             \
  do {                                                                                         \
    const cublasStatus_t brigade_cublas_status_ = (expr);                                      \
    if (brigade_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                       \
      ::brigade::cuda::detail::fail_cublas(brigade_cublas_status_, #expr, __FILE__, __LINE__); \
  } while (false)

/// Evaluates an NCCL call on `comm` (may be nullptr); throws brigade::Error{Nccl} unless it
/// returns ncclSuccess or, for a non-blocking communicator, ncclInProgress.
#define BRIGADE_NCCL_CHECK(expr, comm)                                                             \
  do {                                                                                             \
    const ncclResult_t brigade_nccl_status_ = (expr);                                              \
    if (brigade_nccl_status_ != ncclSuccess && brigade_nccl_status_ != ncclInProgress)             \
      ::brigade::cuda::detail::fail_nccl(brigade_nccl_status_, (comm), #expr, __FILE__, __LINE__); \
  } while (false)
