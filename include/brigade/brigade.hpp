// brigade: pipeline parallelism for transformer models. The CPU-safe umbrella header.
#pragma once

#include "brigade/config.hpp"
#include "brigade/core/error.hpp"
#include "brigade/core/op.hpp"
#include "brigade/core/timeline.hpp"
#include "brigade/backend/cpu.hpp"
#include "brigade/io/trace.hpp"
#include "brigade/model/config.hpp"
#include "brigade/model/layer_cost.hpp"
#include "brigade/model/sampler.hpp"
#include "brigade/model/tokenizer.hpp"
#include "brigade/model/weights.hpp"
#include "brigade/partition/partition.hpp"
#include "brigade/schedule.hpp"
#include "brigade/cost/cost_model.hpp"
#include "brigade/sim/simulator.hpp"
#include "brigade/sim/svg.hpp"
