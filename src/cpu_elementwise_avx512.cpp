// The element-wise kernels (cpu_elementwise.hpp) built for AVX-512F: the compiler vectorizes their
// loops for this translation unit's target flags (CMakeLists.txt); the bits are those of every
// other build.
#include "cpu_elementwise.hpp"

namespace brigade::cpu::detail {

const ElementwiseKernels kElementwiseAvx512{exp_loop, softmax_loop, swiglu_loop};

}  // namespace brigade::cpu::detail
