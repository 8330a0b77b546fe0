// transport/faults.hpp and transport/verify.hpp under mpirun: one process per rank, every rank's
// MpiTransport wrapped in a verifying decorator (and rank 0's in a fault-injecting one); bits
// flipped in one stories260K activation stop the run on every process, naming the receiving rank, the sending rank, the
// kind and the micro-batch (tests/flip_scenario.hpp; the same scenario runs on threads in
// tests/model/test_generate_on.cpp).
#include <brigade/model/weights.hpp>
#include <brigade/transport/mpi.hpp>

#include <doctest/doctest.h>

#include "flip_scenario.hpp"
#include "test_util.hpp"

#include <filesystem>
#include <fstream>


using namespace brigade;

TEST_CASE("mpi.decorators: bits flipped in one activation are rejected by the receiving rank's "
          "SENTINEL verifier and every process stops naming rank 1, rank 0, the kind and the "
          "micro-batch") {
  const std::filesystem::path data = BRIGADE_MODEL_DIR;
  const auto weights = model::load_llama2c_checkpoint(data / "stories260K.bin");
  const auto ref = test::greedy_reference(data).cases.at(1);  // "Once upon a time", 64 steps
  const std::vector<int> ids = ref.tokens();
  const auto& prompt = ref.prompt_ids;
  const std::vector<engine::GenerationRequest> req{{prompt, 64}, {prompt, 64}};
  engine::InferenceOptions opt;
  opt.sampler.temperature = 0.0f;
  opt.microbatches = 2;
  opt.timeout_s = 60;

  transport::MpiTransport tp;
  REQUIRE(tp.world_size() >= 2);
  const auto out = test::flip_one_activation(tp, weights, req, opt);
  if (tp.rank() == 0) {
    REQUIRE(out.clean.size() == 2);
    CHECK(out.clean[0].tokens == ids);
    CHECK(out.clean[1].tokens == ids);
  }
  test::check_flip_outcome(out, tp.rank());
}
