// A user of the installed package: splits a model into stages and runs one kernel.
#include <brigade/brigade.hpp>

#include <cstdio>

int main() {
  const auto cfg = brigade::model::named_config("260K");
  const brigade::model::ModelSpec spec(cfg);
  const auto part = brigade::partition::uniform(spec, 3);
  float x[4] = {1, 2, 3, 4}, w[4] = {1, 1, 1, 1}, y[4];
  brigade::cpu::rmsnorm(x, w, y, 1, 4, 1e-5f);
  if (part.num_stages() != 3 || y[3] <= 0.f) return 1;
  std::printf("brigade ok %s\n", BRIGADE_VERSION_STRING);
  return 0;
}
