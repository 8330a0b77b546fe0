# FindNCCL: NVIDIA's collective communication library, as the one imported target NCCL::nccl.
#
# Order of search:
#   1. NCCL's own CMake package (NCCL >= 2.29.7 installs NCCLConfig.cmake with NCCL::nccl);
#   2. nccl.h and libnccl with find_path / find_library, hinted by NCCL_ROOT (CMake variable or
#      environment), CUDAToolkit's folders, CUDA_HOME, and the folder of the nvidia-nccl Python
#      wheel when a python3 with it is on the PATH (the GPU machines of this project carry NCCL
#      only there).
#
# Provides: NCCL_FOUND, NCCL_VERSION (from NCCL_MAJOR/MINOR/PATCH in nccl.h), NCCL_INCLUDE_DIR,
# NCCL_LIBRARY, and the imported target NCCL::nccl whichever way it was found.
include(FindPackageHandleStandardArgs)

if(NOT NCCL_FOUND)
  find_package(NCCL CONFIG QUIET)
endif()
if(NCCL_FOUND AND TARGET NCCL::nccl)
  if(NOT NCCL_VERSION AND DEFINED NCCL_VERSION_STRING)
    set(NCCL_VERSION "${NCCL_VERSION_STRING}")
  endif()
  find_package_handle_standard_args(NCCL CONFIG_MODE)
  return()
endif()

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_ROOT}
                $ENV{CUDA_HOME} /usr/local/cuda)
if(CUDAToolkit_INCLUDE_DIRS)
  list(APPEND _nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
endif()
if(CUDAToolkit_LIBRARY_DIR)
  list(APPEND _nccl_library_hints ${CUDAToolkit_LIBRARY_DIR})
endif()
if(NOT NCCL_ROOT AND NOT DEFINED ENV{NCCL_ROOT})
  find_program(_nccl_python3 python3)
  if(_nccl_python3)
    execute_process(
      COMMAND ${_nccl_python3} -c
              "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"
      OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _nccl_wheel_rc)
    if(_nccl_wheel_rc EQUAL 0 AND IS_DIRECTORY "${_nccl_wheel}")
      list(APPEND _nccl_hints "${_nccl_wheel}")
    endif()
  endif()
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_include_hints} ${_nccl_hints}
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS ${_nccl_library_hints} ${_nccl_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_defines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*NCCL_${_part}[ \t]+([0-9]+).*" "\\1" _nccl_${_part} "${_nccl_defines}")
  endforeach()
  if(_nccl_MAJOR MATCHES "^[0-9]+$" AND _nccl_MINOR MATCHES "^[0-9]+$"
     AND _nccl_PATCH MATCHES "^[0-9]+$")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
# Leave only the results (NCCL_*) in the caller's scope. _nccl_python3 is a cache entry
# (find_program); it stays so later runs skip the search.
unset(_nccl_hints)
unset(_nccl_include_hints)
unset(_nccl_library_hints)
unset(_nccl_wheel)
unset(_nccl_wheel_rc)
unset(_nccl_defines)
unset(_nccl_MAJOR)
unset(_nccl_MINOR)
unset(_nccl_PATCH)
