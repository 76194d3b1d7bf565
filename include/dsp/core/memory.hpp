#pragma once
// Host memory accounting: live and peak bytes of counted storage (Tensor storage and the
// buffers that use CountingAllocator, e.g. the gradient buckets' payloads), per allocating
// thread (with ranks as threads, per rank) and per category: the categories of the memory
// ledger (plan/ledger.hpp, DESIGN.md section 5), so the ledger's prediction can be tested
// against what was measured.
//
// Which category an allocation counts in:
//   * every counted container has a category, fixed when it is constructed: the one named
//     explicitly (CountingAllocator(Category), Tensor(shape, Category)) or else the calling
//     thread's current category (the innermost CategoryScope; Workspace when none is active);
//   * a copy of a container (Tensor copy construction) is a new allocation made here: it
//     counts in the current category, not the source's;
//   * moving a container (construction or assignment) moves its storage together with the
//     storage's category, so bytes are subtracted from the category they were added to;
//   * copy assignment keeps the destination's category (the destination's allocator allocates).
// Tagged at the source: dsp::Parameter's value (Parameters) and grad (Gradients),
// zero::ZeroOptimizer's moments (OptimizerState), dp::GradBuckets' payloads (Communication). The
// trainer runs the pipeline schedule (forward and backward) inside an Activations scope, so
// Activations there means everything the schedule allocates: the stashed activations of the
// micro-batches in flight plus the temporaries of the layer running (the ledger's activations
// plus workspace). Everything allocated outside any scope (the optimizer's and clipping's
// temporaries, evaluation, checkpoint copies) is Workspace.
//
// Storage freed by another thread than the one that allocated it is subtracted from the freeing
// thread's count (tensors here stay on their rank's thread and the communication threads
// allocate none; the exception is the failure path, where buffers kept for in-flight
// communication are freed at process exit).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dsp::memory {

/// What memory is for: the memory ledger's categories (plan::MemoryLedger).
enum class Category { Parameters, Gradients, OptimizerState, Activations, Communication, Workspace };
inline constexpr std::size_t num_categories = 6;
/// Every category, in the enum's order (the index of Snapshot::categories).
inline constexpr std::array<Category, num_categories> all_categories{
    Category::Parameters,    Category::Gradients,     Category::OptimizerState,
    Category::Activations,   Category::Communication, Category::Workspace};

/// snake_case name ("parameters", "gradients", "optimizer_state", "activations",
/// "communication", "workspace"), as the metrics file spells it.
constexpr std::string_view name(Category c) {
  constexpr std::array<std::string_view, num_categories> names{"parameters",  "gradients",     "optimizer_state",
                                                               "activations", "communication", "workspace"};
  return names[static_cast<std::size_t>(c)];
}

/// Live and peak bytes.
struct Counter {
  std::int64_t live = 0;  ///< bytes allocated and not yet freed
  std::int64_t peak = 0;  ///< largest `live` since the thread started or reset_peak()
};

/// One thread's counters: per category and the total. A category's peak is the largest live of
/// that category alone; the total's peak is the largest live of all categories together (at
/// most, and usually less than, the sum of the categories' peaks).
struct Snapshot {
  std::array<Counter, num_categories> categories;
  Counter total;
  const Counter& operator[](Category c) const { return categories[static_cast<std::size_t>(c)]; }
};

