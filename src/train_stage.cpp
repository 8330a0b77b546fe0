// TrainStage<CpuBackend>: the training stage on the CPU kernels, compiled once here (its
// definitions are in the header, for users' backends).
#include "brigade/runtime/train_stage.hpp"

namespace brigade::runtime {
inline namespace v0 {

template class TrainStage<cpu::CpuBackend>;

}  // namespace v0
}  // namespace brigade::runtime
