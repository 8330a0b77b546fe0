// brigade::schedule umbrella: the IR, its text form, the generators and the passes.
#pragma once

#include "brigade/schedule/action.hpp"
#include "brigade/schedule/dataflow.hpp"
#include "brigade/schedule/generators.hpp"
#include "brigade/schedule/passes.hpp"
#include "brigade/schedule/registry.hpp"
