// A user of the installed package with COMPONENTS mpi: one MPI process sends itself a message.
#include <brigade/config.hpp>
#include <brigade/transport/mpi.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  using namespace brigade::transport;
  static_assert(BRIGADE_HAS_MPI == 1, "the installed config header says mpi was built");
  MpiSession mpi(&argc, &argv);
  MpiTransport t;
  std::vector<float> out{1, 2, 3}, in(3);
  const auto h = MessageHeader::make(0, 0, brigade::DType::F32, {3});
  auto r = t.irecv(t.rank(), 1, h, as_writable_bytes(std::span<float>(in)));
  auto s = t.isend(t.rank(), 1, h, as_bytes(std::span<const float>(out)));
  t.wait(s, Deadline::after(30));
  t.wait(r, Deadline::after(30));
  if (in != out) return 1;
  std::printf("brigade ok mpi, %d rank(s)\n", mpi.world_size());
  return 0;
}
