// One per-layer tensor of a Llama checkpoint as the loaders bind it (internal to src/: the GGUF
// and safetensors loaders each list their format's names in DecoderWeights order).
#pragma once

#include "brigade/model/weights.hpp"

#include <string_view>

namespace brigade::model {
inline namespace v0 {

/// A decoder layer's tensor: its name in the file format (the part after the layer number), and
/// where it goes: a norm gain (`gain`, float32) or a matrix (`matrix`, a typed view); one of the
/// two is set.
struct LayerTensor {
  std::string_view suffix;
  const float* DecoderWeights::*gain = nullptr;
  WeightMatrix DecoderWeights::*matrix = nullptr;
};

}  // namespace v0
}  // namespace brigade::model
