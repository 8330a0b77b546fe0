// The element-wise kernels (cpu_elementwise.hpp) built with the library's own target flags (the
// portable build, and the one every CPU without AVX2 runs); the bits are those of every other
// build.
#include "cpu_elementwise.hpp"

namespace brigade::cpu::detail {

const ElementwiseKernels kElementwiseGeneric{exp_loop, softmax_loop, swiglu_loop};

}  // namespace brigade::cpu::detail
