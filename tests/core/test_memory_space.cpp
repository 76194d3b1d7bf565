// Tensors in a memory space other than the host's (test::GuardedSpace stands in for GPU memory):
// where they are allocated, what host code may do with them, explicit copies, and counting.
#include <doctest/doctest.h>

#include <vector>

#include "dsp/core/tensor.hpp"
#include "../guarded_space.hpp"

using namespace dsp;

namespace core_memory_space_test {

TEST_CASE("a tensor made inside a MemorySpaceScope lives in that space; host accessors refuse it") {
  test::GuardedSpace space;
  {
    MemorySpaceScope scope(&space);
    Tensor t({2, 3});
    CHECK(t.space() == &space);
    CHECK_FALSE(t.on_host());
    CHECK(t.numel() == 6);
    CHECK(t.data() != nullptr);
    CHECK_THROWS_WITH_AS(t.span(), doctest::Contains("is in guarded test memory"), Error);
    CHECK_THROWS_AS(t[0], Error);
    CHECK_THROWS_AS(t.values(), Error);
    CHECK_THROWS_AS(t.fill(1.0f), Error);
    {
      MemorySpaceScope host(nullptr);  // scopes nest
      CHECK(Tensor({1}).on_host());
    }
    CHECK(Tensor({1}).space() == &space);
  }
  CHECK(Tensor({1}).on_host());  // restored
}

TEST_CASE("explicit copies: to() a space and back is exact; a copy stays in its source's space; zero() works anywhere") {
  test::GuardedSpace space;
  const Tensor host({2, 2}, {1.0f, -2.0f, 3.5f, 4.0f});
  Tensor d = host.to(&space);
  CHECK(d.space() == &space);
  CHECK(d.shape() == host.shape());
  CHECK(d.to_host().values() == host.values());
  const Tensor d2 = d;  // deep copy in the same space
  CHECK(d2.space() == &space);
  CHECK(d2.data() != d.data());
  d.zero();
  CHECK(d.to_host().values() == Tensor::Storage{0.0f, 0.0f, 0.0f, 0.0f});
  CHECK(d2.to_host().values() == host.values());
  CHECK(Tensor{}.to(&space).empty());  // nothing to copy: still empty, no allocation
}

TEST_CASE("a space's tensors are counted there, under their category, and freed through it") {
  test::GuardedSpace space;
  {
    MemorySpaceScope scope(&space);
    const std::int64_t host_before = memory::live_bytes();
    Tensor p({4, 8}, memory::Category::Parameters);
    Tensor g({4, 8}, memory::Category::Gradients);
    CHECK(space.counters[memory::Category::Parameters].live == 128);
    CHECK(space.counters[memory::Category::Gradients].live == 128);
    CHECK(memory::live_bytes() == host_before);  // host counters untouched
    Tensor moved = std::move(p);
    CHECK(p.empty());
    CHECK(space.counters[memory::Category::Parameters].live == 128);
  }
  CHECK(space.counters.total.live == 0);
  CHECK(space.counters.total.peak == 256);
}

TEST_CASE("SpaceArray copies index arrays into the space; with no space it keeps a host copy") {
  test::GuardedSpace space;
  const std::vector<std::int32_t> ids{3, 1, 4, 1, 5};
  const SpaceArray<std::int32_t> in_space(ids, &space), on_host(ids, nullptr);
  CHECK(space.allocations == 1);
  CHECK(std::vector<std::int32_t>(in_space.data(), in_space.data() + 5) == ids);  // host memory underneath
  CHECK(std::vector<std::int32_t>(on_host.data(), on_host.data() + 5) == ids);
  CHECK(space.counters[memory::Category::Workspace].live == 20);
}

}  // namespace core_memory_space_test
