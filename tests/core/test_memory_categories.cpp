// dsp::memory's categories: scopes, which category a copied or moved tensor is freed from, one
// thread's counts against another's, peaks. The reference is arithmetic on the byte sizes the
// tests allocate (exact: every count is an integer number of bytes). Each test measures
// differences from a snapshot taken at its start, so the doctest runner's own counted storage
// does not matter.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>

#include "dsp/core/memory.hpp"
#include "dsp/core/tensor.hpp"

using namespace dsp;

namespace core_memory_categories_test {
using memory::Category;

namespace {

// Live bytes of category c now minus in `before`.
std::int64_t grown(const memory::Snapshot& before, Category c) { return memory::snapshot()[c].live - before[c].live; }

// The "VmFlags:" line the kernel shows for the mapping that holds address a (/proc/self/smaps),
// empty when there is none.
std::string vm_flags(std::uintptr_t a) {
  std::ifstream smaps("/proc/self/smaps");
  bool holds = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) holds = lo <= a && a < hi;
    else if (holds && line.starts_with("VmFlags:")) return line + " ";
  }
  return {};
}

}  // namespace

TEST_CASE("memory categories: names as the metrics file spells them") {
  CHECK(memory::name(Category::Parameters) == "parameters");
  CHECK(memory::name(Category::OptimizerState) == "optimizer_state");
  CHECK(memory::name(Category::Workspace) == "workspace");
}

TEST_CASE("memory categories: scopes nest and restore; Workspace outside any scope") {
  CHECK(memory::current_category() == Category::Workspace);
  {
    memory::CategoryScope a(Category::Activations);
    CHECK(memory::current_category() == Category::Activations);
    {
      memory::CategoryScope g(Category::Gradients);
      CHECK(memory::current_category() == Category::Gradients);
    }
    CHECK(memory::current_category() == Category::Activations);
  }
  CHECK(memory::current_category() == Category::Workspace);

  const auto before = memory::snapshot();
  Tensor w({10});  // 40 bytes, no scope
  memory::CategoryScope a(Category::Activations);
  Tensor x({3, 4});                                   // 48 bytes in the scope
  Tensor p({5}, Category::Parameters);                // 20 bytes, named explicitly
  CHECK(grown(before, Category::Workspace) == 40);
  CHECK(grown(before, Category::Activations) == 48);
  CHECK(grown(before, Category::Parameters) == 20);
  CHECK(memory::live_bytes() - before.total.live == 108);
  CHECK(memory::snapshot().total.live - before.total.live == 108);
}

TEST_CASE("memory categories: a moved tensor is freed from its own category, a copy counts in the current one") {
  const auto before = memory::snapshot();
  Tensor g({8}, Category::Gradients);  // 32 bytes
  {
    memory::CategoryScope a(Category::Activations);
    Tensor moved = std::move(g);  // move construction: the storage and its category move
    CHECK(grown(before, Category::Gradients) == 32);
    CHECK(grown(before, Category::Activations) == 0);
    Tensor copy = moved;  // copy construction: a new allocation in the current scope
    CHECK(grown(before, Category::Activations) == 32);

    Tensor target({2}, Category::Parameters);  // 8 bytes
    target = std::move(copy);                   // move assignment: target now holds activation bytes
    CHECK(grown(before, Category::Parameters) == 0);
    CHECK(grown(before, Category::Activations) == 32);

    Tensor dest({1}, Category::OptimizerState);  // 4 bytes
    dest = moved;                                 // copy assignment: the destination's category allocates
    CHECK(grown(before, Category::OptimizerState) == 32);
    CHECK(grown(before, Category::Gradients) == 32);
  }  // moved (gradient bytes), target (activation bytes), dest (optimizer bytes) freed here
  for (Category c : memory::all_categories) CHECK(grown(before, c) == 0);
  CHECK(memory::live_bytes() == before.total.live);
}

TEST_CASE("memory categories: a Tensor made outside a scope and filled inside it keeps its category") {
  const auto before = memory::snapshot();
  Tensor out;  // empty, Workspace
  {
    memory::CategoryScope a(Category::Activations);
    out = Tensor({6});  // move assignment of a tensor made in the scope: Activations
    CHECK(grown(before, Category::Activations) == 24);
  }
  out = Tensor({6});  // made outside: Workspace; the activation bytes are freed
  CHECK(grown(before, Category::Activations) == 0);
  CHECK(grown(before, Category::Workspace) == 24);
}

TEST_CASE("memory categories: peaks per category and of the total; reset_peak restarts all") {
  memory::reset_peak();
  const auto before = memory::snapshot();
  {
    Tensor a({100}, Category::Activations);  // 400
    Tensor b({50}, Category::Workspace);     // 200: total +600
  }
  {
    Tensor c({150}, Category::Activations);  // 600 alone: total +600 again
  }
  const auto after = memory::snapshot();
  CHECK(after[Category::Activations].peak - before[Category::Activations].live == 600);
  CHECK(after[Category::Workspace].peak - before[Category::Workspace].live == 200);
  CHECK(after.total.peak - before.total.live == 600);  // not 600 + 200: never held together
  CHECK(memory::peak_bytes() == after.total.peak);
  memory::reset_peak();
  const auto reset = memory::snapshot();
  for (Category c : memory::all_categories) CHECK(reset[c].peak == reset[c].live);
  CHECK(reset.total.peak == reset.total.live);
}

TEST_CASE("memory categories: each thread has its own counters and its own current category") {
  const auto before = memory::snapshot();
  memory::CategoryScope a(Category::Activations);
  std::int64_t other_grown = 0, other_gradients = 0;
  Category other_default = Category::Parameters;
  std::thread t([&] {
    other_default = memory::current_category();  // the scope above is this thread's, not that one's
    const auto start = memory::snapshot();
    Tensor x({1000});                     // Workspace on the new thread
    Tensor y({10}, Category::Gradients);  // 40
    other_grown = grown(start, Category::Workspace);
    other_gradients = grown(start, Category::Gradients);
  });
  t.join();
  CHECK(other_default == Category::Workspace);
  CHECK(other_grown == 4000);
  CHECK(other_gradients == 40);
  CHECK(memory::live_bytes() == before.total.live);  // nothing of the other thread counted here
}

TEST_CASE("memory: a Parameters block of 4 MiB or more is advised to use huge pages (the kernel marks it hg)") {
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
    MESSAGE("skipped: no transparent huge pages on this system");
    return;
  }
  const Tensor weight({1024, 2048}, Category::Parameters);  // 8 MiB
  const auto first = reinterpret_cast<std::uintptr_t>(weight.data());
  const std::uintptr_t inside = (first + memory::detail::huge_page_bytes - 1) & ~(memory::detail::huge_page_bytes - 1);
  const std::string flags = vm_flags(inside);
  REQUIRE(!flags.empty());
  CHECK_MESSAGE(flags.find(" hg ") != std::string::npos, flags);
}

}  // namespace core_memory_categories_test
