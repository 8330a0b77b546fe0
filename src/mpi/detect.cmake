# Decides whether the brigade::mpi component is built; included from the top-level
# CMakeLists.txt before cmake/config.hpp.in is configured.
#
#   BRIGADE_ENABLE_MPI = AUTO (default): on when MPI's C bindings are found, otherwise off with
#                        one STATUS line saying why;
#                        ON: the same search, and a missing MPI is a configure error;
#                        OFF: not searched.
# Sets BRIGADE_HAS_MPI to 1 when the component is built (read by cmake/config.hpp.in).
set(BRIGADE_ENABLE_MPI AUTO CACHE STRING
    "brigade::mpi (MpiTransport, multi-process generate): AUTO (if found), ON (required) or OFF")
set_property(CACHE BRIGADE_ENABLE_MPI PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${BRIGADE_ENABLE_MPI}" _brigade_mpi_mode)
if(NOT _brigade_mpi_mode MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "BRIGADE_ENABLE_MPI = '${BRIGADE_ENABLE_MPI}'; expected AUTO, ON or OFF")
endif()
if(_brigade_mpi_mode MATCHES "^(TRUE|YES|1)$")
  set(_brigade_mpi_mode ON)
elseif(_brigade_mpi_mode MATCHES "^(FALSE|NO|0)$")
  set(_brigade_mpi_mode OFF)
endif()

set(BRIGADE_HAS_MPI 0)
if(_brigade_mpi_mode STREQUAL "OFF")
  message(STATUS "brigade: component mpi OFF: BRIGADE_ENABLE_MPI=OFF")
else()
  # brigade uses MPI's C API only: skip the deprecated C++ bindings (libmpi_cxx).
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(BRIGADE_HAS_MPI 1)
    message(STATUS "brigade: component mpi ON: MPI ${MPI_CXX_VERSION}, "
                   "launcher ${MPIEXEC_EXECUTABLE}")
  else()
    set(_why "no MPI found (install libopenmpi-dev and openmpi-bin, or set MPI_HOME / MPI_CXX_COMPILER)")
    if(_brigade_mpi_mode STREQUAL "ON")
      message(FATAL_ERROR "brigade: BRIGADE_ENABLE_MPI=ON but ${_why}")
    endif()
    message(STATUS "brigade: component mpi OFF: ${_why}")
  endif()
endif()