namespace detail {

struct ThreadState {
  Snapshot counters;
  Category current = Category::Workspace;
};

inline ThreadState& thread_state() {
  thread_local ThreadState s;  // trivially destructible: still counts frees during exit
  return s;
}

/// Adds `bytes` (negative: frees) to category c and to the total of `s`, raising their peaks.
/// Also the device counters' arithmetic (backend/cuda/memory.hpp).
inline void add(Snapshot& s, Category c, std::int64_t bytes) {
  Counter& k = s.categories[static_cast<std::size_t>(c)];
  k.live += bytes;
  k.peak = std::max(k.peak, k.live);
  s.total.live += bytes;
  s.total.peak = std::max(s.total.peak, s.total.live);
}

/// Sets every peak of `s` (categories and total) to its live bytes.
inline void reset_peak(Snapshot& s) {
  for (Counter& c : s.categories) c.peak = c.live;
  s.total.peak = s.total.live;
}

/// Size of a transparent huge page on x86-64 and (with 4 KiB base pages) AArch64 Linux.
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

/// Asks Linux to back the whole 2 MiB pages inside [p, p + bytes) with transparent huge pages
/// (madvise MADV_HUGEPAGE), before their first touch: where the system's THP mode is
/// "madvise" (Debian's default) memory is otherwise mapped in 4 KiB pages, and weights streamed
/// once per decode step are read more slowly (TLB misses; hardware prefetchers stop at every
/// 4 KiB boundary): bench_serving_engine's 100 M model at batch 1 took 12.7 ms per step with
/// huge pages against 15.2 ms without (means of 7 and 15 runs, benchmarks/RESULTS.md). No memory beyond the block is claimed; blocks under two huge pages, other systems
/// and a kernel that refuses the advice are left as they are.
inline void advise_huge_pages(void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < 2 * huge_page_bytes) return;
  const auto first = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t begin = (first + huge_page_bytes - 1) & ~(huge_page_bytes - 1);
  const std::uintptr_t end = (first + bytes) & ~(huge_page_bytes - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace detail

/// The calling thread's counters now.
inline Snapshot snapshot() { return detail::thread_state().counters; }
/// Bytes of counted storage the calling thread holds now, all categories.
inline std::int64_t live_bytes() { return detail::thread_state().counters.total.live; }
/// Most bytes the calling thread held at once, all categories together, since it started or
/// the last reset_peak().
inline std::int64_t peak_bytes() { return detail::thread_state().counters.total.peak; }
/// Starts a new peak measurement, of every category and of the total, at the live bytes.
inline void reset_peak() { detail::reset_peak(detail::thread_state().counters); }

/// The calling thread's current category: the innermost CategoryScope's, Workspace outside any.
inline Category current_category() { return detail::thread_state().current; }

/// Makes `c` the calling thread's current category until the scope ends, then restores the
/// previous one (scopes nest). Not copyable or movable: it belongs to one thread's stack.
class CategoryScope {
 public:
  explicit CategoryScope(Category c) : previous_(current_category()) { detail::thread_state().current = c; }
  ~CategoryScope() { detail::thread_state().current = previous_; }
  CategoryScope(const CategoryScope&) = delete;
  CategoryScope& operator=(const CategoryScope&) = delete;

 private:
  Category previous_;
};

/// std::allocator that counts bytes in the calling thread's counters under its category (the
/// rules at the top of this file: allocators of different categories compare unequal, moves
/// carry the category, copy construction takes the current one).
template <class T>
class CountingAllocator {
 public:
  using value_type = T;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_copy_assignment = std::false_type;
  using propagate_on_container_swap = std::true_type;
  using is_always_equal = std::false_type;

  /// Counts in the calling thread's current category.
  CountingAllocator() noexcept : category_(current_category()) {}
  explicit CountingAllocator(Category c) noexcept : category_(c) {}
  template <class U>
  CountingAllocator(const CountingAllocator<U>& other) noexcept : category_(other.category()) {}

  /// A copied container's allocator: the current category (a copy is a new allocation).
  CountingAllocator select_on_container_copy_construction() const noexcept { return {}; }

  Category category() const noexcept { return category_; }

  /// n elements; Parameters blocks of 4 MiB or more are advised to use huge pages
  /// (detail::advise_huge_pages: the weights every step reads whole).
  T* allocate(std::size_t n) {
    T* p = std::allocator<T>{}.allocate(n);
    if (category_ == Category::Parameters) detail::advise_huge_pages(p, n * sizeof(T));
    detail::add(detail::thread_state().counters, category_, static_cast<std::int64_t>(n * sizeof(T)));
    return p;
  }
  void deallocate(T* p, std::size_t n) noexcept {
    detail::add(detail::thread_state().counters, category_, -static_cast<std::int64_t>(n * sizeof(T)));
    std::allocator<T>{}.deallocate(p, n);
  }
  template <class U>
  bool operator==(const CountingAllocator<U>& other) const noexcept {
    return category_ == other.category();
  }

 private:
  Category category_;
};

}  // namespace dsp::memory
