# Decides whether the brigade::cuda component is built; included from the top-level
# CMakeLists.txt (directory scope: enable_language(CUDA) must run at the top level, because every
# target that links brigade_cuda needs the CUDA link information).
#
#   BRIGADE_ENABLE_CUDA = AUTO (default): on when nvcc, the CUDA toolkit (cudart, cuBLAS, cuBLASLt)
#                         and NCCL are all found, otherwise off with one STATUS line saying why;
#                         ON: the same search, and a missing piece is a configure error;
#                         OFF: not searched.
# Sets BRIGADE_HAS_CUDA to 1 when the component is built (read by cmake/config.hpp.in).
set(BRIGADE_ENABLE_CUDA AUTO CACHE STRING
    "brigade::cuda (CudaBackend, NcclTransport): AUTO (if found), ON (required) or OFF")
set_property(CACHE BRIGADE_ENABLE_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${BRIGADE_ENABLE_CUDA}" _brigade_cuda_mode)
if(NOT _brigade_cuda_mode MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "BRIGADE_ENABLE_CUDA = '${BRIGADE_ENABLE_CUDA}'; expected AUTO, ON or OFF")
endif()
if(_brigade_cuda_mode MATCHES "^(TRUE|YES|1)$")
  set(_brigade_cuda_mode ON)
elseif(_brigade_cuda_mode MATCHES "^(FALSE|NO|0)$")
  set(_brigade_cuda_mode OFF)
endif()

# Reports why the component is off: fatal when it was required, one STATUS line otherwise.
macro(_brigade_cuda_off _why)
  if(_brigade_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "brigade: BRIGADE_ENABLE_CUDA=ON but ${_why}")
  endif()
  message(STATUS "brigade: component cuda OFF: ${_why}")
  set(_brigade_cuda_ok FALSE)
endmacro()

set(_brigade_cuda_ok TRUE)
if(_brigade_cuda_mode STREQUAL "OFF")
  message(STATUS "brigade: component cuda OFF: BRIGADE_ENABLE_CUDA=OFF")
  set(_brigade_cuda_ok FALSE)
endif()

# 1. nvcc. The PATH of a clean environment may lack /usr/local/cuda/bin: look there too. The
#    candidate goes through check_language (via CUDACXX), which tries it on a test project, so a
#    broken nvcc turns the component off instead of failing the configure.
if(_brigade_cuda_ok)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(BRIGADE_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH PATH_SUFFIXES bin
                 PATHS /usr/local/cuda/bin)
    if(BRIGADE_NVCC)
      set(ENV{CUDACXX} "${BRIGADE_NVCC}")
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    _brigade_cuda_off("no CUDA compiler (nvcc) found (set CMAKE_CUDA_COMPILER or CUDACXX, or put nvcc on the PATH)")
  endif()
endif()

# 2. The toolkit's libraries.
if(_brigade_cuda_ok)
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    _brigade_cuda_off("the CUDA toolkit was not found (set CUDAToolkit_ROOT)")
  elseif(NOT TARGET CUDA::cudart OR NOT TARGET CUDA::cublas OR NOT TARGET CUDA::cublasLt)
    _brigade_cuda_off("the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR} lacks cudart, cuBLAS or cuBLASLt")
  endif()
endif()

# 3. NCCL (our cmake/FindNCCL.cmake).
if(_brigade_cuda_ok)
  find_package(NCCL QUIET)
  if(NOT NCCL_FOUND)
    _brigade_cuda_off("NCCL not found (set NCCL_ROOT to the folder holding include/nccl.h and lib/libnccl.so)")
  endif()
endif()

if(_brigade_cuda_ok)
  # CMake otherwise links the static and the shared cudart together.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  # CMake 3.25 has no CUDA20 flag table for nvcc.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(BRIGADE_HAS_CUDA 1)
  message(STATUS "brigade: component cuda ON: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, CUDA toolkit "
                 "${CUDAToolkit_VERSION}, NCCL ${NCCL_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
else()
  set(BRIGADE_HAS_CUDA 0)
endif()
