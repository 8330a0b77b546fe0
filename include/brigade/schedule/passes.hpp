// The passes over the schedule IR: lower() adds communication, strip_communication() removes
// it, append_inference_round() emits a lowered inference round, add_weight_offload() adds
// PREFETCH/RELEASE around each window's runs, validate() proves a lowered schedule completes or
// names why it cannot.
#pragma once

#include "brigade/schedule/lower.hpp"
#include "brigade/schedule/offload.hpp"
#include "brigade/schedule/rounds.hpp"
#include "brigade/schedule/validate.hpp"
